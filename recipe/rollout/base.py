"""The one interface every rollout engine serves: generate, load weights, sleep and wake.

Prompts and responses are token ids: tokenising and chat templates belong to the recipe's data
layer, so every engine sees the same integers.

Log-probs: per response token, log softmax(logits / temperature) of the full vocabulary (before
top-k / top-p), which is what the actor computes with the same temperature, so the two can be
compared token by token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch

from megatron_bridge.plan.layout import RolloutParallel

WeightStream = Iterable[tuple[str, torch.Tensor]]  # (HF checkpoint name as on the Hub, full tensor)


class WeightLoadError(ValueError):
    """The weight stream does not match the engine's model (missing, extra or misshapen tensor)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off (vLLM's convention)
    max_tokens: int = 16  # response tokens per prompt
    seed: int | None = None  # same seed, prompts and weights: same responses
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling max_tokens must be >= 1, got {self.max_tokens}")


_MASK = (1 << 63) - 1


def request_seed(seed: int | None, index: int, stream: int = 0) -> int | None:
    """A per-request seed from the call's seed, the request's index and a stream (an engine's DP
    rank, or 0 when the caller numbers requests globally): repeated prompts (the recipe's groups)
    get different samples, the same call the same."""
    if seed is None:
        return None
    x = (seed * 0x9E3779B97F4A7C15 + stream * 0xC2B2AE3D27D4EB4F + index * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 31
    return (x * 0x94D049BB133111EB) & _MASK


def token_budgets(prompts: list[list[int]], params: SamplingParams, max_tokens: Sequence[int] | None) -> list[int]:
    """Each prompt's response token budget: ``max_tokens`` per prompt where given (a continued
    request's rest of its budget), else ``params.max_tokens``."""
    if max_tokens is None:
        return [params.max_tokens] * len(prompts)
    if len(max_tokens) != len(prompts):
        raise ValueError(f"{len(max_tokens)} token budgets for {len(prompts)} prompts")
    bad = [n for n in max_tokens if n < 1]
    if bad:
        raise ValueError(f"a prompt's max_tokens must be >= 1, got {bad[0]}")
    return list(max_tokens)


def check_prompts(prompts: list[list[int]], budgets: list[int], vocab_size: int, max_len: int, limit: str) -> None:
    """What every engine refuses, with the prompt's index: empty prompts, ids outside the
    vocabulary, prompt + its token budget beyond the engine's length limit (named by ``limit``)."""
    for i, (prompt, max_tokens) in enumerate(zip(prompts, budgets)):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        if len(prompt) + max_tokens > max_len:
            raise ValueError(f"prompt {i}: {len(prompt)} tokens + max_tokens {max_tokens} exceed the {limit} {max_len}")


@dataclass
class Generation:
    """One response per prompt, in prompt order, without padding."""

    token_ids: list[list[int]]
    log_probs: list[list[float]]  # one per response token (see the module doc)
    # "stop" (EOS / stop token), "length", or "paused" (stopped by the engine's pause(), to be continued)
    finish_reasons: list[str] = field(default_factory=list)
    # the call ended at the engine's pause(); with an engine whose ranks decode together (vLLM) a
    # rank may have no row left to continue, yet takes part in the continuation (recipe.rollout.partial)
    paused: bool = False
    # with routing reported: per response, [prompt + response - 1 tokens, layers, k] int16 expert ids,
    # ascending, from the first prompt token on; the last response token is never fed to the model
    routed_experts: list[torch.Tensor] | None = None
    # an engine that can pause: per request, the sampler to continue it with; stays in the process
    # that generated it (recipe.rollout.partial)
    generators: list[torch.Generator] | None = field(default=None, compare=False, repr=False)

    def rows(self, lo: int, hi: int) -> Generation:
        """Responses ``lo`` to ``hi`` (a part of a call that joined several, ``parts`` below)."""
        return Generation(token_ids=self.token_ids[lo:hi], log_probs=self.log_probs[lo:hi],
                          finish_reasons=self.finish_reasons[lo:hi], paused=self.paused,
                          routed_experts=None if self.routed_experts is None else self.routed_experts[lo:hi],
                          generators=None if self.generators is None else self.generators[lo:hi])


PartDone = Callable[[int, Generation], None]


def part_bounds(parts: Sequence[int] | None, rows: int) -> list[tuple[int, int]]:
    """The row ranges of a call's parts (``generate``'s ``parts``: consecutive row counts); the
    whole call is one part when none are given."""
    if parts is None:
        return [(0, rows)]
    if sum(parts) != rows or any(n < 0 for n in parts):
        raise ValueError(f"parts {list(parts)} do not split {rows} prompts")
    ends = list(itertools.accumulate(parts))
    return [(end - n, end) for n, end in zip(parts, ends)]


def give_remaining_parts(generation: Generation, bounds: list[tuple[int, int]], given: set[int],
                         on_part: PartDone | None) -> None:
    """At the end of a call, each part not given back during it (``given``), from the whole call's responses."""
    if on_part is None:
        return
    for i, (lo, hi) in enumerate(bounds):
        if i not in given:
            on_part(i, generation.rows(lo, hi))


@dataclass(frozen=True)
class EngineArgs:
    """What an engine is built from (``recipe.rollout.ENGINES``); each takes what it uses."""

    model_dir: str
    dtype: torch.dtype
    platform: str  # npu | cuda | cpu
    rollout: RolloutParallel  # TP / DP / EP and memory share
    max_model_len: int  # prompt + response tokens
    seed: int
    return_routed_experts: bool  # report each token's experts (R3, the routing mismatch metrics)
    engine_kwargs: Mapping[str, Any] | None  # the engine's own further arguments
    # shares its devices with the training ranks, taking turns through sleep / wake_up; False: a
    # rollout pool of its own (actor_rollout_ref.hybrid_engine=false), whose engines never sleep
    colocated: bool = True
    # partial rollout (async_training.partial_rollout): pause() must stop a generation between tokens
    pausable: bool = False


@dataclass
class LoadStats:
    tensors: int
    bytes: int


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 request_ids: Sequence[int] | None = None, max_tokens: Sequence[int] | None = None,
                 parts: Sequence[int] | None = None, on_part: PartDone | None = None) -> Generation:
        """One response per prompt; a stop or EOS token that ended a response is its last token.
        ``max_tokens``: per prompt, instead of ``params.max_tokens``.
        ``parts``: the prompts are consecutive parts of that many rows (several calls joined, as a
        rollout rank joins the generation batches of one step); ``on_part(i, generation)`` gets
        part i's responses once all of them have ended, while the others go on, and each part not
        yet given when the call ends (finished, or paused) then.
        With a parallel engine this is a collective: the ranks of one TP group pass the same
        prompts, and every DP rank calls it (with its own prompts, possibly none)."""

    def pause(self) -> None:
        """Partial rollout: stop the generation running now (called from another thread) after the
        current token; its unfinished responses come back with finish reason "paused"."""

    def agree(self, flag: bool) -> bool:
        """``flag`` as every rank of the engine agrees on it (true if true on any rank), where the
        ranks decode together; an engine whose ranks are independent answers its own."""

    def load_weights(self, weights: WeightStream) -> LoadStats:
        """Replace the model's weights from a stream of Hub-format tensors. A stream that does not
        match the model raises WeightLoadError naming the tensor."""

    def sleep(self) -> None:
        """Hand the device memory to the trainer (colocated mode); engines may take a level."""

    def wake_up(self) -> None: ...

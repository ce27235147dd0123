"""The rollout engine on transformers' Qwen3-MoE, on the CPU, CUDA or the NPU: the engine for tests,
the tiny default model, and a GPU machine without vLLM.

It needs nothing but torch and transformers, so the whole RL loop (export, weight sync, rollout,
log-prob comparison) runs on a laptop or in CI, on the model code the trainer's parity tests use.
It is not fast: one plain KV-cache decoding loop over a left-padded batch (on an accelerator with
batched sampling and few host reads, ``_inverse_cdf`` and ``generate``).

Weights arrive in the Hub checkpoint format (one tensor per expert and projection), while
transformers 5 keeps each layer's experts fused:

    model.layers.L.mlp.experts.gate_up_proj  [E, 2I, H]  rows 0:I gate_proj, I:2I up_proj of expert e
    model.layers.L.mlp.experts.down_proj     [E, H, I]   expert e's down_proj

so ``load_weights`` writes each Hub tensor into its slot of the fused tensor (the inverse of
transformers' ``MergeModulelist`` + ``Concatenate`` conversion for ``qwen2_moe``-style models).

Log-probs follow ``recipe.rollout.base``: log softmax(logits / temperature) over the full
vocabulary in float32, before top-k / top-p; greedy decoding (temperature 0) reports them at
temperature 1.

With ``return_routed_experts`` each response comes with the experts every MoE layer chose for each
of its tokens while generating (the prefill for the prompt, one decode step per response token),
which routing replay (R3) and the train-rollout routing metrics use.
"""

from __future__ import annotations

import inspect
import os
import re
import threading
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    PreTrainedConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from megatron_bridge.moe.hf_routing import HFRoutingRecorder
from recipe.rollout.base import (
    EngineArgs,
    Generation,
    LoadStats,
    PartDone,
    SamplingParams,
    WeightLoadError,
    WeightStream,
    check_prompts,
    give_remaining_parts,
    part_bounds,
    request_seed,
    token_budgets,
)

_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_MISSING_SHOWN = 5  # missing names listed in a WeightLoadError
_UNCHANGED = " (the engine's weights are unchanged)"
_LOOK_EVERY = 8  # tokens between the host's reads of whether any row goes on, on an accelerator


@dataclass(frozen=True)
class _Slot:
    """Where one Hub tensor goes: a model parameter, or an index into a fused expert parameter."""

    param: str
    index: tuple  # () for the whole parameter
    shape: tuple[int, ...]


class HFEngine:
    """``recipe.rollout.base.RolloutEngine`` on ``transformers.Qwen3MoeForCausalLM``.

    ``config`` is a model directory (with ``config.json``) or a transformers config. Without
    ``load_from_checkpoint`` the weights are transformers' random init until ``load_weights``.
    """

    def __init__(
        self,
        config: str | os.PathLike | PreTrainedConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        load_from_checkpoint: bool = False,
        return_routed_experts: bool = False,
    ):
        self.dtype = dtype
        self.device = torch.device(device)
        if isinstance(config, PreTrainedConfig):
            if load_from_checkpoint:
                raise ValueError("load_from_checkpoint needs a model directory, not a config object")
        else:
            directory, config = config, AutoConfig.from_pretrained(config)
        if config.model_type != "qwen3_moe":
            raise ValueError(f"HFEngine serves qwen3_moe models, got model_type {config.model_type!r}")
        if load_from_checkpoint:
            model = Qwen3MoeForCausalLM.from_pretrained(directory, dtype=dtype)
        else:
            # a copy: from_config writes the dtype into the config it is given. Its random init
            # draws from the global RNG, which the engine leaves as it was.
            config = Qwen3MoeConfig.from_dict(config.to_dict())
            with torch.random.fork_rng(devices=[]):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.config = self.model.config
        self.eos_token_ids = _eos_token_ids(self.model)
        self.routing = HFRoutingRecorder(self.model) if return_routed_experts else None
        # transformers renamed forward's ``past_key_values`` to ``cache`` (the old name goes in 5.40)
        self._cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self._slots = _hub_slots(self.model)
        self._spare: dict[str, torch.Tensor] = {}  # staging tensors for the next load_weights
        self._asleep = False
        self._pause = threading.Event()  # set by pause() from another thread, read between tokens

    # -- weights ------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: WeightStream) -> LoadStats:
        """Replace every weight from a stream of Hub-format tensors (any float dtype, any device).

        Each tensor is copied into a staging tensor before the next one is pulled (the producer may
        reuse its buffer) and cast to the engine dtype. The staged weights replace the model's only
        once the whole stream has matched the model, so a WeightLoadError leaves the engine as it
        was. Staging takes a second copy of the weights on the device they are on (the host while
        asleep); a CPU engine keeps it for the next load (see below).
        """
        params = dict(self.model.named_parameters())
        staged: dict[str, torch.Tensor] = {}
        seen: set[str] = set()
        count = nbytes = 0
        for name, tensor in weights:
            slot = self._slots.get(name)
            if slot is None:
                raise WeightLoadError(f"unexpected tensor {name!r}: not a weight of this model{_UNCHANGED}")
            if name in seen:
                raise WeightLoadError(f"tensor {name!r} appears twice in the stream{_UNCHANGED}")
            if tuple(tensor.shape) != slot.shape:
                shape = tuple(tensor.shape)
                raise WeightLoadError(f"tensor {name!r} has shape {shape}, the model's is {slot.shape}{_UNCHANGED}")
            seen.add(name)
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
            if slot.param not in staged:
                spare = self._spare.get(slot.param)
                staged[slot.param] = spare if spare is not None else torch.empty_like(params[slot.param])
            staged[slot.param][slot.index].copy_(tensor)
        if len(seen) < len(self._slots):
            missing = [name for name in self._slots if name not in seen]
            shown = ", ".join(missing[:_MISSING_SHOWN]) + (", ..." if len(missing) > _MISSING_SHOWN else "")
            raise WeightLoadError(f"the stream lacks {len(missing)} tensor(s): {shown}{_UNCHANGED}")
        # every slot of every parameter was written, so each staged tensor is complete
        replaced = {}
        for name, tensor in staged.items():
            replaced[name] = params[name].data
            params[name].data = tensor
        # On the CPU the replaced tensors stage the next load: writing into fresh pages costs 3-4x
        # the copy itself (first-touch page faults). A device keeps no spare: it would hold device
        # memory that sleep() must give back.
        self._spare = replaced if self.device.type == "cpu" else {}
        return LoadStats(tensors=count, bytes=nbytes)

    # -- generation ---------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop the generation running now (called from another thread) after its current token:
        its unfinished responses come back with finish reason "paused" (``recipe.rollout.partial``).
        A generation that starts later clears the request, so one that came too late stops nothing."""
        self._pause.set()

    def agree(self, flag: bool) -> bool:
        """Each rank's engine generates on its own: its own flag."""
        return flag

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 request_ids: Sequence[int] | None = None, max_tokens: Sequence[int] | None = None,
                 parts: Sequence[int] | None = None, on_part: PartDone | None = None,
                 generators: Sequence[torch.Generator] | None = None) -> Generation:
        """One response per prompt. With a seed, each request samples from its own generator
        (seeded by the seed and its request id, default its index), so a response does not depend
        on which other prompts share the batch or the engine. ``max_tokens``: per prompt, instead
        of ``params.max_tokens``. ``parts``, ``on_part``: a part is given back at the token its
        last response ends (``RolloutEngine.generate``); its rows go on decoding as padding until
        the call ends. ``generators``: the requests' own, as a paused generation returned them, to
        continue their samples instead of seeding anew."""
        self._pause.clear()
        if self._asleep:
            raise RuntimeError("engine is asleep; call wake_up() first")
        bounds = part_bounds(parts, len(prompts))
        if not prompts:
            empty = Generation(token_ids=[], log_probs=[], finish_reasons=[],
                               routed_experts=[] if self.routing else None, generators=[])
            give_remaining_parts(empty, bounds, set(), on_part)
            return empty
        budgets = token_budgets(prompts, params, max_tokens)
        check_prompts(prompts, budgets, self.config.vocab_size, self.config.max_position_embeddings,
                      "model's max_position_embeddings")
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left padding: every row's next token is in the last column
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each prompt starts at position 0

        if params.seed is None:  # nothing to reproduce: a continuation draws afresh too
            generators = [torch.Generator()]
            generators[0].seed()
        else:
            ids = range(batch) if request_ids is None else request_ids
            if len(ids) != batch:
                raise ValueError(f"{len(ids)} request ids for {batch} prompts")
            generators = generators or [torch.Generator().manual_seed(request_seed(params.seed, i))
                                        for i in ids]
        stop_ids = torch.tensor(
            sorted(self.eos_token_ids | set(params.stop_token_ids)), dtype=torch.long, device=self.device
        )

        steps = max(budgets)
        tokens = torch.empty(batch, steps, dtype=torch.long, device=self.device)
        log_probs = torch.empty(batch, steps, dtype=torch.float32, device=self.device)
        lengths = torch.tensor(budgets, device=self.device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=self.device)  # by a stop token
        paused = False
        cache = DynamicCache(config=self.config)
        fed_routing = []  # per model call: [batch, tokens fed, layers, k]

        def responses(lo: int, hi: int) -> Generation:
            """Rows lo to hi as they stand: a part whose rows have all ended, or the whole call at its end."""
            n = lengths[lo:hi].tolist()
            routed = None
            if self.routing is not None:
                fed = torch.cat(fed_routing, dim=1).cpu()  # columns: the left-padded prompt, then response tokens 0, 1, ...
                routed = [fed[lo + i, width - len(prompts[lo + i]) : width + k - 1].clone() for i, k in enumerate(n)]
            return Generation(
                token_ids=[row[:k] for row, k in zip(tokens[lo:hi].tolist(), n)],
                log_probs=[row[:k] for row, k in zip(log_probs[lo:hi].tolist(), n)],
                finish_reasons=["stop" if s else "paused" if paused and g else "length"
                                for s, g in zip(stopped[lo:hi].tolist(), going[lo:hi].tolist())],
                paused=paused,
                routed_experts=routed,
                generators=list(generators[lo:hi]) if len(generators) == batch else generators * (hi - lo),
            )

        given: set[int] = set()  # the parts given back during the loop
        # Whether any row goes on is read on the host every token on the CPU; on an accelerator that
        # read waits for the device, so it is read every few tokens (rows that ended decode padding
        # meanwhile, cut below).
        look_every = 1 if self.device.type == "cpu" else _LOOK_EVERY
        for step in range(steps):
            logits = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                **{self._cache_kwarg: cache},
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            if self.routing is not None:
                fed_routing.append(self.routing.take(self.device).view(batch, input_ids.shape[1], -1, self.routing.topk))
            token, log_prob = _sample(logits.float(), params, generators, by_inverse_cdf=self.device.type != "cpu")
            tokens[:, step], log_probs[:, step] = token, log_prob
            # finished rows go on decoding (keeps the batch rectangular); their tail is cut below
            newly = ~stopped & (step < lengths) & torch.isin(token, stop_ids)
            lengths = torch.where(newly, step + 1, lengths)
            stopped |= newly
            going = ~stopped & (lengths > step + 1)
            if self._pause.is_set() and bool(going.any()):
                lengths = torch.where(going, step + 1, lengths)
                paused = True
                break
            if (step + 1) % look_every == 0:  # after the last step the loop ends anyway
                if not bool(going.any()):
                    break
                if on_part is not None:
                    for i, (lo, hi) in enumerate(bounds):
                        if i not in given and not bool(going[lo:hi].any()):
                            given.add(i)
                            on_part(i, responses(lo, hi))
            input_ids = token[:, None]
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            positions = positions[:, -1:] + 1

        whole = responses(0, batch)
        give_remaining_parts(whole, bounds, given, on_part)
        return whole

    # -- colocated mode -----------------------------------------------------------------------

    def sleep(self) -> None:
        """Give the device memory to the trainer: weights go to the host (on the CPU there is nothing
        to move). ``load_weights`` works while asleep and writes the host copies; ``generate`` does not."""
        if self._asleep:
            return
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.accelerator.empty_cache()
        self._asleep = True

    def wake_up(self) -> None:
        if not self._asleep:
            return
        if self.device.type != "cpu":
            self.model.to(self.device)
        self._asleep = False


def build(args: EngineArgs) -> HFEngine:
    """``recipe.rollout.ENGINES``'s entry: one process, no parallelism, no further arguments."""
    device = "cpu" if args.platform == "cpu" else torch.device(args.platform, torch.accelerator.current_device_index())
    return HFEngine(args.model_dir, dtype=args.dtype, device=device, return_routed_experts=args.return_routed_experts)


def _hub_slots(model: Qwen3MoeForCausalLM) -> dict[str, _Slot]:
    """Every Hub tensor name the model needs, in model order. Tied weights appear once (as
    ``named_parameters`` lists them), as on the Hub."""
    slots = {}
    for name, param in model.named_parameters():
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            slots[name] = _Slot(name, (), tuple(param.shape))
        elif m[2] == "gate_up_proj":
            experts, two_i, hidden = param.shape
            i = two_i // 2
            for e in range(experts):
                slots[f"{m[1]}.{e}.gate_proj.weight"] = _Slot(name, (e, slice(0, i)), (i, hidden))
                slots[f"{m[1]}.{e}.up_proj.weight"] = _Slot(name, (e, slice(i, two_i)), (i, hidden))
        else:
            experts, hidden, i = param.shape
            for e in range(experts):
                slots[f"{m[1]}.{e}.down_proj.weight"] = _Slot(name, (e,), (hidden, i))
    return slots


def _eos_token_ids(model: Qwen3MoeForCausalLM) -> set[int]:
    """The config's EOS ids and the generation config's (Qwen3 lists a second one only there)."""
    ids = set()
    for source in (model.config, model.generation_config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return ids


def _sample(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator],
            by_inverse_cdf: bool = False):
    """One token per row of float32 ``logits`` [B, V], and its log-prob (see the module doc).
    ``generators`` (on the host): one for the whole batch, or one per row. ``by_inverse_cdf``: draw
    with ``_inverse_cdf`` instead of ``torch.multinomial`` (an engine on an accelerator)."""
    if params.temperature == 0:
        token = logits.argmax(-1)
        log_probs = logits.log_softmax(-1)
    else:
        scaled = logits / params.temperature
        log_probs = scaled.log_softmax(-1)
        # vLLM's order: top-k, then top-p on what top-k kept
        if params.top_k != -1 and params.top_k < scaled.shape[-1]:
            kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if params.top_p < 1:
            ordered, order = scaled.sort(dim=-1, descending=True)
            probs = ordered.softmax(-1)
            # drop a token once the more likely ones already hold top_p (the most likely always stays)
            drop = (probs.cumsum(-1) - probs) >= params.top_p
            scaled = scaled.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        probs = scaled.softmax(-1)
        if by_inverse_cdf:
            token = _inverse_cdf(probs, generators)
        elif len(generators) == 1:
            token = torch.multinomial(probs, 1, generator=generators[0])[:, 0]
        else:
            token = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])
    return token, log_probs.gather(-1, token[:, None])[:, 0]


def _inverse_cdf(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` [B, V]: a uniform per row from its host generator (or B from
    the one), then the first token whose cumulative probability exceeds it, for all rows at once.
    On a GPU ``torch.multinomial`` with a generator per row costs a dozen kernel launches per row
    and token: 2/3 of the tiny job's generation on an H100 (docs/bench_device.md). A token of
    probability 0 (cut by top-k / top-p) covers no interval and is never drawn."""
    if len(generators) == 1:
        uniform = torch.rand(probs.shape[0], generator=generators[0])
    else:
        uniform = torch.cat([torch.rand(1, generator=g) for g in generators])
    cdf = probs.cumsum(-1)
    target = uniform.to(probs.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)

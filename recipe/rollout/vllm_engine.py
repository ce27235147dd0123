"""The rollout engine on vLLM (CUDA) or vLLM-Ascend (NPU), colocated with the Megatron trainer or
in a rollout pool of its own.

vLLM runs in its "external launcher" mode (SPMD, as in verl's and slime's colocated rollout): each
rank of the rollout is one vLLM rank in a process the recipe started, and vLLM joins the
torch.distributed world that process is in. Colocated, every training rank is also a vLLM rank,
in the training ranks' world, and takes turns with the trainer for the device memory through sleep
mode; in a pool of its own (``actor_rollout_ref.hybrid_engine=false``) the rollout ranks form a
world of their own and the engine never sleeps (``EngineArgs.colocated``). Written against
vllm 0.11.0 with vllm-ascend 0.11.0rc1; see docs/rollout.md ("vLLM and vLLM-Ascend engine").

The environment and the ``vllm.LLM`` arguments come from ``recipe.rollout.vllm_setup``, the checks
on the weight stream from ``recipe.rollout.vllm_weights``; each lists the vLLM facts it relies on.
The pure functions here (``vllm_sampling_kwargs``, ``to_generation``, ...) do not import vllm, so
they are tested without it; ``VLLMEngine`` imports vllm in its constructor.

API facts relied on (vllm-project/vllm, vllm-project/vllm-ascend; versions as noted):

- With external_launcher, prompts are split over DP ranks by the caller (examples/offline_inference/
  torchrun_dp_example.py, which also documents the model path
  ``llm.llm_engine.model_executor.driver_worker.worker.model_runner.model``).
- All ranks of one engine must sample alike, so they need the same seed (torchrun_dp_example.py).
- ``enable_sleep_mode=True``; ``LLM.sleep(level=1)`` offloads weights to host memory and discards the
  KV cache, level 2 discards both; ``LLM.wake_up(tags=["weights"] | ["kv_cache"] | None)`` (vLLM docs
  features/sleep_mode; vllm-ascend docs user_guide/feature_guide/sleep_mode, v0.11.0).
- ``load_format="dummy"``: random weights at start, the first sync gives the real ones (verl).
- ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob; ``CompletionOutput`` has
  ``token_ids``, ``logprobs`` (per position ``{token_id: Logprob(logprob=...)}``) and
  ``finish_reason`` ("stop" | "length" | "abort"); stop / EOS tokens stay in ``token_ids``.
- vllm-ascend 0.11: AscendUnquantizedFusedMoEMethod transposes w13/w2 once after the first load
  (a ``transpose`` flag) and AscendFusedMoE's ``_load_w13`` / ``_load_w2`` transpose later HF tensors
  to match (``transpose_weight``, vllm-ascend PR #2756, Sept 2025); MindSpeed-RL's verl patch calls
  ``vllm.model_executor.model_loader.utils.process_weights_after_loading(model, model_config,
  device)`` after each sync on NPU (verl_npu/patch/verl/d62da4950/vllm_rollout_spmd.patch).
- vllm-ascend 0.11's NPU model runner builds ``AscendSampler()`` without the configured
  ``logprobs_mode`` (vllm_ascend/worker/model_runner_v1.py; cf. vllm-ascend PR #8643), so on NPU
  the log-probs may be raw ones: the engine reads the sampler's mode and warns (``logprobs_mode``).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import sys
import threading
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import torch

from megatron_bridge.plan.layout import RolloutParallel
from megatron_bridge.plan.model_spec import load_hf_config
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
from recipe.rollout.partial import PAUSED
from recipe.rollout.vllm_setup import (
    LOGPROBS_MODE,
    VLLM_VERSION,
    apply_env,
    check_env,
    check_launcher_env,
    check_rollout_parallel,
    engine_args,
    has_tokenizer,
    model_eos_token_ids,
    require_vllm,
    rollout_env,
    routed_experts_problem,
)
from recipe.rollout.vllm_weights import (
    _PARTIAL,
    CheckedStream,
    _listed,
    hub_tensor_shapes,
    local_experts,
    missing_local_experts,
    reattach_moe_weight_loaders,
)

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")  # vLLM's sleep-mode memory tags, woken in this order


# -- sampling (pure) ----------------------------------------------------------------------------


def stream_seed(seed: int, rank: int, tp: int) -> int:
    """The seed of global ``rank``'s sampling stream: equal within a TP group (vLLM puts TP
    innermost, so the group is ``rank // tp``), different between DP ranks, whose prompts may repeat
    each other's (the recipe's groups)."""
    return seed + rank // tp


def vllm_sampling_kwargs(
    params: SamplingParams, *, eos_token_ids: Sequence[int] = (), index: int = 0, stream: int = 0,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments for request ``index`` (one response per prompt);
    ``max_tokens`` overrides ``params.max_tokens`` (a continued request's rest of its budget)."""
    return {
        "n": 1,  # the recipe repeats prompts itself
        "temperature": params.temperature,  # 0: greedy
        "top_p": params.top_p,
        "top_k": params.top_k,  # -1 (and 0 in vLLM >= 0.10.2): off
        "max_tokens": params.max_tokens if max_tokens is None else max_tokens,
        "seed": request_seed(params.seed, index, stream),
        # the model's EOS ids explicitly: without a tokenizer vLLM only knows generation_config's
        "stop_token_ids": sorted(set(params.stop_token_ids) | set(eos_token_ids)),
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,
    }


# -- output conversion (pure) -------------------------------------------------------------------


def _sampled_log_prob(step: Any, token: int, where: str) -> float:
    try:
        entry = step[token]
    except (KeyError, IndexError, TypeError) as e:
        raise RuntimeError(f"{where}: vLLM's log-probs lack the sampled token {token}") from e
    return float(getattr(entry, "logprob", entry))


def to_generation(outputs: Sequence[Any], prompts: Sequence[Sequence[int]] | None = None,
                  routed_experts: bool = False) -> Generation:
    """``Generation`` from vLLM's ``RequestOutput`` list (``.prompt_token_ids``, ``.outputs[0]`` with
    ``.token_ids``, ``.logprobs``, ``.finish_reason`` and, with ``routed_experts``,
    ``.routed_experts`` [tokens, layers, k] from the first prompt token), checking order and
    completeness."""
    if prompts is not None and len(outputs) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    token_ids, log_probs, reasons, routed = [], [], [], []
    for i, out in enumerate(outputs):
        got = getattr(out, "prompt_token_ids", None)
        if prompts is not None and got is not None and list(got) != list(prompts[i]):
            raise RuntimeError(f"vLLM output {i} belongs to another prompt (outputs out of prompt order)")
        if len(out.outputs) != 1:
            raise RuntimeError(f"request {i}: {len(out.outputs)} completions, expected 1 (n=1)")
        completion = out.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        steps = completion.logprobs
        if steps is None:
            raise RuntimeError(f"request {i}: no log-probs (SamplingParams.logprobs must be 0)")
        if len(steps) != len(ids):
            raise RuntimeError(f"request {i}: {len(steps)} log-prob entries for {len(ids)} tokens")
        if completion.finish_reason not in ("stop", "length", PAUSED):
            raise RuntimeError(f"request {i} finished with {completion.finish_reason!r}, not 'stop' or 'length'")
        token_ids.append(ids)
        log_probs.append([_sampled_log_prob(step, t, f"request {i} token {k}") for k, (step, t) in enumerate(zip(steps, ids))])
        reasons.append(completion.finish_reason)
        if routed_experts:
            routed.append(_routed_experts(completion, len(out.prompt_token_ids) + len(ids) - 1, i))
    return Generation(token_ids=token_ids, log_probs=log_probs, finish_reasons=reasons,
                      routed_experts=routed if routed_experts else None)


def _routed_experts(completion: Any, tokens: int, i: int) -> torch.Tensor:
    """The experts of the prompt and response tokens the model read (the last response token it
    never read), as the recipe's int16 [tokens, layers, k], ascending."""
    experts = getattr(completion, "routed_experts", None)
    if experts is None:
        raise RuntimeError(f"request {i}: no routed_experts although the engine was asked for them")
    table = torch.as_tensor(experts)
    if table.dim() != 3 or table.shape[0] < tokens:
        raise RuntimeError(f"request {i}: routed_experts has shape {tuple(table.shape)}, expected [>= {tokens}, layers, k]")
    return table[:tokens].sort(dim=-1).values.to(torch.int16)


class DeltaOutputs:
    """The responses of requests run step by step (``RequestOutputKind.DELTA``: each step's
    ``RequestOutput`` holds the request's new tokens and their log-probs only), gathered per request
    so that a pause can return what each has so far."""

    def __init__(self, request_ids: Sequence[str], prompts: Sequence[Sequence[int]]):
        self.prompts = dict(zip(request_ids, prompts))
        self.tokens: dict[str, list[int]] = {r: [] for r in request_ids}
        self.log_probs: dict[str, list[Any]] = {r: [] for r in request_ids}
        self.reasons: dict[str, str | None] = dict.fromkeys(request_ids)

    def add(self, step_outputs: Sequence[Any]) -> None:
        for out in step_outputs:
            completion = out.outputs[0]
            new = list(completion.token_ids)
            self.tokens[out.request_id] += new
            # vLLM slices a delta's log-probs as [-len(new):], which is everything when nothing is new
            self.log_probs[out.request_id] += list(completion.logprobs or [])[-len(new):] if new else []
            if out.finished:
                self.reasons[out.request_id] = completion.finish_reason

    def unfinished(self) -> list[str]:
        return [r for r, reason in self.reasons.items() if reason is None]

    def finished(self, request_ids: Sequence[str]) -> bool:
        return all(self.reasons[r] is not None for r in request_ids)

    def outputs(self, request_ids: Sequence[str] | None = None) -> list[SimpleNamespace]:
        """In request order (of ``request_ids``, default all), as ``to_generation`` reads vLLM's
        outputs; the unfinished ones paused."""
        return [SimpleNamespace(prompt_token_ids=self.prompts[r], outputs=[SimpleNamespace(
                    token_ids=self.tokens[r], logprobs=self.log_probs[r], finish_reason=self.reasons[r] or PAUSED)])
                for r in (self.reasons if request_ids is None else request_ids)]


# -- vLLM's model runner (pure) -----------------------------------------------------------------


def unwrap_model(model: Any) -> torch.nn.Module:
    """The nn.Module behind vLLM's CUDAGraphWrapper / vllm-ascend's ACLGraphWrapper (``.runnable``)."""
    for _ in range(4):
        if isinstance(model, torch.nn.Module) or getattr(model, "runnable", None) is None:
            break
        model = model.runnable
    if not isinstance(model, torch.nn.Module):
        raise RuntimeError(f"vLLM's model_runner.model is a {type(model).__name__}, not an nn.Module")
    return model


def find_model_runner(llm: Any) -> Any:
    """This rank's model runner in a colocated (in-process) vLLM 0.11 V1 engine."""
    engine = llm.llm_engine
    executors = [getattr(engine, "model_executor", None)]  # V1 LLMEngine sets it when not multiprocessing
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore
    executors.append(getattr(core, "model_executor", None))
    for executor in executors:
        worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
        runner = getattr(worker, "model_runner", None)
        if runner is not None:
            return runner
    raise RuntimeError(
        "cannot reach vLLM's model runner at llm.llm_engine.model_executor.driver_worker.worker.model_runner: "
        "the engine is not in-process (external_launcher sets VLLM_ENABLE_V1_MULTIPROCESSING=0) or the vLLM "
        f"version is not the {VLLM_VERSION} this engine is written for"
    )


def effective_logprobs_mode(sampler: Any) -> str | None:
    """The log-prob mode the runner's sampler really uses (its top-k/top-p sampler's if different)."""
    mode = getattr(sampler, "logprobs_mode", None)
    inner = getattr(getattr(sampler, "topk_topp_sampler", None), "logprobs_mode", None)
    mode, inner = (str(getattr(m, "value", m)) if m is not None else None for m in (mode, inner))
    if mode is not None and inner is not None and inner != mode:
        return f"{mode} (top-k/top-p sampler: {inner})"
    return mode


# -- the engine ---------------------------------------------------------------------------------


def _device_rng(platform: str) -> Any:
    """The module whose get_rng_state / set_rng_state / manual_seed act on this rank's device."""
    return torch.npu if platform == "npu" else torch.cuda


@contextmanager
def _preserved_rngs(device_rng: Any):
    """Keep the trainer's RNG states: vLLM's worker reseeds torch, random and numpy at start."""
    import numpy as np

    states = torch.get_rng_state(), device_rng.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        device_rng.set_rng_state(states[1])
        random.setstate(states[2])
        np.random.set_state(states[3])


class VLLMEngine:
    """``recipe.rollout.base.RolloutEngine`` on vLLM / vLLM-Ascend.

    Every rank of the rollout constructs it, in the torch.distributed world of the rollout's ranks
    (colocated: the training ranks'; RANK, LOCAL_RANK, ... in the environment) with the platform
    activated. The engine starts with random weights, and asleep when sleep mode is on (colocated):
    ``load_weights`` the trainer's, ``wake_up``, then ``generate``.

    ``rollout`` gives TP / DP / EP, ``gpu_memory_utilization`` and ``max_num_seqs`` (the layout's
    ``actor_rollout_ref.rollout``); the two keyword arguments of the same name override it.
    ``engine_kwargs`` passes further ``vllm.LLM`` arguments. ``process_after_load`` runs vLLM's
    ``process_weights_after_loading`` after each sync (default: on NPU, as MindSpeed-RL does).
    ``pausable`` (partial rollout): ``generate`` runs vLLM's step loop itself and the ranks vote on
    ``pause`` before each step, so that all stop at the same step (``_generate_stepped``).

    Randomness: the ranks of one TP group must draw the same samples. With ``SamplingParams.seed``
    each request gets its own seed (``request_seed``: from the seed, the request's index and the DP
    rank); without it vLLM samples from the device's default generator, which the engine swaps for
    its own stream (seeded per DP rank) during ``generate``, so the trainer's use of that generator
    cannot make the TP ranks diverge, and generation does not move the trainer's RNG.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        rollout: RolloutParallel,
        *,
        platform: str | None = None,
        dtype: str | torch.dtype = "bfloat16",
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_num_seqs: int | None = None,
        seed: int = 0,
        enable_sleep_mode: bool = True,
        sleep_level: int = 1,
        enforce_eager: bool = False,
        load_format: str = "dummy",
        process_after_load: bool | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        return_routed_experts: bool = False,
        pausable: bool = False,
    ):
        if platform is None:
            from megatron_bridge.runtime.platform import active

            platform = active().name
        require_vllm(platform)  # first, so a missing vLLM is the error one sees
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 (weights to host memory) or 2 (weights discarded), got {sleep_level}")
        check_rollout_parallel(rollout)
        self.platform, self.rollout, self.sleep_level = platform, rollout, sleep_level
        self.enable_sleep_mode = enable_sleep_mode
        self.model_path = os.fspath(model_path)
        hf_config = load_hf_config(self.model_path)
        self.expected = hub_tensor_shapes(hf_config)
        self.vocab_size = int(hf_config["vocab_size"])
        self.max_model_len = max_model_len or int(hf_config["max_position_embeddings"])
        self.eos_token_ids = sorted(model_eos_token_ids(self.model_path))
        self.process_after_load = platform == "npu" if process_after_load is None else process_after_load
        self.not_updated: list[str] = []  # parameters the last load_weights left alone, per vLLM

        # the environment, before vllm is imported
        report = apply_env(rollout_env(platform))
        for name, (user, ours) in report.kept.items():
            logger.warning("rollout env: keeping %s=%r set by the user (the engine would set %r)", name, user, ours)
        check = check_env(platform, os.environ, enable_sleep_mode)
        for warning in check.warnings:
            logger.warning("rollout env: %s", warning)
        if check.errors:
            raise RuntimeError("the environment breaks the vLLM rollout:\n- " + "\n- ".join(check.errors))
        if "vllm" in sys.modules and report.set:
            logger.warning("vllm was imported before VLLMEngine set %s; they may come too late", ", ".join(report.set))
        self.env = report

        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: the rollout's ranks join their world first (megatron_bridge."
                "runtime.platform.init_distributed: the training ranks' world colocated, their own in a rollout pool "
                "of its own), then every rank builds VLLMEngine"
            )
        check_launcher_env(os.environ)
        world, rank = dist.get_world_size(), dist.get_rank()
        check_rollout_parallel(rollout, world)
        self.stream = rank // rollout.tp  # this engine's DP rank, shared by its TP group
        # partial rollout: the ranks agree on a pause over the host (a pause reaches each rank's
        # thread at its own moment, while all must leave vLLM's lockstep at the same step)
        self._pause = threading.Event()
        self._agreement = dist.new_group(backend="gloo") if pausable else None
        self._requests = itertools.count()

        import vllm
        from vllm.inputs import TokensPrompt

        self._vllm, self._tokens_prompt = vllm, TokensPrompt
        if return_routed_experts:
            problem = routed_experts_problem(vllm.EngineArgs, vllm.__version__)
            if problem:
                raise RuntimeError(problem)
        self.return_routed_experts = return_routed_experts
        self.engine_kwargs = engine_args(
            self.model_path, rollout, dtype=dtype, max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs, seed=seed,
            enable_sleep_mode=enable_sleep_mode, enforce_eager=enforce_eager, load_format=load_format,
            skip_tokenizer_init=not has_tokenizer(self.model_path), return_routed_experts=return_routed_experts,
            extra=engine_kwargs,
        )
        self._rng = _device_rng(platform)
        with _preserved_rngs(self._rng):
            self.llm = vllm.LLM(**self.engine_kwargs)
            self._rng.manual_seed(stream_seed(seed, rank, rollout.tp))
            self._gen_rng_state = self._rng.get_rng_state()
        self._asleep: set[str] = set()
        # dummy weights are random: generate refuses until a complete load_weights
        self._weights_valid = load_format != "dummy"

        self.logprobs_mode = effective_logprobs_mode(getattr(find_model_runner(self.llm), "sampler", None))
        if self.logprobs_mode != LOGPROBS_MODE:
            logger.warning(
                "vLLM's sampler reports logprobs_mode=%s, not %s: the rollout log-probs are then not "
                "temperature-scaled (raw) or otherwise differ from recipe.rollout.base's definition; they "
                "match the actor's only at temperature 1 without top-k/top-p (see docs/rollout.md)",
                self.logprobs_mode, LOGPROBS_MODE,
            )
        if enable_sleep_mode:
            self.sleep()  # give the memory back to the trainer until the first sync

    # -- vLLM internals -----------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """vLLM's model on this rank (``...driver_worker.worker.model_runner.model``)."""
        return unwrap_model(find_model_runner(self.llm).model)

    # -- weights ------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: WeightStream) -> LoadStats:
        """Write a stream of Hub-format tensors (full tensors, any float dtype and device) into vLLM.

        vLLM's ``model.load_weights`` writes each tensor into its parameters as it arrives (sharding
        it for this rank's TP / EP place; experts this rank does not hold are skipped), so there is
        no second copy of the weights, and a stream that fails midway leaves a partial update:
        unlike the CPU engine, which stages, the rollout weights are then a mix of old and new.
        The engine remembers this and ``generate`` refuses until a complete stream has been loaded:
        the caller re-syncs (runs the export again). Each tensor is checked against the Hub shapes
        before vLLM sees it, so an unknown, duplicate or misshapen tensor stops the load at that
        tensor; tensors missing at the end (dense ones, or this rank's experts) raise too.

        While asleep, only the weights are woken (the KV cache stays freed: the lowest peak, as
        verl orders it); ``wake_up`` wakes the rest. The prefix cache is reset afterwards (its KV
        was computed with the old weights).
        """
        if "weights" in self._asleep:
            self._wake(["weights"])
        model = self.model
        reattach_moe_weight_loaders(model)
        stream = CheckedStream(weights, self.expected)
        was_valid, self._weights_valid = self._weights_valid, False  # until the whole stream is in
        try:
            loaded = model.load_weights(stream)
        except WeightLoadError:
            if stream.tensors == 0:  # refused before vLLM saw a tensor: nothing changed
                self._weights_valid = was_valid
            raise
        except Exception as e:  # vLLM's KeyError / ValueError / AssertionError for a tensor it rejects
            raise WeightLoadError(
                f"vLLM rejected the stream at or just before tensor {stream.current!r} ({type(e).__name__}: {e}){_PARTIAL}"
            ) from e
        missing = stream.missing_dense()
        experts = local_experts(model)
        if experts is not None:
            missing += missing_local_experts(experts, stream.seen)
        if missing:
            raise WeightLoadError(f"the stream lacks {len(missing)} tensor(s) this rank needs: {_listed(missing)}{_PARTIAL}")
        # vLLM returns the parameters it wrote; ours are checked above, so a gap here is vLLM's
        # naming (e.g. a platform's extra parameters): reported, not fatal
        self.not_updated = [n for n, _ in model.named_parameters() if n not in loaded] if loaded is not None else []
        if self.not_updated:
            logger.warning("vLLM reports %d parameter(s) not written by the sync: %s", len(self.not_updated), _listed(self.not_updated))
        if self.process_after_load:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            device = next(model.parameters()).device
            process_weights_after_loading(model, self.llm.llm_engine.vllm_config.model_config, device)
        self.llm.reset_prefix_cache()
        self._weights_valid = True
        return LoadStats(tensors=stream.tensors, bytes=stream.bytes)

    # -- generation ---------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop the generation running now (called from another thread) after the step every rank
        takes next; its unfinished requests are aborted in vLLM and come back with what they have,
        finish reason "paused". Only a ``pausable`` engine checks between steps; a generation that
        starts later clears the request."""
        self._pause.set()

    def agree(self, flag: bool) -> bool:
        """True on every rank if true on any (a pausable engine's ranks; otherwise this rank's flag).
        A collective of all the rollout's ranks."""
        if self._agreement is None:
            return flag
        import torch.distributed as dist

        vote = torch.tensor([int(flag)])
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._agreement)
        return bool(vote.item())

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 request_ids: Sequence[int] | None = None, max_tokens: Sequence[int] | None = None,
                 parts: Sequence[int] | None = None, on_part: PartDone | None = None) -> Generation:
        """One response per prompt, in order. A collective: the ranks of one TP group pass the same
        prompts; with DP > 1 every DP rank calls it (with its own prompts, possibly none).
        ``request_ids`` (global numbers of the requests) make each request's sample independent of
        which DP rank serves it; ``max_tokens``: per prompt, instead of ``params.max_tokens``;
        ``parts``, ``on_part``: a part is given back at the step its last request finishes
        (``RolloutEngine.generate``); with the routes asked for (R3), when the call ends, unless the
        engine is pausable."""
        self._pause.clear()
        if self._asleep:
            raise RuntimeError(f"engine is asleep ({', '.join(sorted(self._asleep))}); call wake_up() first")
        if not self._weights_valid:
            raise RuntimeError(
                "vLLM holds no complete weights (random dummy weights, a level-2 sleep, or a load_weights that "
                "failed midway): load_weights a complete stream first"
            )
        bounds = part_bounds(parts, len(prompts))
        budgets = token_budgets(prompts, params, max_tokens)
        check_prompts(prompts, budgets, self.vocab_size, self.max_model_len, "engine's max_model_len")
        sampling = [
            self._vllm.SamplingParams(**vllm_sampling_kwargs(
                params, eos_token_ids=self.eos_token_ids, max_tokens=budgets[i],
                **({"index": i, "stream": self.stream} if request_ids is None else {"index": request_ids[i]})))
            for i in range(len(prompts))
        ]
        inputs = [self._tokens_prompt(prompt_token_ids=list(p)) for p in prompts]
        given: set[int] = set()  # the parts given back during the loop
        if not prompts and self.rollout.dp == 1:
            outputs, paused = [], False
        else:
            trainer_state = self._rng.get_rng_state()
            self._rng.set_rng_state(self._gen_rng_state)
            try:
                # with DP > 1 a rank without prompts still steps with the others (vLLM's dummy batches).
                # The step loop's deltas carry no routes: with them asked for, parts come at the end.
                if self._agreement is None and (len(bounds) == 1 or self.return_routed_experts):
                    outputs, paused = self.llm.generate(inputs, sampling_params=sampling, use_tqdm=False), False
                else:
                    outputs, paused = self._generate_stepped(inputs, sampling, bounds, on_part, given)
            finally:
                self._gen_rng_state = self._rng.get_rng_state()
                self._rng.set_rng_state(trainer_state)
        generation = to_generation(outputs, prompts, routed_experts=self.return_routed_experts)
        generation.paused = paused
        give_remaining_parts(generation, bounds, given, on_part)
        return generation

    def _generate_stepped(self, inputs: list[Any], sampling: list[Any], bounds: list[tuple[int, int]],
                          on_part: PartDone | None, given: set[int]) -> tuple[list[Any], bool]:
        """``LLM.generate``'s loop (``LLM._run_engine``: ``step`` while ``has_unfinished_requests``,
        which with DP > 1 keeps the DP ranks stepping together), giving each part back at the step
        its last request finishes and, in a ``pausable`` engine, with the ranks' vote on a pause
        before each step: at a pause the unfinished requests are aborted (vLLM frees their KV cache)
        and come back with their tokens so far. The requests stream their new tokens
        (``RequestOutputKind.DELTA``) so that those are at hand at any step. ``given``: the parts
        given back, filled here."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        ids = [f"stepped-{next(self._requests)}" for _ in inputs]
        for request_id, prompt, sp in zip(ids, inputs, sampling):
            sp.output_kind = RequestOutputKind.DELTA
            engine.add_request(request_id, prompt, sp)
        outputs = DeltaOutputs(ids, [p["prompt_token_ids"] for p in inputs])
        paused = False
        while engine.has_unfinished_requests():
            if self.agree(self._pause.is_set()):
                paused = True
                engine.abort_request(outputs.unfinished())
                break
            outputs.add(engine.step())
            for i, (lo, hi) in enumerate(bounds if on_part is not None else ()):
                if i not in given and outputs.finished(ids[lo:hi]):
                    given.add(i)
                    prompts = [p["prompt_token_ids"] for p in inputs[lo:hi]]
                    on_part(i, to_generation(outputs.outputs(ids[lo:hi]), prompts, routed_experts=self.return_routed_experts))
        return outputs.outputs(), paused

    # -- colocated mode -----------------------------------------------------------------------

    def sleep(self, level: int | None = None) -> None:
        """Give the device memory to the trainer: level 1 (the default ``sleep_level``) moves the
        weights to host memory and frees the KV cache; level 2 frees both (the next
        ``load_weights`` must then bring every weight)."""
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep mode is off (enable_sleep_mode=False)")
        level = self.sleep_level if level is None else level
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if set(TAGS) <= self._asleep:
            return
        if self._asleep:  # partly awake: vLLM sleeps the whole engine
            self._wake([t for t in TAGS if t in self._asleep])
        self.llm.sleep(level=level)
        self._asleep = set(TAGS)
        if level == 2:
            self._weights_valid = False

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take the device memory back: ``tags`` from ("weights", "kv_cache"), all by default,
        woken one at a time in that order."""
        tags = list(TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; vLLM's are {list(TAGS)}")
        self._wake([t for t in TAGS if t in tags and t in self._asleep])

    def _wake(self, tags: list[str]) -> None:
        for tag in tags:
            self.llm.wake_up(tags=[tag])
            self._asleep.discard(tag)


def build(args: EngineArgs) -> VLLMEngine:
    """``recipe.rollout.ENGINES``'s entry."""
    return VLLMEngine(args.model_dir, args.rollout, platform=args.platform, dtype=args.dtype,
                      max_model_len=args.max_model_len, seed=args.seed, enable_sleep_mode=args.colocated,
                      return_routed_experts=args.return_routed_experts, engine_kwargs=args.engine_kwargs,
                      pausable=args.pausable)

"""After typing: first the values decided from other keys (the rollout engine, the log-prob
passes' batch keys, the asynchronous modes' IS correction, a colocated rollout's pool), then the
checks across keys (verl's batch arithmetic, the rollout pool against the mode, the fully
asynchronous keys, the layout against the model with the planner's rules), each problem naming
its keys and the fix."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.batching import TokenBudget, least_budget, rows_of
from megatron_bridge.plan.layout import Layout
from megatron_bridge.plan.memory import GIB, hf_engine_bytes
from megatron_bridge.plan.model_spec import ModelSpec, load_model_spec
from megatron_bridge.plan.verdict import evaluate
from megatron_bridge.tiny_model import TINY
from recipe.config.rules import ACTOR, DTYPE_BYTES, FILTER_METRICS, ROLLOUT
from recipe.config.schema import AsyncTrainingConfig, RecipeConfig, builtin_task
from recipe.rollout import auto_engine, engines_for

def normalise(cfg: RecipeConfig, given: Mapping[str, Any], name: str) -> RecipeConfig:
    """The values decided from other keys (``given``: the keys as written), before any check reads
    them: the rollout engine and its dtype, the log-prob passes' batch keys, the asynchronous modes'
    IS correction, a colocated rollout's pool, and the fused log-prob kernels where they run."""
    cfg = _fused_kernels_where_compiled(_log_prob_passes_follow_actor(_resolve_rollout_engine(cfg, name)))
    return _colocated_rollout_on_training_devices(_rollout_correction_when_async(cfg, given))


def problems(cfg: RecipeConfig, name: str) -> list[str]:
    """Every problem across keys of a normalised config, each naming its keys and the fix."""
    return _cross_checks(cfg) + _pool_problems(cfg) + _fully_async_problems(cfg) + _layout_problems(cfg, name)


def _fused_kernels_where_compiled(cfg: RecipeConfig) -> RecipeConfig:
    """``model.use_fused_kernels`` compiles the log-prob kernels with torch.compile, which has no NPU
    backend in the pinned torch 2.7.1 + torch_npu: there the chunked kernels run, and the start says so
    (a verl script that sets it runs as it is)."""
    model = cfg.actor_rollout_ref.model
    if not (model.use_fused_kernels and cfg.layout.cluster.device == "npu"):
        return cfg
    arr = dataclasses.replace(cfg.actor_rollout_ref, model=dataclasses.replace(model, use_fused_kernels=False))
    why = "torch.compile has no NPU backend in the pinned torch_npu stack: the chunked kernels run"
    return dataclasses.replace(cfg, actor_rollout_ref=arr,
                               ignored=cfg.ignored + (f"actor_rollout_ref.model.use_fused_kernels=True ({why})",))


def _resolve_rollout_engine(cfg: RecipeConfig, name: str) -> RecipeConfig:
    device = cfg.layout.cluster.device
    runs_here = engines_for(device)
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name not in ("auto", *runs_here):
        raise ConfigError(
            f"{name}: actor_rollout_ref.rollout.name={rollout.name!r} does not run on trainer.device={device!r}; "
            f"use {' or '.join(map(repr, runs_here))} or 'auto'"
        )
    notes = cfg.notes
    if rollout.name == "auto":
        engine, why = auto_engine(device)
        notes += (f"rollout engine: {engine} ({ROLLOUT}.name=auto: {why})",)
    else:
        engine = rollout.name
    dtype = _first_set(rollout.dtype, cfg.actor_rollout_ref.model.dtype)
    arr = dataclasses.replace(cfg.actor_rollout_ref, rollout=dataclasses.replace(rollout, name=engine, dtype=dtype))
    ignored = cfg.ignored + tuple(f"{ROLLOUT}.engine_kwargs.{k} (the {engine} engine takes no such arguments)"
                                  for k in rollout.engine_kwargs if k != engine)
    return dataclasses.replace(cfg, actor_rollout_ref=arr, ignored=ignored, notes=notes)


def _log_prob_passes_follow_actor(cfg: RecipeConfig) -> RecipeConfig:
    """The log-prob passes' dynamic batch size keys left unset take the actor's (verl's defaults)."""
    arr = cfg.actor_rollout_ref
    actor = arr.actor

    def follow(section):
        return dataclasses.replace(
            section,
            log_prob_use_dynamic_bsz=_first_set(section.log_prob_use_dynamic_bsz, actor.use_dynamic_bsz),
            log_prob_max_token_len_per_gpu=_first_set(section.log_prob_max_token_len_per_gpu,
                                                      actor.ppo_max_token_len_per_gpu))

    arr = dataclasses.replace(arr, rollout=follow(arr.rollout), ref=follow(arr.ref))
    return dataclasses.replace(cfg, actor_rollout_ref=arr)


# In the asynchronous modes the samples come from an older policy than the one that scores them:
# verl's decoupled correction, token-level IS weights truncated at rollout_is_threshold (2.0 by
# default), is on unless the recipe sets rollout_is or rollout_rs itself (null turns it off).
ASYNC_ROLLOUT_IS = "token"


def _rollout_correction_when_async(cfg: RecipeConfig, given: Mapping[str, Any]) -> RecipeConfig:
    section = given.get("algorithm") or {}
    section = section.get("rollout_correction") if isinstance(section, Mapping) else None
    chosen = isinstance(section, Mapping) and ({"rollout_is", "rollout_rs"} & set(section))
    if cfg.async_training.mode == "sync" or chosen:
        return cfg
    rc = dataclasses.replace(cfg.algorithm.rollout_correction, rollout_is=ASYNC_ROLLOUT_IS)
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, rollout_correction=rc))


def _first_set(value: Any, default: Any) -> Any:
    return default if value is None else value


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _batch_problems(cfg: RecipeConfig) -> list[str]:
    """verl's batch arithmetic: every batch splits evenly over steps, DP ranks and micro-batches."""
    data, actor = cfg.data, cfg.actor_rollout_ref.actor
    n, t = cfg.actor_rollout_ref.rollout.n, cfg.layout.train
    world, rollout_dp = cfg.layout.cluster.world_size, cfg.layout.rollout.dp
    out = []
    mini, micro = actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu
    if data.train_batch_size % mini:
        out.append(
            f"data.train_batch_size ({data.train_batch_size}) must be a multiple of {ACTOR}.ppo_mini_batch_size "
            f"({mini}): set ppo_mini_batch_size to one of {_divisors(data.train_batch_size)}"
        )
    dense = t.tp * t.pp * t.cp
    if world % dense == 0:  # otherwise the layout check reports it
        dp, rows = world // dense, mini * n
        if rows % dp:
            out.append(
                f"{ACTOR}.ppo_mini_batch_size x {ROLLOUT}.n = {mini} x {n} = {rows} rows per optimizer step must "
                f"split over the training DP = world / (TP*PP*CP) = {world} / {dense} = {dp} ranks: change "
                f"ppo_mini_batch_size or rollout.n so that their product is a multiple of {dp}"
            )
        elif (rows // dp) % micro:
            out.append(
                f"each of the {dp} training DP ranks gets {rows} / {dp} = {rows // dp} rows per optimizer step, "
                f"which must be a multiple of {ACTOR}.ppo_micro_batch_size_per_gpu ({micro}): set it to one of "
                f"{_divisors(rows // dp)}"
            )
    batches = cfg.async_training.generation_batches
    prompts = data.train_batch_size // batches if data.train_batch_size % batches == 0 else data.train_batch_size
    if (prompts * n) % rollout_dp:
        what = (f"data.train_batch_size x {ROLLOUT}.n = {prompts} x {n}" if batches == 1 else
                f"data.train_batch_size / async_training.require_batches x {ROLLOUT}.n = "
                f"{data.train_batch_size} / {batches} x {n}")
        out.append(
            f"{what} = {prompts * n} responses per generation batch must split over the rollout's "
            f"data_parallel_size ({rollout_dp}): change train_batch_size{', require_batches' if batches > 1 else ''} "
            f"or rollout.n so that this is a multiple of {rollout_dp}"
        )
    return out


def _cross_checks(cfg: RecipeConfig) -> list[str]:
    out = _batch_problems(cfg)
    if cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.actor_rollout_ref.rollout.free_cache_engine is False:
        out.append(f"{ROLLOUT}.free_cache_engine=false with rollout.name=vllm: a colocated vLLM always gives its "
                   "weights and KV cache back while the trainer computes here; drop the key (or use rollout.name=hf)")
    trainer, data = cfg.trainer, cfg.data
    if trainer.total_training_steps is None and trainer.total_epochs is None:
        out.append("trainer.total_training_steps=null needs trainer.total_epochs (the run's length)")
    groups = cfg.algorithm.filter_groups
    if groups.enable and groups.metric is None:
        out.append(f"algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric: one of {', '.join(FILTER_METRICS)}")
    if data.gen_batch_size is not None and not groups.enable and data.gen_batch_size != data.train_batch_size:
        streamed = ("" if cfg.async_training.mode != "fully_async" else
                    "; in fully_async the rollout pool generates batches of data.train_batch_size / "
                    "async_training.require_batches prompts (require_batches = train_batch_size: one prompt's "
                    "responses at a time), not single prompts as verl's rollouter streams them: drop the key")
        out.append(f"data.gen_batch_size ({data.gen_batch_size}) differs from data.train_batch_size "
                   f"({data.train_batch_size}): it only applies with algorithm.filter_groups.enable=true{streamed}")
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        out.append("trainer.resume_mode=resume_path needs trainer.resume_from_path (a checkpoint directory)")
    if trainer.resume_mode != "resume_path" and trainer.resume_from_path:
        out.append(f"trainer.resume_from_path is read only with trainer.resume_mode=resume_path (as in verl), not "
                   f"{trainer.resume_mode}: add trainer.resume_mode=resume_path, or drop resume_from_path")
    model = cfg.actor_rollout_ref.model
    if builtin_task(model.path) and model.config and not os.path.basename(model.config).startswith(TINY):
        out.append(f"actor_rollout_ref.model.path={model.path} builds a tiny model: "
                   f"actor_rollout_ref.model.config must name a configs/model/{TINY}*.yaml shape, not {model.config!r}")
    arr = cfg.actor_rollout_ref
    if cfg.layout.cluster.device == "cpu" and cfg.layout.train.pp > 1 and (
            arr.actor.use_dynamic_bsz or arr.rollout.log_prob_use_dynamic_bsz or arr.ref.log_prob_use_dynamic_bsz):
        out.append("dynamic batch size with pipeline parallel needs megatron's variable sequence lengths, which the "
                   "CPU path's allgather MoE dispatcher does not support (megatron-core 0.12.1): on CPU use "
                   "pipeline_model_parallel_size=1 or use_dynamic_bsz=false")
    out += _token_budget_problems(cfg)
    if cfg.layout.cluster.device == "npu":  # MindSpeed's refusals, before anything starts (the actor repeats them)
        from megatron_bridge.runtime import mindspeed

        try:
            mindspeed.feature_args(cfg.layout.train, arr.model.use_remove_padding)
        except ConfigError as e:
            out.append(str(e))
    rc = cfg.algorithm.rollout_correction
    if (rc.rollout_is is not None or rc.rollout_rs is not None) and not cfg.actor_rollout_ref.rollout.calculate_log_probs:
        out.append(f"algorithm.rollout_correction needs the rollout engine's log-probs: set "
                   f"{ROLLOUT}.calculate_log_probs=true (or rollout_is=null and rollout_rs=null)")
    if cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "R3" and \
            not cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay:
        out.append(f"{ACTOR}.megatron.router_replay.mode=R3 replays the rollout engine's routing: set "
                   f"{ROLLOUT}.enable_rollout_routing_replay=true (or use mode R2)")
    buffer = cfg.reward_model.overlong_buffer
    if buffer.enable and cfg.reward_model.reward_manager == "naive":
        out.append("reward_model.overlong_buffer is applied by the dapo reward manager, as in verl: set "
                   "reward_model.reward_manager=dapo (or reward_model.overlong_buffer.enable=false)")
    if buffer.enable and not 0 < buffer.len < data.max_response_length:
        out.append(
            f"reward_model.overlong_buffer.len ({buffer.len}) must be in [1, data.max_response_length "
            f"({data.max_response_length})) when the buffer is enabled: the penalty ramps over the last len tokens; "
            "lower it or set reward_model.overlong_buffer.enable=false"
        )
    return out


def _token_budgets(cfg: RecipeConfig) -> list[tuple[str, int]]:
    """The token budget of each pass that cuts its micro-batches by tokens (dynamic batch size): the
    key and its value, per device (a micro-batch holds that times context parallel)."""
    arr = cfg.actor_rollout_ref
    passes = [(f"{ACTOR}.ppo_max_token_len_per_gpu", arr.actor.use_dynamic_bsz, arr.actor.ppo_max_token_len_per_gpu),
              (f"{ROLLOUT}.log_prob_max_token_len_per_gpu", arr.rollout.log_prob_use_dynamic_bsz,
               arr.rollout.log_prob_max_token_len_per_gpu)]
    if cfg.needs_reference:
        passes.append(("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", arr.ref.log_prob_use_dynamic_bsz,
                       arr.ref.log_prob_max_token_len_per_gpu))
    return [(key, budget) for key, dynamic, budget in passes if dynamic]


def _token_budget_problems(cfg: RecipeConfig) -> list[str]:
    """A micro-batch by token budget holds at least one row: the longest sequence the data allows,
    padded as the layout splits it, must fit each budget, or the run fails at the first batch
    that holds one (the actor's own check, mid-run)."""
    t, data = cfg.layout.train, cfg.data
    longest = data.max_prompt_length + data.max_response_length
    per_device = least_budget(t, longest)
    short = [f"{key} ({budget})" for key, budget in _token_budgets(cfg) if budget < per_device]
    if not short:
        return []
    padded = -(-longest // t.seq_multiple) * t.seq_multiple
    held = f"{longest} tokens" + (f", padded to {padded} for the layout's split" if padded != longest else "")
    return [f"{' and '.join(short)} must hold the longest sequence, data.max_prompt_length + "
            f"data.max_response_length = {held}" + (f", over context parallel {t.cp}" if t.cp > 1 else "") +
            f": raise {'it' if len(short) == 1 else 'each'} to at least {per_device} (or shorten the sequences, or "
            "use_dynamic_bsz=false)"]


def _pool_is_trainers(layout: Layout) -> bool:
    """The rollout's nnodes / n_gpus_per_node are the trainer's."""
    pool, cluster = layout.rollout, layout.cluster
    return (pool.nnodes or 1, pool.devices_per_node) == (cluster.nnodes, cluster.devices_per_node)


def _pool_problems(cfg: RecipeConfig) -> list[str]:
    """Where the rollout runs (``hybrid_engine``, its own pool) against ``async_training.mode``."""
    layout, arr, mode = cfg.layout, cfg.actor_rollout_ref, cfg.async_training.mode
    pool, cluster = layout.rollout, layout.cluster
    given = f"{ROLLOUT}.nnodes / n_gpus_per_node"
    if arr.hybrid_engine:
        if mode != "sync":
            return [f"async_training.mode={mode} generates on the rollout's own devices: set "
                    f"actor_rollout_ref.hybrid_engine=false and {given}"]
        if layout.separate_rollout and not _pool_is_trainers(layout):
            return [f"{given} = {pool.nnodes or 1} / {pool.devices_per_node} differ from trainer.nnodes / "
                    f"n_gpus_per_node = {cluster.nnodes} / {cluster.devices_per_node}: with "
                    "actor_rollout_ref.hybrid_engine=true the rollout is colocated on the training devices; leave "
                    "them out, or set hybrid_engine=false with async_training.mode=one_step_off or fully_async"]
        return []
    out = []
    if mode == "sync":
        out.append("actor_rollout_ref.hybrid_engine=false (a rollout pool of its own) runs with "
                   "async_training.mode=one_step_off or fully_async; set one, or hybrid_engine=true")
    if not layout.separate_rollout:
        out.append(f"actor_rollout_ref.hybrid_engine=false needs the rollout's own devices: set "
                   f"{ROLLOUT}.n_gpus_per_node (and nnodes, default 1)")
    if cfg.algorithm.filter_groups.enable:
        out.append(f"algorithm.filter_groups (DAPO dynamic sampling) is not implemented with "
                   f"async_training.mode={mode}: each step's batch is one generation batch made ahead")
    return out


FULLY_ASYNC_KEYS = ("staleness_threshold", "trigger_parameter_sync_step", "require_batches", "partial_rollout")


def _fully_async_problems(cfg: RecipeConfig) -> list[str]:
    """The fully asynchronous mode's own keys: set off their defaults in another mode (a saved config
    holds the defaults), or asking for what is not here."""
    a, defaults = cfg.async_training, AsyncTrainingConfig()
    if a.mode != "fully_async":
        changed = [k for k in FULLY_ASYNC_KEYS if getattr(a, k) != getattr(defaults, k)]
        return [f"async_training.{k}={getattr(a, k)} applies with async_training.mode=fully_async only, not "
                f"{a.mode}; set that mode or drop the key" for k in changed]
    out = []
    if cfg.data.train_batch_size % a.require_batches:
        out.append(f"async_training.require_batches={a.require_batches}: the step's data.train_batch_size "
                   f"({cfg.data.train_batch_size}) prompts are generated as require_batches equal batches; set it to "
                   f"one of {_divisors(cfg.data.train_batch_size)}")
    rollout = cfg.actor_rollout_ref.rollout
    if a.partial_rollout and rollout.name == "vllm" and rollout.enable_rollout_routing_replay:
        out.append("async_training.partial_rollout=true with rollout.name=vllm and "
                   "rollout.enable_rollout_routing_replay=true is not implemented: the pausable engine's step loop "
                   "does not gather the routes vLLM reports; drop one of them (rollout.name=hf keeps both)")
    return out


def _colocated_rollout_on_training_devices(cfg: RecipeConfig) -> RecipeConfig:
    """``hybrid_engine`` alone decides whether the rollout has a pool of its own: with ``true``, a
    rollout nnodes / n_gpus_per_node equal to the trainer's (allowed, verl's recipes spell them out)
    names the training devices, so the layout drops them and everything that asks
    ``layout.separate_rollout`` (the pools, the memory plan) sees one colocated pool."""
    layout = cfg.layout
    if not (cfg.actor_rollout_ref.hybrid_engine and layout.separate_rollout and _pool_is_trainers(layout)):
        return cfg  # a pool that differs is refused by _pool_problems
    rollout = dataclasses.replace(layout.rollout, nnodes=None, devices_per_node=None)
    return dataclasses.replace(cfg, layout=dataclasses.replace(layout, rollout=rollout))


def engine_memory_between_rollouts(cfg: RecipeConfig, name: str) -> RecipeConfig:
    """``free_cache_engine`` left unset, decided: a colocated transformers engine on a device keeps
    its weights there through training when the planner's training peak and the engine's memory
    (``hf_engine_bytes``) fit the device together (no copy to the host and back every step); vLLM,
    an engine of its own pool and the CPU engine (nothing to move) take verl's default, true."""
    rollout, device = cfg.actor_rollout_ref.rollout, cfg.layout.cluster.device
    if rollout.free_cache_engine is not None:
        return cfg
    keep, note = False, None
    if rollout.name == "hf" and device != "cpu" and not cfg.layout.separate_rollout:
        spec = model_spec(cfg, name)
        report = layout_verdict(cfg, spec).memory
        gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
        rows = -(-cfg.generation_batch_size * rollout.n // cfg.layout.rollout.dp)  # per rank, the largest share
        engine = hf_engine_bytes(spec, DTYPE_BYTES[rollout.dtype], rows,
                                 cfg.data.max_prompt_length + cfg.data.max_response_length)
        if report is None or report.device_bytes is None:
            note = "the device memory is not known (trainer.device_memory_gb)"
        else:
            keep = report.train_peak + engine <= report.device_bytes
            note = (f"training peak {gib(report.train_peak)} + engine {gib(engine)} (estimates) "
                    f"{'fit' if keep else 'exceed'} trainer.device_memory_gb={report.device_bytes / GIB:g}")
    arr = dataclasses.replace(cfg.actor_rollout_ref, rollout=dataclasses.replace(rollout, free_cache_engine=not keep))
    notes = cfg.notes
    if note is not None:
        what = "keeps its weights on the device through training" if keep else "moves its weights to the host while training"
        notes += (f"rollout engine {what} ({ROLLOUT}.free_cache_engine={str(not keep).lower()}: {note})",)
    return dataclasses.replace(cfg, actor_rollout_ref=arr, notes=notes)


def model_spec(cfg: RecipeConfig, name: str) -> ModelSpec:
    """The model's shape for planning: model.config, else the checkpoint's config.json."""
    model = cfg.actor_rollout_ref.model
    if model.config is not None:
        return load_model_spec(model.config)
    if builtin_task(model.path):
        return load_model_spec(TINY)
    if os.path.isdir(model.path):
        return load_model_spec(model.path)
    raise ConfigError(
        f"{name}: actor_rollout_ref.model.path={model.path!r} is not a local directory and "
        "actor_rollout_ref.model.config is not set; set model.config to a shipped model "
        "(e.g. qwen3_30b_a3b) or a config.json so the layout can be checked"
    )


def _layout_problems(cfg: RecipeConfig, name: str) -> list[str]:
    """The planner's verdict (``python -m megatron_bridge.plan check``) for this model and length."""
    spec = model_spec(cfg, name)
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    out = []
    if seq_len > spec.max_position_embeddings:
        out.append(
            f"data.max_prompt_length + data.max_response_length = {seq_len} exceeds the model's "
            f"max_position_embeddings ({spec.max_position_embeddings}); shorten one of them"
        )
    return out + [f"layout {cfg.layout.name}: {v}" for v in layout_verdict(cfg, spec).violations]


def actor_budget(cfg: RecipeConfig) -> TokenBudget | None:
    """The actor's token budget per training micro-batch under dynamic batch size, else None."""
    actor = cfg.actor_rollout_ref.actor
    if not actor.use_dynamic_bsz:
        return None
    return TokenBudget(actor.ppo_max_token_len_per_gpu, actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n)


def layout_verdict(cfg: RecipeConfig, spec: ModelSpec):
    """The planner's verdict on this recipe's layout for its sequences (prompt + response), micro-batch,
    reference model, packing and log-prob chunks. With dynamic batch size the training micro-batch is
    the actor's token budget filled with longest sequences (rows in fractions; at most a rank's rows
    of an optimizer step): the most tokens it holds, and the most score memory an unfused attention
    keeps for them."""
    arr = cfg.actor_rollout_ref
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    budget = actor_budget(cfg)  # budgets' refusals are _token_budget_problems' (they name the keys), not the verdict's
    rows = rows_of(budget or arr.actor.ppo_micro_batch_size_per_gpu, cfg.layout, seq_len)
    return evaluate(spec, cfg.layout, seq_len, rows, cfg.needs_reference, arr.model.use_remove_padding,
                    arr.actor.megatron.log_prob_chunk_size, log_prob=_log_prob_rows(cfg, seq_len))


def _log_prob_rows(cfg: RecipeConfig, seq_len: int) -> float:
    """The largest micro-batch of the forward-only log-prob passes (the old policy's; the
    reference's where there is one), in sequences of ``seq_len``: rows, or a budget's share of an RL
    step's rows."""
    arr = cfg.actor_rollout_ref
    step_rows = cfg.data.train_batch_size * arr.rollout.n
    sizes = [TokenBudget(p.log_prob_max_token_len_per_gpu, step_rows) if p.log_prob_use_dynamic_bsz
             else p.log_prob_micro_batch_size_per_gpu for p in (arr.rollout, *([arr.ref] if cfg.needs_reference else []))]
    return max(rows_of(size, cfg.layout, seq_len) for size in sizes)

"""verl's config vocabulary: how a key of verl's Megatron trainer (``ppo_megatron_trainer.yaml`` and its
example scripts) that this recipe spells differently, mirrors, or has no use for is handled, so a
verl user's script runs as it is. Applied to the composed config before it is typed
(``recipe.config``); docs/recipe.md ("verl keys") has the same table for users.

Every rule names a key (or a key prefix ending in ``.``) under its full dotted path:

- ``RENAMED``: the same meaning under another name here: the value moves there (both given and
  different: an error).
- ``VLLM_ARGS``: vLLM engine arguments verl keeps on ``rollout``: they go to
  ``actor_rollout_ref.rollout.engine_kwargs.vllm`` (verl's ``engine_kwargs.vllm``, passed to
  ``vllm.LLM``).
- ``EQUAL``: a mirror of a key here (the reference model's layout is the actor's, the rollout's
  lengths are the data's): accepted when it equals that key's value, else an error saying why.
- ``ONLY``: accepted at the values listed (what this package always does), else an error saying
  what is not supported.
- ``ALWAYS_ON``: switches for what this package always does: true is accepted as it is, false is
  listed as having no effect, with what happens instead.
- ``IGNORED``: no effect here, with the reason (performance, profiling, features of the critic or
  of other engines that a GRPO / GSPO run on Megatron does not use).
- ``FSDP_ONLY``: verl's FSDP backend's keys: refused, naming the Megatron equivalent.
- ``model.enable_gradient_checkpointing=true`` turns on full recompute of every layer where the
  layout sets no recompute (verl reads it only in its FSDP engine; there it recomputes every layer).
- ``data.train_batch_size=0`` with ``async_training.mode=fully_async``, as verl's fully-async scripts
  write it (its trainer takes ``require_batches`` x ``ppo_mini_batch_size`` prompts a step), is that
  product here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

ARR = "actor_rollout_ref"
ACTOR, ROLLOUT, REF = f"{ARR}.actor", f"{ARR}.rollout", f"{ARR}.ref"
OTC = f"{ACTOR}.megatron.override_transformer_config"
VLLM_KWARGS = f"{ROLLOUT}.engine_kwargs.vllm"

RENAMED: dict[str, str] = {
    f"{ACTOR}.grad_clip": f"{ACTOR}.optim.clip_grad",
    f"{ACTOR}.optim.grad_clip": f"{ACTOR}.optim.clip_grad",
    f"{ACTOR}.router_replay.mode": f"{ACTOR}.megatron.router_replay.mode",  # verl's location until 2026-05
    f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes": f"{ROLLOUT}.update_weights_bucket_megabytes",
    **{f"{OTC}.{k}": f"{ACTOR}.megatron.{k}" for k in (
        "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")},
    **{f"{section}.reward_kwargs.overlong_buffer_cfg.{k}": f"reward_model.overlong_buffer.{k}"
       for section in ("reward_model", "reward") for k in ("enable", "len", "penalty_factor")},
    "reward.reward_manager.name": "reward_model.reward_manager",  # verl's newer spelling
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    # the one-step-off and fully async recipes' spelling of the rollout's own pool
    "rollout.nnodes": f"{ROLLOUT}.nnodes",
    "rollout.n_gpus_per_node": f"{ROLLOUT}.n_gpus_per_node",
    f"{ACTOR}.use_remove_padding": f"{ARR}.model.use_remove_padding",  # verl's actor reads the model's
}

VLLM_ARGS = ("enable_chunked_prefill", "max_num_batched_tokens", "enforce_eager", "enable_prefix_caching",
             "disable_log_stats", "disable_custom_all_reduce", "skip_tokenizer_init", "max_model_len")

_LAYOUT_MIRRORED = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                    "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size",
                    "sequence_parallel", "use_distributed_optimizer", "param_offload")
_REF_FOLLOWS = "the reference model runs in the actor's layout here (verl, too, builds it in the first layout it sets up)"
EQUAL: dict[str, tuple[str, str]] = {
    **{f"{REF}.megatron.{k}": (f"{ACTOR}.megatron.{k}", _REF_FOLLOWS) for k in _LAYOUT_MIRRORED},
    f"{ROLLOUT}.prompt_length": ("data.max_prompt_length", "the rollout's prompt length is data.max_prompt_length"),
    f"{ROLLOUT}.response_length": ("data.max_response_length", "responses are capped at data.max_response_length"),
    "reward_model.reward_kwargs.max_resp_len": ("data.max_response_length", "the overlong buffer counts from data.max_response_length"),
    "reward.reward_kwargs.max_resp_len": ("data.max_response_length", "the overlong buffer counts from data.max_response_length"),
    f"{ACTOR}.megatron.dtype": (f"{ARR}.model.dtype", "actor and rollout share actor_rollout_ref.model.dtype"),
    f"{REF}.megatron.dtype": (f"{ARR}.model.dtype", "actor and rollout share actor_rollout_ref.model.dtype"),
}

ONLY: dict[str, tuple[tuple, str]] = {
    "data.return_raw_chat": ((True,), "prompts are rendered with the chat template on the driver"),
    f"{ACTOR}.strategy": (("megatron",), "the actor is Megatron-Core"),
    f"{REF}.strategy": (("megatron",), "the reference model is Megatron-Core"),
    "model_engine": (("megatron",), "the actor is Megatron-Core"),
    f"{ROLLOUT}.mode": (("async", "sync"), "generation is colocated and synchronous"),
    f"{ROLLOUT}.do_sample": ((True,), "training rollouts sample (greedy only for validation: val_kwargs)"),
    f"{ROLLOUT}.quantization": ((None,), "the rollout runs in actor_rollout_ref.rollout.dtype, unquantised"),
    f"{ROLLOUT}.logprobs_mode": (("processed_logprobs",), "rollout log-probs are taken after temperature"),
    f"{ACTOR}.optim.optimizer": (("adam",), "the optimizer is megatron's distributed Adam"),
    f"{ACTOR}.optim.override_optimizer_config": (({},), "megatron's OptimizerConfig is built from actor.optim"),
    f"{ACTOR}.megatron.use_dist_checkpointing": ((False,), "initial weights load from actor_rollout_ref.model.path"),
    f"{REF}.megatron.use_dist_checkpointing": ((False,), "initial weights load from actor_rollout_ref.model.path"),
    f"{ACTOR}.ppo_micro_batch_size": ((None,), "set actor.ppo_micro_batch_size_per_gpu"),
    f"{ROLLOUT}.log_prob_micro_batch_size": ((None,), "set rollout.log_prob_micro_batch_size_per_gpu"),
    f"{REF}.log_prob_micro_batch_size": ((None,), "set ref.log_prob_micro_batch_size_per_gpu"),
    f"{ACTOR}.ulysses_sequence_parallel_size": ((1,), "sequence parallelism over a long context is "
                                                      "actor_rollout_ref.actor.megatron.context_parallel_size here "
                                                      f"(Ulysses on the NPU: {OTC}.context_parallel_algo=ulysses_cp_algo)"),
    f"{REF}.ulysses_sequence_parallel_size": ((1,), "the reference model follows the actor's context_parallel_size"),
    "trainer.critic_warmup": ((0,), "GRPO and GSPO have no critic"),
    f"{ACTOR}.megatron.router_replay.record_file": ((None,), "routing is recorded per step in memory"),
    f"{ACTOR}.megatron.router_replay.replay_file": ((None,), "routing is recorded per step in memory"),
    f"{REF}.megatron.router_replay.mode": (("disabled",), "routing replay applies to the actor's passes"),
    f"{REF}.router_replay.mode": (("disabled",), "routing replay applies to the actor's passes"),
}

_CHUNKED = ("the log-probs and entropy are always computed in chunks of tokens, recomputed in the backward pass, "
            "without an fp32 copy of the logits (actor_rollout_ref.actor.megatron.log_prob_chunk_size)")
ALWAYS_ON: dict[str, str] = {
    **{f"{section}.{key}": _CHUNKED for section in (ACTOR, REF)
       for key in ("entropy_checkpointing", "entropy_from_logits_with_chunking")},
}

_PERF = "a performance or memory knob; this package builds its own fixed choice"
_PROFILING = "profiling"
IGNORED: dict[str, str] = {
    "data.filter_overlong_prompts_workers": "tokenising runs on the driver",
    f"{ACTOR}.use_torch_compile": "verl's Megatron engine does not read it",
    f"{REF}.use_torch_compile": "verl's Megatron engine does not read it",
    f"{ACTOR}.megatron.use_mbridge": "HF checkpoints load through megatron_bridge.weights",
    f"{ACTOR}.megatron.vanilla_mbridge": "HF checkpoints load through megatron_bridge.weights",
    f"{REF}.megatron.use_mbridge": "HF checkpoints load through megatron_bridge.weights",
    f"{REF}.megatron.vanilla_mbridge": "HF checkpoints load through megatron_bridge.weights",
    f"{ACTOR}.checkpoint.load_contents": "a resume loads model, optimizer and extra, whatever the list",
    f"{ACTOR}.megatron.seed": "seeds come from trainer.seed",
    f"{REF}.megatron.seed": "seeds come from trainer.seed",
    f"{ROLLOUT}.seed": "rollout seeds come from trainer.seed, the step and the row",
    **{f"{OTC}.{k}": _PERF for k in (
        "apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion",
        "bias_dropout_fusion", "gradient_accumulation_fusion", "deallocate_pipeline_outputs", "persist_layer_norm",
        "moe_enable_deepep", "moe_token_dispatcher_type",
        "moe_router_dtype")},  # the router always computes in fp32 here
    f"{ARR}.model.fused_kernel_options.": "model.use_fused_kernels compiles this package's own log-prob kernels "
                                          "with torch.compile (triton on CUDA)",
    f"{ACTOR}.profiler.": _PROFILING,
    f"{REF}.profiler.": _PROFILING,
    f"{ROLLOUT}.profiler.": _PROFILING,
    "global_profiler.": _PROFILING,
    f"{ROLLOUT}.engine_kwargs.sglang.": "SGLang is not a rollout engine here",
    f"{ROLLOUT}.engine_kwargs.trtllm.": "TensorRT-LLM is not a rollout engine here",
    f"{ROLLOUT}.moe_tensor_parallel_size": "a TensorRT-LLM setting",
    "algorithm.gamma": "GAE only; GRPO does not use it",
    "algorithm.lam": "GAE only; GRPO does not use it",
    "critic.": "GRPO and GSPO have no critic",
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": "overlong-buffer penalties are in the rewards",
    "reward.reward_kwargs.overlong_buffer_cfg.log": "overlong-buffer penalties are in the rewards",
    "trainer.balance_batch": "rows are dealt to DP ranks by mini-batch (DP-invariant update)",
    "trainer.use_legacy_worker_impl": "verl's worker choice",
    "ray_kwargs.": "Ray start-up is the launcher's (launch/)",
    f"{ACTOR}.optim.total_training_steps": "derived from the run's length, as verl's trainer does",
}

FSDP_ONLY: dict[str, str] = {
    f"{ACTOR}.fsdp_config.param_offload": f"{ACTOR}.megatron.param_offload",
    f"{ACTOR}.fsdp_config.optimizer_offload": f"{ACTOR}.megatron.optimizer_offload",
    f"{REF}.fsdp_config.param_offload": f"{REF}.megatron.param_offload (it must equal the actor's)",
    f"{ACTOR}.fsdp_config.": f"{ACTOR}.megatron.* (parallel sizes, offload) and "
                            f"{ACTOR}.megatron.override_transformer_config.recompute_*",
    f"{REF}.fsdp_config.": "the reference model follows the actor's megatron layout",
    f"{ACTOR}.optim.lr_scheduler_type": f"{ACTOR}.optim.lr_decay_style (constant | cosine)",
    f"{ACTOR}.optim.warmup_style": f"{ACTOR}.optim.lr_warmup_steps and lr_decay_style",
    f"{ACTOR}.optim.min_lr_ratio": f"{ACTOR}.optim.min_lr",
    f"{ACTOR}.optim.num_cycles": f"{ACTOR}.optim.lr_decay_style=cosine with lr_decay_steps",
    f"{ACTOR}.pad_to_length": "micro-batches are padded to their own length",
}

UNSUPPORTED: dict[str, str] = {
    **{f"async_training.{k}": "a setting of verl's fully asynchronous trainer, not implemented here: the old "
                              "log-probs are always recomputed by the trainer (decoupled PPO)"
       for k in ("use_rollout_log_probs", "compute_prox_log_prob")},
    "rollout.": "a setting of verl's fully asynchronous trainer's rollouter (only rollout.nnodes and "
                "rollout.n_gpus_per_node apply here)",
    f"{ARR}.model.override_config.": "HF config overrides: edit the checkpoint's config.json instead",
}


@dataclass
class Translation:
    """The config with verl's spellings replaced, what was left out and why, and what failed."""

    data: dict
    ignored: list[str] = field(default_factory=list)  # "key (reason)"
    equal_checks: list[tuple[str, Any, str, str]] = field(default_factory=list)  # (verl key, value, our key, why)
    errors: list[str] = field(default_factory=list)


def _leaves(data: Mapping, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value and not _matches(ONLY, dotted):
            out += _leaves(value, dotted)
        else:
            out.append((dotted, value))
    return out


def _matches(table: Mapping[str, Any], key: str) -> str | None:
    """The entry of ``table`` for ``key``: the key itself or the longest prefix (ending in ``.``)."""
    if key in table:
        return key
    prefixes = [p for p in table if p.endswith(".") and key.startswith(p)]
    return max(prefixes, key=len) if prefixes else None


def _pop(data: dict, key: str) -> None:
    parts = key.split(".")
    nodes = [data]
    for part in parts[:-1]:
        nodes.append(nodes[-1][part])
    del nodes[-1][parts[-1]]
    for node, part in zip(reversed(nodes[:-1]), reversed(parts[:-1])):  # drop sections left empty
        if not node[part]:
            del node[part]


def get_dotted(data: Mapping, key: str) -> Any:
    """The value at ``a.b.c`` in nested mappings, ``MISSING`` where a key is not there."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


def _set(data: dict, key: str, value: Any) -> None:
    node = data
    for part in key.split(".")[:-1]:
        node = node.setdefault(part, {})
    node[key.split(".")[-1]] = value


MISSING = object()


GRADIENT_CHECKPOINTING = f"{ARR}.model.enable_gradient_checkpointing"
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _gradient_checkpointing(out: Translation, value: Any) -> None:
    """Every layer recomputed in the backward pass, unless the layout already chose its recompute."""
    chosen = get_dotted(out.data, f"{OTC}.recompute_granularity")
    if value is True and chosen in (MISSING, None):
        for key, setting in FULL_RECOMPUTE.items():
            _set(out.data, f"{OTC}.{key}", setting)
    else:
        why = ("the layout's recompute applies" if value is True else
               "recompute is actor.megatron.override_transformer_config.recompute_*")
        out.ignored.append(f"{GRADIENT_CHECKPOINTING}={value} ({why})")


def translate(config: Mapping) -> Translation:
    """Replace verl's spellings in ``config`` (a composed config, nested dicts); see the module doc."""
    import copy

    out = Translation(copy.deepcopy(dict(config)))
    for key, value in _leaves(config):
        if key == GRADIENT_CHECKPOINTING:
            _pop(out.data, key)
            _gradient_checkpointing(out, value)
        elif (entry := _matches(RENAMED, key)) is not None:
            target = RENAMED[entry]
            present = get_dotted(out.data, target)
            if present is not MISSING and present != value:
                out.errors.append(f"{key}={value!r} (verl's spelling of {target}) and {target}={present!r} disagree; "
                                  "set one of them")
                continue
            _pop(out.data, key)
            _set(out.data, target, value)
        elif key.startswith(f"{ROLLOUT}.") and key.removeprefix(f"{ROLLOUT}.") in VLLM_ARGS:
            _pop(out.data, key)
            _set(out.data, f"{VLLM_KWARGS}.{key.removeprefix(ROLLOUT + '.')}", value)
        elif key in EQUAL:
            _pop(out.data, key)
            out.equal_checks.append((key, value, *EQUAL[key]))
        elif (entry := _matches(ONLY, key)) is not None:
            allowed, why = ONLY[entry]
            _pop(out.data, key)
            if value not in allowed:
                shown = " or ".join(repr(a) for a in allowed)
                out.errors.append(f"{key}={value!r} is not supported: {why} (accepted: {shown})")
        elif key in ALWAYS_ON:
            _pop(out.data, key)
            if value is not True:
                out.ignored.append(f"{key}={value!r} (always on here: {ALWAYS_ON[key]})")
        elif (entry := _matches(IGNORED, key)) is not None:
            _pop(out.data, key)
            out.ignored.append(f"{key} ({IGNORED[entry]})")
        elif (entry := _matches(FSDP_ONLY, key)) is not None:
            _pop(out.data, key)
            out.errors.append(f"{key} is a key of verl's FSDP backend; this package trains with Megatron-Core: "
                              f"use {FSDP_ONLY[entry]}")
        elif (entry := _matches(UNSUPPORTED, key)) is not None:
            _pop(out.data, key)
            out.errors.append(f"{key} is not supported: {UNSUPPORTED[entry]}")
    _fully_async_batch(out.data)
    return out


def _fully_async_batch(data: dict) -> None:
    """verl's fully-async ``data.train_batch_size=0``: the step's batch is ``require_batches`` (1 if
    not given) x ``ppo_mini_batch_size`` prompts. Left as it is (and refused as not >= 1) without a
    mini-batch size to multiply."""
    batches = get_dotted(data, "async_training.require_batches")
    batches = 1 if batches is MISSING else batches
    mini = get_dotted(data, f"{ACTOR}.ppo_mini_batch_size")
    if (get_dotted(data, "async_training.mode") == "fully_async" and get_dotted(data, "data.train_batch_size") == 0
            and type(mini) is int and type(batches) is int):
        _set(data, "data.train_batch_size", batches * mini)


def check_equal(checks: list[tuple[str, Any, str, str]], plain: Mapping) -> list[str]:
    """The mirrored keys whose value differs from the key they mirror in the typed config ``plain``."""
    return [f"{key}={value!r} must equal {target} ({get_dotted(plain, target)!r}): {why}"
            for key, value, target, why in checks if get_dotted(plain, target) != value]

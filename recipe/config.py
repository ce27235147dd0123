"""The recipe config: YAML composition, command-line overrides, typed and validated.

A recipe (``configs/recipe/*.yaml``) names two fragments and adds its own keys::

    parallel: qwen3_30b_a3b_2x16_a3     # configs/parallel/<name>.yaml or a path
    algo: gspo                          # configs/algo/<name>.yaml or a path
    data: {...}
    actor_rollout_ref: {...}

Merge order, later wins (dicts merge deeply): the algo fragment, the parallel fragment, the
recipe's own keys, then ``key.sub=value`` overrides (``parallel=`` / ``algo=`` overrides switch
the fragment). Key names and meanings are verl's (``ppo_megatron_trainer.yaml``). The layout keys
(``actor_rollout_ref.actor.megatron``, the rollout's parallel sizes, ``trainer.nnodes`` ...) are
not duplicated here: they become ``RecipeConfig.layout`` through ``megatron_bridge.plan.layout``.

String values may refer to other keys as ``${trainer.project_name}`` (the run directory does).

This module owns loading and checking: unknown keys (with the nearest known key), types, choices,
verl's batch arithmetic, and the layout against the model with the planner's rules, each failure a
``ConfigError`` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Mapping

import yaml

from loss import KL_PENALTY_TYPES, LOSS_AGG_MODES, PolicyLossSettings, RolloutCorrectionConfig, policy_loss_modes
from loss.megatron_hook import ActorLossConfig
from megatron_bridge.runtime.optim import LR_DECAY_STYLES, OptimConfig
from megatron_bridge.errors import ConfigError
from megatron_bridge.configs import find_config, shipped
from megatron_bridge.plan.layout import Layout, layout_from_dict, layout_to_dict, nearest_key
from megatron_bridge.plan.memory import GIB, hf_engine_bytes
from megatron_bridge.plan.model_spec import ModelSpec, load_model_spec
from megatron_bridge.plan.verdict import evaluate
from megatron_bridge.tiny_model import TINY
from recipe.rollout import ENGINES, auto_engine, engines_for
from recipe.verl_compat import check_equal, translate

BUILTIN_TINY = "builtin:tiny"
BUILTIN_TASKS = ("tiny", "tiny_long", "tiny_long_tail")  # builtin:<task>, built by recipe/data/tiny_task.py
_LAYOUT_KEYS = layout_to_dict(Layout(name="keys"))  # the tree of layout key names
_DERIVED = ("layout", "ignored", "notes")  # RecipeConfig fields built while loading, not YAML keys


def builtin_task(path: str) -> str | None:
    """The built-in task that ``path`` names (``builtin:tiny`` -> ``tiny``), or None for a real path."""
    prefix, _, task = path.partition(":")
    return task if prefix == "builtin" and task in BUILTIN_TASKS else None


# ---- schema ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataConfig:
    train_files: list[str]  # parquet files, or a built-in task ("builtin:tiny", "builtin:tiny_long")
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 8  # prompts per RL step
    val_batch_size: int | None = None  # None: the whole validation set at once
    truncation: str = "error"  # a prompt over max_prompt_length: error | left | right
    filter_overlong_prompts: bool = False
    shuffle: bool = True
    seed: int = 1
    gen_batch_size: int | None = None  # prompts generated at a time with filter_groups (None: train_batch_size)


@dataclass(frozen=True)
class ModelConfig:
    path: str  # HF checkpoint dir (weights + tokenizer) or a built-in task's ("builtin:tiny", ...)
    config: str | None = None  # configs/model name or path for planning; None: path's config.json
    dtype: str = "bfloat16"  # params dtype of actor and rollout
    # the actor's micro-batches packed: their sequences back to back, no padding (docs/kernels.md);
    # false, or with megatron's DotProductAttention (use_flash_attn=false): padded to their longest
    use_remove_padding: bool = True


# The loss keys' defaults are the loss package's (verl's), not repeated here.
_LOSS = ActorLossConfig()


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = _LOSS.loss_mode


@dataclass(frozen=True)
class ActorOptimConfig(OptimConfig):
    """The actor's optimizer keys: megatron's (``OptimConfig``, in optimizer steps) and verl's
    ``lr_warmup_steps_ratio``: warm up over this fraction of the run (when ``lr_warmup_steps`` is
    0), turned into optimizer steps once the run's length is known."""

    lr_warmup_steps_ratio: float = 0.0


@dataclass(frozen=True)
class RouterReplayConfig:
    """Routing replay (verl's ``megatron.router_replay``): ``R2`` replays, in every training forward,
    the experts the old-log-prob pass chose; ``R3`` replays the rollout engine's (old-log-prob pass
    included), which needs ``rollout.enable_rollout_routing_replay``."""

    mode: str = "disabled"  # disabled | R2 | R3


@dataclass(frozen=True)
class ActorMegatronConfig:
    """The keys of ``actor.megatron`` that are not parallel layout (those are in the layout)."""

    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    # tokens whose float32 log-softmax the log-prob and entropy hold at once (loss.vocab_parallel;
    # 0: every token of a micro-batch at once, for comparisons); every pass of the actor and the reference
    log_prob_chunk_size: int = _LOSS.log_prob_chunk_size


@dataclass(frozen=True)
class ActorCheckpointConfig:
    """verl's ``actor.checkpoint``: how the actor's checkpoint is written (recipe.driver.checkpoint)."""

    async_save: bool = False  # the tensor files are written in the background while training goes on
    # verl's list; "hf_model" adds the Hugging Face model under actor/huggingface/ at each save
    save_contents: list[str] = field(default_factory=lambda: list(CHECKPOINT_CONTENTS))


@dataclass(frozen=True)
class ActorConfig:
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (x rollout.n rows), verl's meaning
    ppo_micro_batch_size_per_gpu: int = 1  # rows per forward/backward
    use_dynamic_bsz: bool = False  # micro-batches by token budget instead of by rows
    ppo_max_token_len_per_gpu: int = 16384  # that budget: padded tokens per micro-batch (x context parallel)
    ppo_epochs: int = 1
    # the loss keys (the algo fragments set them), flat as in verl; RecipeConfig.actor_loss groups them
    clip_ratio_low: float = _LOSS.policy.clip_ratio_low
    clip_ratio_high: float = _LOSS.policy.clip_ratio_high
    clip_ratio_c: float = _LOSS.policy.clip_ratio_c
    loss_agg_mode: str = _LOSS.policy.loss_agg_mode
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    use_kl_loss: bool = _LOSS.use_kl_loss
    kl_loss_coef: float = _LOSS.kl_loss_coef
    kl_loss_type: str = _LOSS.kl_loss_type
    entropy_coeff: float = _LOSS.entropy_coeff
    optim: ActorOptimConfig = field(default_factory=ActorOptimConfig)
    megatron: ActorMegatronConfig = field(default_factory=ActorMegatronConfig)
    checkpoint: ActorCheckpointConfig = field(default_factory=ActorCheckpointConfig)


@dataclass(frozen=True)
class ValKwargs:
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False


@dataclass(frozen=True)
class RolloutConfig:
    name: str = "auto"  # auto | hf | vllm; auto resolves to the device's engine at load
    # the engine's weights and compute: bfloat16 beside a float32 trainer is a real train-rollout gap
    # (docs/stability.md); None: actor_rollout_ref.model.dtype
    dtype: str | None = None
    n: int = 1  # responses per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    log_prob_micro_batch_size_per_gpu: int = 8  # the old-log-prob pass (verl's name)
    # the pass by token budget; None: the actor's use_dynamic_bsz / ppo_max_token_len_per_gpu, as verl
    log_prob_use_dynamic_bsz: bool | None = None
    log_prob_max_token_len_per_gpu: int | None = None
    update_weights_bucket_megabytes: int = 512
    calculate_log_probs: bool = True  # compare the engine's log-probs with the old-log-prob pass (training/, rollout_corr/)
    # further engine arguments per engine, as verl's: {"vllm": {...}} goes to vllm.LLM (the hf engine takes none)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    enable_rollout_routing_replay: bool = False  # the engine reports each token's experts (R3, mismatch metrics)
    # verl's: true, a colocated engine gives its device memory back while the trainer computes
    # (vLLM always does); false, the transformers engine keeps its weights on the device; None:
    # the memory plan decides at load (the transformers engine keeps them where both fit)
    free_cache_engine: bool | None = None
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool | None = None  # None: the actor's, as for the rollout's pass
    log_prob_max_token_len_per_gpu: int | None = None


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    model: ModelConfig
    # verl's switch: true, the rollout engine shares the training devices (colocated); false, it has
    # its own pool (actor_rollout_ref.rollout.nnodes / n_gpus_per_node), for the asynchronous modes
    hybrid_engine: bool = True
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass(frozen=True)
class KLControlConfig:
    """verl's ``algorithm.kl_ctrl``: the coefficient of the KL penalty in the reward, fixed or
    adapted towards ``target_kl`` over ``horizon`` trajectories (Ziegler et al. 2019)."""

    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): keep only groups whose
    ``metric`` varies, generating more batches of ``data.gen_batch_size`` prompts until
    ``data.train_batch_size`` groups are kept."""

    enable: bool = False
    metric: str | None = None  # score | seq_reward | seq_final_reward | acc
    max_num_gen_batches: int = 0  # give up after this many generation batches in one step; <= 0: never


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    grpo_epsilon: float = 1e-6  # added to the group's std before dividing
    # verl's decoupled rollout correction: IS weights pi_old / pi_rollout and rejection (loss.rollout_correction)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    use_kl_in_reward: bool = False  # subtract kl_ctrl's coefficient x the KL to the reference from the reward
    kl_penalty: str = "kl"  # the KL estimator of that penalty (loss.kl_penalty's names)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment over the last ``len`` tokens of max_response_length."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


@dataclass(frozen=True)
class RewardModelConfig:
    # verl's reward manager: "naive" scores each response, "dapo" also applies the overlong buffer;
    # None: "dapo" when the buffer is enabled, else "naive" (the scorer is custom_reward_function's)
    reward_manager: str | None = None
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass(frozen=True)
class CustomRewardFunctionConfig:
    path: str | None = None  # a .py file; None: the built-in scorer
    name: str = "compute_score"


@dataclass(frozen=True)
class TrainerConfig:
    project_name: str = "moe_rl"
    experiment_name: str = "run"
    total_training_steps: int | None = 10  # None: total_epochs decides
    total_epochs: int | None = None  # with it, the run ends after this many passes over the data if that is sooner
    save_freq: int = -1  # -1: never
    test_freq: int = -1
    val_before_train: bool = True
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: str | None = None  # read with resume_mode=resume_path only, as in verl
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"  # checkpoints, metrics.jsonl
    max_actor_ckpt_to_keep: int = 2
    logger: list[str] = field(default_factory=lambda: ["console"])  # jsonl is always written
    seed: int = 1
    routing_drift_freq: int = 1  # every this many steps, measure routing drift old -> updated policy; -1: never
    routing_drift_rows: int = 64  # rows of the step's batch that measurement re-routes (rounded to the DP size)
    log_val_generations: int = 0  # validation samples (prompt, response, score) written per validation
    # > 0: a SIGTERM during a step lets it finish and saves a checkpoint if both are done within this
    # many seconds, else the run stops without one; 0: a SIGTERM stops at once (recipe.driver.signals)
    save_on_sigterm_grace_s: float = 0.0


@dataclass(frozen=True)
class AsyncTrainingConfig:
    """How generation and training overlap (docs/async.md). ``sync``: generate, then train, on the
    same devices. ``one_step_off``: the next step's batch is generated on the rollout's own devices,
    with weights one update old, while this step trains (verl's one-step-off-policy recipe).
    ``fully_async``: batches are generated ahead, the weights pushed every ``trigger_parameter_sync_step``
    steps, samples at most ``max_staleness`` versions old (verl's fully-async-policy recipe), with
    ``partial_rollout`` a batch interrupted by a push and continued under the new weights. The
    schedule: ``recipe.driver.async_schedule``."""

    mode: str = "sync"
    # how long a rank of the weight group (training rank 0 and the rollout pool) waits for the others
    # when joining it and in each bucket's broadcast before the sync fails (recipe.rollout.broadcast)
    weight_sync_timeout_s: float = 600.0
    # the weight group's transport (recipe.rollout.broadcast): auto = the device's collective library
    # (HCCL on NPU, NCCL on GPU, gloo on the CPU), gloo = through host memory over TCP on any device
    weight_sync_backend: str = "auto"
    # how long the trainer waits for a batch from the rollout pool (a rank that hangs, a pool that
    # starves) before the run fails with one line; generous: one batch of long responses takes minutes
    wait_rollout_timeout_s: float = 3600.0
    # fully_async only, verl's keys and defaults: generation beyond one sync interval allowed ahead, as a
    # fraction of the batches trained between pushes; the weights go to the rollout every this many steps
    staleness_threshold: float = 0.1
    trigger_parameter_sync_step: int = 4
    # the step's data.train_batch_size prompts are generated as this many batches of
    # train_batch_size / require_batches, each sent as soon as the bound allows (verl's: its mini-batches)
    require_batches: int = 1
    # a push pauses the batch in flight, which goes on under the new weights (false: the push waits for it)
    partial_rollout: bool = False

    @property
    def sync_every(self) -> int:
        """T: the steps between weight pushes to a rollout pool of its own."""
        return self.trigger_parameter_sync_step if self.mode == "fully_async" else 1

    @property
    def generation_batches(self) -> int:
        """R: the generation batches that make one step's batch."""
        return self.require_batches if self.mode == "fully_async" else 1

    @property
    def batches_ahead(self) -> int:
        """E: generation batches allowed ahead of one push interval, floor(staleness_threshold x T x R)
        (rounded first: 0.3 x 10 is 3, not 2.9999999999999996); one_step_off's is one batch."""
        if self.mode != "fully_async":
            return 1
        return math.floor(round(self.staleness_threshold * self.trigger_parameter_sync_step * self.require_batches, 9))

    @property
    def max_staleness(self) -> int:
        """K: the most versions a sample may be behind the policy that trains on it. T - 1 comes from
        the pushes' interval, ceil(E / R) from the batches allowed ahead of it."""
        return self.sync_every - 1 + math.ceil(self.batches_ahead / self.generation_batches)


@dataclass(frozen=True)
class RecipeConfig:
    data: DataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    layout: Layout  # from the layout keys of the merged config; not a YAML key itself
    parallel: str = "tiny_cpu"
    algo: str = "gspo"
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    ignored: tuple[str, ...] = ()  # verl keys given that have no effect here, with the reason (not a YAML key)
    # what loading chose for the user and why, for the start-up lines (not a YAML key; a config
    # reloaded from its resolved keys has chosen nothing, so equality leaves them out)
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def generation_batch_size(self) -> int:
        """Prompts generated at a time: DAPO's ``data.gen_batch_size``, else one step's share of each of
        its ``require_batches`` generation batches."""
        return self.data.gen_batch_size or self.data.train_batch_size // self.async_training.generation_batches

    @property
    def needs_reference(self) -> bool:
        """A reference model is built: KL to it in the loss or in the reward."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def actor_loss(self) -> ActorLossConfig:
        """The loss hook's settings: the actor's loss keys, and the rollout's temperature (the actor
        divides its logits by it, as the engine did when sampling)."""
        a = self.actor_rollout_ref.actor
        policy = PolicyLossSettings(clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                                    clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode)
        return ActorLossConfig(
            loss_mode=a.policy_loss.loss_mode, policy=policy, use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef,
            kl_loss_type=a.kl_loss_type, entropy_coeff=a.entropy_coeff,
            temperature=self.actor_rollout_ref.rollout.temperature, log_prob_chunk_size=a.megatron.log_prob_chunk_size,
        )


# ---- value rules (by dotted key; types come from the annotations) ----------------------------

Rule = Callable[[Any], "str | None"]  # the requirement a bad value misses, None when it is fine


def at_least(low: int | float) -> Rule:
    return lambda v: None if v >= low else f"must be >= {low}"


def greater_than(low: float) -> Rule:
    return lambda v: None if v > low else f"must be > {low}"


def in_unit_interval(v: float) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def top_k_rule(v: int) -> str | None:
    return None if v == -1 or v >= 1 else "must be -1 (off) or >= 1"


# Seeds stay below 2**31: numpy takes at most 2**32 - 1, and megatron and the data loader add
# offsets (per rank, per epoch) to the seed they are given.
MAX_SEED = 2**31 - 1


def seed_rule(v: int) -> str | None:
    return None if 0 <= v <= MAX_SEED else f"must be from 0 to {MAX_SEED}"


def save_contents_rule(v: list[str]) -> str | None:
    missing = [c for c in CHECKPOINT_CONTENTS if c not in v]
    if missing:
        return (f"lacks {', '.join(missing)}: a checkpoint here always holds {', '.join(CHECKPOINT_CONTENTS)} "
                f"(a resume needs all of them); list them, and hf_model for a Hugging Face copy")
    return one_of((*CHECKPOINT_CONTENTS, "hf_model"))(v)


ASYNC_MODES = ("sync", "one_step_off", "fully_async")


def freq_rule(v: int) -> str | None:
    return None if v == -1 or v >= 1 else "must be -1 (never) or >= 1"


def one_of(choices: Iterable[str] | Callable[[], Iterable[str]]) -> Rule:
    """A choice rule; a callable is asked at check time (policy losses can be registered later)."""

    def check(value: Any) -> str | None:
        valid = tuple(choices() if callable(choices) else choices)
        values = value if isinstance(value, list) else [value]
        bad = [v for v in values if v not in valid]
        return f"{bad[0]!r} is not a valid choice; choose from {', '.join(valid)}" if bad else None

    return check


POSITIVE = at_least(1)
TRUNCATIONS = ("error", "left", "right")
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
DTYPES = tuple(DTYPE_BYTES)
ROLLOUT_NAMES = ("auto", *ENGINES)
RESUME_MODES = ("auto", "disable", "resume_path")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")  # verl's names: weights, optimizer state, schedule/RNG/step
LOGGERS = ("console", "jsonl", "tensorboard", "swanlab", "wandb")
REWARD_MANAGERS = ("naive", "dapo")
ADV_ESTIMATORS = ("grpo",)
ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")
KL_CTRL_TYPES = ("fixed", "adaptive")
FILTER_METRICS = ("score", "seq_reward", "seq_final_reward", "acc")

_ACTOR = "actor_rollout_ref.actor"
_ROLLOUT = "actor_rollout_ref.rollout"
RULES: dict[str, Rule] = {
    "data.train_files": lambda v: None if v else "must name at least one file (or builtin:tiny)",
    "data.max_prompt_length": POSITIVE,
    "data.max_response_length": POSITIVE,
    "data.train_batch_size": POSITIVE,
    "data.val_batch_size": POSITIVE,
    "data.truncation": one_of(TRUNCATIONS),
    "actor_rollout_ref.model.dtype": one_of(DTYPES),
    f"{_ROLLOUT}.dtype": one_of(DTYPES),
    f"{_ACTOR}.ppo_mini_batch_size": POSITIVE,
    f"{_ACTOR}.ppo_micro_batch_size_per_gpu": POSITIVE,
    f"{_ACTOR}.ppo_epochs": POSITIVE,
    f"{_ACTOR}.ppo_max_token_len_per_gpu": POSITIVE,
    f"{_ROLLOUT}.log_prob_max_token_len_per_gpu": POSITIVE,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": POSITIVE,
    f"{_ACTOR}.clip_ratio_low": at_least(0),
    f"{_ACTOR}.clip_ratio_high": at_least(0),
    f"{_ACTOR}.clip_ratio_c": greater_than(1),  # dual-clip bound on the ratio for negative advantages
    f"{_ACTOR}.loss_agg_mode": one_of(LOSS_AGG_MODES),
    f"{_ACTOR}.policy_loss.loss_mode": one_of(policy_loss_modes),
    f"{_ACTOR}.kl_loss_coef": at_least(0),
    f"{_ACTOR}.kl_loss_type": one_of(KL_PENALTY_TYPES),
    f"{_ACTOR}.optim.lr": greater_than(0),
    f"{_ACTOR}.optim.lr_warmup_steps": at_least(0),
    f"{_ACTOR}.optim.lr_decay_style": one_of(LR_DECAY_STYLES),
    f"{_ACTOR}.optim.lr_decay_steps": POSITIVE,
    f"{_ACTOR}.optim.weight_decay": at_least(0),
    f"{_ACTOR}.optim.clip_grad": greater_than(0),
    f"{_ACTOR}.megatron.router_replay.mode": one_of(ROUTER_REPLAY_MODES),
    f"{_ACTOR}.megatron.log_prob_chunk_size": at_least(0),
    f"{_ACTOR}.optim.lr_warmup_steps_ratio": lambda v: None if 0 <= v < 1 else "must be in [0, 1)",
    "data.gen_batch_size": POSITIVE,
    "algorithm.kl_penalty": one_of(KL_PENALTY_TYPES),
    "algorithm.kl_ctrl.type": one_of(KL_CTRL_TYPES),
    "algorithm.kl_ctrl.kl_coef": at_least(0),
    "algorithm.kl_ctrl.horizon": POSITIVE,
    "algorithm.kl_ctrl.target_kl": greater_than(0),
    "algorithm.filter_groups.metric": one_of(FILTER_METRICS),
    "trainer.total_epochs": POSITIVE,
    "trainer.log_val_generations": at_least(0),
    "trainer.save_on_sigterm_grace_s": at_least(0),
    f"{_ROLLOUT}.name": one_of(ROLLOUT_NAMES),
    f"{_ROLLOUT}.n": POSITIVE,
    f"{_ROLLOUT}.temperature": greater_than(0),  # the actor divides logits by it
    f"{_ROLLOUT}.top_p": in_unit_interval,
    f"{_ROLLOUT}.top_k": top_k_rule,
    f"{_ROLLOUT}.log_prob_micro_batch_size_per_gpu": POSITIVE,
    f"{_ROLLOUT}.update_weights_bucket_megabytes": POSITIVE,
    f"{_ROLLOUT}.val_kwargs.n": POSITIVE,
    f"{_ROLLOUT}.val_kwargs.temperature": at_least(0),  # 0: greedy
    f"{_ROLLOUT}.val_kwargs.top_p": in_unit_interval,
    f"{_ROLLOUT}.val_kwargs.top_k": top_k_rule,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": POSITIVE,
    "algorithm.adv_estimator": one_of(ADV_ESTIMATORS),
    "algorithm.grpo_epsilon": greater_than(0),
    "reward_model.reward_manager": lambda v: None if v is None else one_of(REWARD_MANAGERS)(v),
    "reward_model.overlong_buffer.len": at_least(0),
    "reward_model.overlong_buffer.penalty_factor": at_least(0),
    "trainer.total_training_steps": POSITIVE,
    "trainer.seed": seed_rule,
    "data.seed": seed_rule,
    "trainer.save_freq": freq_rule,
    "trainer.test_freq": freq_rule,
    "trainer.resume_mode": one_of(RESUME_MODES),
    "trainer.max_actor_ckpt_to_keep": POSITIVE,
    "trainer.routing_drift_freq": freq_rule,
    "trainer.routing_drift_rows": POSITIVE,
    "trainer.logger": one_of(LOGGERS),
    f"{_ACTOR}.checkpoint.save_contents": save_contents_rule,
    "async_training.mode": one_of(ASYNC_MODES),
    "async_training.weight_sync_timeout_s": greater_than(0),
    "async_training.weight_sync_backend": one_of(("auto", "gloo")),
    "async_training.wait_rollout_timeout_s": greater_than(0),
    "async_training.staleness_threshold": at_least(0),
    "async_training.trigger_parameter_sync_step": POSITIVE,
    "async_training.require_batches": POSITIVE,
}


# ---- YAML and overrides ----------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """PyYAML (YAML 1.1) reads ``1e-6`` and ``1.0e6`` as strings; read them as floats."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    return data


def parse_overrides(args: Iterable[str]) -> dict:
    """``["a.b=c", ...]`` -> ``{"a": {"b": c}}``, values read as YAML (``1e-6``, ``[a,b]``, ``null``).
    Hydra's ``+key`` / ``++key`` (add or force a key), as verl's scripts write them, mean ``key``."""
    out: dict = {}
    for arg in args:
        key, sep, text = arg.partition("=")
        if key.startswith("~"):
            raise ConfigError(f"override {arg!r}: deleting a key (~key) is not supported; leave the key out or set "
                              "it to its default")
        parts = key.strip().lstrip("+").split(".")
        if not sep or not all(parts):
            raise ConfigError(f"override {arg!r}: expected key.sub=value, e.g. data.train_batch_size=16")
        try:
            value = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {arg!r}: the value is not valid YAML: {e}") from e
        for part in reversed(parts):
            value = {part: value}
        out = deep_merge(out, value)
    return out


def deep_merge(base: Mapping, top: Mapping) -> dict:
    """``top`` over ``base``; mappings merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_path(kind: str, ref: str) -> str:
    """A config file named by a path (relative to the current directory first) or a shipped name."""
    found = find_config(kind, ref)
    if found is None:
        raise ConfigError(f"{kind} {ref!r}: no such file or shipped {kind}; shipped: {', '.join(shipped(kind))}")
    return found


# ---- loading ---------------------------------------------------------------------------------


def load_config(path: str, overrides: Iterable[str] = ()) -> RecipeConfig:
    """Compose a recipe with its fragments and overrides, then type and validate it."""
    path = resolve_path("recipe", path)
    recipe = read_yaml(path)
    rest = parse_overrides(overrides)
    refs = {}
    for kind, default in (("algo", RecipeConfig.algo), ("parallel", RecipeConfig.parallel)):
        ref = rest.pop(kind, recipe.pop(kind, default))
        if not isinstance(ref, str):
            raise ConfigError(f"{path}: {kind}={ref!r}: expected a shipped {kind} name or a path")
        refs[kind] = ref
    merged: dict = {}
    for layer in (read_yaml(resolve_path("algo", refs["algo"])),
                  read_yaml(resolve_path("parallel", refs["parallel"])), recipe, rest):
        merged = deep_merge(merged, layer)
    return config_from_dict({**merged, **refs}, name=path)


def config_from_dict(data: Mapping[str, Any], name: str) -> RecipeConfig:
    """Type and validate an already composed config (``name`` labels the errors: the file). verl's
    spellings are translated first (``recipe.verl_compat``)."""
    verl = translate(data)
    if verl.errors:
        raise ConfigError(f"{name}: verl keys that do not apply here:\n" + "\n".join(f"  - {e}" for e in verl.errors))
    cfg = _build(verl.data, name, tuple(verl.ignored))
    plain = config_to_dict(cfg)  # defaults filled in, so references to them resolve too
    resolved = _interpolate(plain, name)
    if resolved != plain:
        cfg = _build(resolved, name, tuple(verl.ignored))
    cfg = _log_prob_passes_follow_actor(_resolve_rollout_engine(cfg, name))
    cfg = _rollout_correction_when_async(cfg, verl.data)
    problems = _pool_problems(cfg)
    cfg = _colocated_rollout_on_training_devices(cfg)
    problems = (check_equal(verl.equal_checks, config_to_dict(cfg)) + _cross_checks(cfg) + problems
                + _fully_async_problems(cfg) + _layout_problems(cfg, name))
    if problems:
        raise ConfigError(f"{name}: invalid config:\n" + "\n".join(f"  - {p}" for p in problems))
    return _engine_memory_between_rollouts(cfg, name)


def config_to_dict(cfg: RecipeConfig) -> dict:
    """The config in YAML key form, layout keys included (inverse of ``config_from_dict``)."""
    data = {f.name: _plain(getattr(cfg, f.name)) for f in fields(cfg) if f.name not in _DERIVED}
    return deep_merge(data, layout_to_dict(cfg.layout))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    return list(value) if isinstance(value, list) else value


# ---- typing: dict -> dataclasses -------------------------------------------------------------


def _build(data: Mapping[str, Any], name: str, ignored: tuple[str, ...] = ()) -> RecipeConfig:
    unknown = _unknown_keys(data, RecipeConfig, _LAYOUT_KEYS, "")
    if unknown:
        raise ConfigError(f"{name}: {len(unknown)} unknown key(s):\n" + "\n".join(f"  - {u}" for u in unknown))
    layout_part: dict = {}
    values = _typed_fields(RecipeConfig, data, "", _LAYOUT_KEYS, layout_part, name)
    layout = layout_from_dict(layout_part, name)
    layout_name = os.path.basename(values.get("parallel", RecipeConfig.parallel)).removesuffix(".yaml")
    return RecipeConfig(**values, layout=dataclasses.replace(layout, name=layout_name), ignored=ignored)


def _unknown_keys(data: Any, cls, layout_keys: Any, key: str) -> list[str]:
    """Every unknown key under ``data`` (the schema ``cls`` and the layout keys), each with the
    nearest known one, so that one error lists them all."""
    if not isinstance(data, Mapping):
        return []  # a non-mapping section is a type error, reported when typing
    schema = {f.name: f for f in fields(cls) if f.name not in _DERIVED} if cls is not None else {}
    layout_keys = layout_keys if isinstance(layout_keys, Mapping) else {}
    known = list(schema) + [k for k in layout_keys if k not in schema]
    hints = typing.get_type_hints(cls) if cls is not None else {}
    out = []
    for sub, value in data.items():
        if sub not in known:
            near = nearest_key(sub, known)
            out.append(f"{_join(key, str(sub))}: unknown key; "
                       + (f"did you mean {_join(key, near)}?" if near else f"known keys here: {', '.join(known)}"))
        else:
            nested = hints.get(sub) if dataclasses.is_dataclass(hints.get(sub)) else None
            if nested is not None or isinstance(layout_keys.get(sub), Mapping):
                out += _unknown_keys(value, nested, layout_keys.get(sub, {}), _join(key, sub))
    return out


def _join(key: str, sub: str) -> str:
    return f"{key}.{sub}" if key else sub


def _check_known(data: Any, known: list[str], key: str, name: str) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{name}: {key}={data!r}: expected a mapping of keys")
    for sub in data:
        if sub not in known:
            near = nearest_key(sub, known)
            hint = f"did you mean {_join(key, near)}?" if near else f"known keys here: {', '.join(known)}"
            raise ConfigError(f"{name}: {_join(key, str(sub))}: unknown key; {hint}")


def _typed_fields(cls, data: Any, key: str, layout_keys: Mapping, layout_out: dict, name: str) -> dict:
    """The fields of ``cls`` from ``data``, typed and checked; layout keys go to ``layout_out``."""
    data = {} if data is None else data
    schema = {f.name: f for f in fields(cls) if f.name not in _DERIVED}
    _check_known(data, list(schema) + [k for k in layout_keys if k not in schema], key, name)
    hints = typing.get_type_hints(cls)
    for sub, value in data.items():
        if sub not in schema:
            layout_out[sub] = _layout_only(value, layout_keys[sub], _join(key, sub), name)
    values = {}
    for sub, f in schema.items():
        sub_key, hint = _join(key, sub), hints[sub]
        if sub in data:
            value = data[sub]
        elif dataclasses.is_dataclass(hint):
            value = {}  # an absent section: its defaults, or an error naming its first required key
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{name}: {sub_key} is required; set it in the recipe or override {sub_key}=...")
        else:
            continue
        if dataclasses.is_dataclass(hint):
            nested_layout = layout_out.setdefault(sub, {}) if sub in layout_keys else {}
            values[sub] = _construct(hint, value, sub_key, layout_keys.get(sub, {}), nested_layout, name)
        else:
            values[sub] = _coerce(value, hint, sub_key, name)
    return values


def _construct(cls, data: Any, key: str, layout_keys: Mapping, layout_out: dict, name: str):
    values = _typed_fields(cls, data, key, layout_keys, layout_out, name)
    try:
        return cls(**values)
    except ValueError as e:  # checks of classes owned elsewhere (OptimConfig, RolloutCorrectionConfig)
        raise ConfigError(f"{name}: {key}: {e}") from e


def _layout_only(value: Any, layout_keys: Any, key: str, name: str) -> Any:
    """A layout leaf as given, or a layout-only section checked key by key."""
    if not isinstance(layout_keys, Mapping):
        return value
    _check_known({} if value is None else value, list(layout_keys), key, name)
    return {sub: _layout_only(v, layout_keys[sub], _join(key, sub), name) for sub, v in (value or {}).items()}


def _type_name(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, "a mapping of keys"
                                                                                             if typing.get_origin(tp) is dict else str(tp))


def _coerce(value: Any, tp: Any, key: str, name: str) -> Any:
    union = isinstance(tp, types.UnionType)
    members = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
    expected = " or ".join(_type_name(a) for a in members)
    if value is None:
        if union and type(None) in typing.get_args(tp):
            return None
        raise ConfigError(f"{name}: {key}=null: expected {expected}; set a value or drop the key for the default")
    tp = members[0]
    if len(members) > 1:  # e.g. verl's thresholds: a number or a "lower_upper" string
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        tp = next((a for a in members if (number if a is float else isinstance(value, a))), None)
        if tp is None:
            raise ConfigError(f"{name}: {key}={value!r}: expected {expected}")
    if typing.get_origin(tp) is list:
        items = [value] if isinstance(value, str) else value  # a single file or logger name
        if not isinstance(items, list):
            raise ConfigError(f"{name}: {key}={value!r}: expected a list of strings, e.g. [a, b]")
        value = [_coerce(item, typing.get_args(tp)[0], f"{key}[{i}]", name) for i, item in enumerate(items)]
    elif typing.get_origin(tp) is dict:  # free-form, passed on as it is (engine arguments)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name}: {key}={value!r}: expected a mapping of keys")
        value = dict(value)
    elif tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{name}: {key}={value!r}: expected {_type_name(tp)}")
    rule = RULES.get(key)
    problem = rule(value) if rule else None
    if problem:
        raise ConfigError(f"{name}: {key}={value!r}: {problem}")
    return value


# ---- interpolation: ${dotted.key} in string values -------------------------------------------

_REFERENCE = re.compile(r"\$\{([^}]*)\}")


def _interpolate(data: dict, name: str) -> dict:
    """``data`` with every ``${dotted.key}`` in a string replaced by that key's value."""

    def lookup(ref: str, chain: tuple[str, ...]) -> Any:
        if ref in chain:
            raise ConfigError(f"{name}: {chain[0]}: ${{{ref}}} refers back to itself ({' -> '.join(chain + (ref,))})")
        node: Any = data
        for part in ref.split("."):
            if not isinstance(node, Mapping) or part not in node:
                raise ConfigError(f"{name}: {chain[-1]}: ${{{ref}}} names no config key; write a dotted key such as "
                                  "${trainer.project_name}")
            node = node[part]
        if isinstance(node, (Mapping, list)):
            raise ConfigError(f"{name}: {chain[-1]}: ${{{ref}}} is a section or list; refer to a single value")
        return resolve(node, chain + (ref,))

    def resolve(value: Any, chain: tuple[str, ...]) -> Any:
        if not isinstance(value, str):
            return value
        return _REFERENCE.sub(lambda m: str(lookup(m.group(1), chain)), value)

    def walk(node: Any, key: str) -> Any:
        if isinstance(node, Mapping):
            return {k: walk(v, _join(key, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, key) for v in node]
        return resolve(node, (key,))

    return walk(data, "")


# ---- checks across keys ----------------------------------------------------------------------


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
        notes += (f"rollout engine: {engine} ({_ROLLOUT}.name=auto: {why})",)
    else:
        engine = rollout.name
    dtype = _first_set(rollout.dtype, cfg.actor_rollout_ref.model.dtype)
    arr = dataclasses.replace(cfg.actor_rollout_ref, rollout=dataclasses.replace(rollout, name=engine, dtype=dtype))
    ignored = cfg.ignored + tuple(f"{_ROLLOUT}.engine_kwargs.{k} (the {engine} engine takes no such arguments)"
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
            f"data.train_batch_size ({data.train_batch_size}) must be a multiple of {_ACTOR}.ppo_mini_batch_size "
            f"({mini}): set ppo_mini_batch_size to one of {_divisors(data.train_batch_size)}"
        )
    dense = t.tp * t.pp * t.cp
    if world % dense == 0:  # otherwise the layout check reports it
        dp, rows = world // dense, mini * n
        if rows % dp:
            out.append(
                f"{_ACTOR}.ppo_mini_batch_size x {_ROLLOUT}.n = {mini} x {n} = {rows} rows per optimizer step must "
                f"split over the training DP = world / (TP*PP*CP) = {world} / {dense} = {dp} ranks: change "
                f"ppo_mini_batch_size or rollout.n so that their product is a multiple of {dp}"
            )
        elif (rows // dp) % micro:
            out.append(
                f"each of the {dp} training DP ranks gets {rows} / {dp} = {rows // dp} rows per optimizer step, "
                f"which must be a multiple of {_ACTOR}.ppo_micro_batch_size_per_gpu ({micro}): set it to one of "
                f"{_divisors(rows // dp)}"
            )
    batches = cfg.async_training.generation_batches
    prompts = data.train_batch_size // batches if data.train_batch_size % batches == 0 else data.train_batch_size
    if (prompts * n) % rollout_dp:
        what = (f"data.train_batch_size x {_ROLLOUT}.n = {prompts} x {n}" if batches == 1 else
                f"data.train_batch_size / async_training.require_batches x {_ROLLOUT}.n = "
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
        out.append(f"{_ROLLOUT}.free_cache_engine=false with rollout.name=vllm: a colocated vLLM always gives its "
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
    rc = cfg.algorithm.rollout_correction
    if (rc.rollout_is is not None or rc.rollout_rs is not None) and not cfg.actor_rollout_ref.rollout.calculate_log_probs:
        out.append(f"algorithm.rollout_correction needs the rollout engine's log-probs: set "
                   f"{_ROLLOUT}.calculate_log_probs=true (or rollout_is=null and rollout_rs=null)")
    if cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "R3" and \
            not cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay:
        out.append(f"{_ACTOR}.megatron.router_replay.mode=R3 replays the rollout engine's routing: set "
                   f"{_ROLLOUT}.enable_rollout_routing_replay=true (or use mode R2)")
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


def _pool_is_trainers(layout: Layout) -> bool:
    """The rollout's nnodes / n_gpus_per_node are the trainer's."""
    pool, cluster = layout.rollout, layout.cluster
    return (pool.nnodes or 1, pool.devices_per_node) == (cluster.nnodes, cluster.devices_per_node)


def _pool_problems(cfg: RecipeConfig) -> list[str]:
    """Where the rollout runs (``hybrid_engine``, its own pool) against ``async_training.mode``."""
    layout, arr, mode = cfg.layout, cfg.actor_rollout_ref, cfg.async_training.mode
    pool, cluster = layout.rollout, layout.cluster
    given = f"{_ROLLOUT}.nnodes / n_gpus_per_node"
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
                   f"{_ROLLOUT}.n_gpus_per_node (and nnodes, default 1)")
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


def _engine_memory_between_rollouts(cfg: RecipeConfig, name: str) -> RecipeConfig:
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
        notes += (f"rollout engine {what} ({_ROLLOUT}.free_cache_engine={str(not keep).lower()}: {note})",)
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


def layout_verdict(cfg: RecipeConfig, spec: ModelSpec):
    """The planner's verdict on this recipe's layout for its sequences (prompt + response), micro-batch,
    reference model, packing and log-prob chunks."""
    arr = cfg.actor_rollout_ref
    return evaluate(spec, cfg.layout, cfg.data.max_prompt_length + cfg.data.max_response_length,
                    arr.actor.ppo_micro_batch_size_per_gpu, cfg.needs_reference, arr.model.use_remove_padding,
                    arr.actor.megatron.log_prob_chunk_size)

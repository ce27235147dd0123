"""The recipe's schema: one frozen dataclass per YAML section, verl's key names and defaults.
Types come from the annotations (``recipe.config.load`` coerces to them); the rule of each
value is in ``recipe.config.rules``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from loss import PolicyLossSettings, RolloutCorrectionConfig
from loss.megatron_hook import ActorLossConfig
from megatron_bridge.plan.layout import Layout
from megatron_bridge.runtime.optim import OptimConfig

BUILTIN_TINY = "builtin:tiny"
BUILTIN_TASKS = ("tiny", "tiny_long", "tiny_long_tail")  # builtin:<task>, built by recipe/data/tiny_task.py
DERIVED_FIELDS = ("layout", "ignored", "notes")  # RecipeConfig fields built while loading, not YAML keys
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")  # verl's names: weights, optimizer state, schedule/RNG/step


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
    # the log-prob and entropy chunks as kernels torch.compile fuses (docs/kernels.md); CUDA and CPU
    use_fused_kernels: bool = False


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
            fused_kernels=self.actor_rollout_ref.model.use_fused_kernels,
        )

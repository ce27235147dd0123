"""What each value must be, by dotted key: the choices and bounds that the annotations' types do not
say. ``recipe.config.load`` applies them while typing, so an error names the key. The loss keys' and
the optimizer's rules are their library dataclasses' (``FIELD_RULES``, which those check too), named
here by the recipe's keys; the vocabulary (``at_least``, ``one_of`` ...) is ``loss.rules``."""

from __future__ import annotations

from loss import KL_PENALTY_TYPES, PolicyLossSettings
from loss.megatron_hook import ActorLossConfig
from loss.rules import Rule, at_least, greater_than, one_of
from megatron_bridge.runtime.batch import ReplayMode
from megatron_bridge.runtime.optim import OptimConfig
from recipe.config.schema import CHECKPOINT_CONTENTS
from recipe.rollout import ENGINES


# ---- value rules (by dotted key; types come from the annotations) ----------------------------


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


POSITIVE = at_least(1)
TRUNCATIONS = ("error", "left", "right")
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
DTYPES = tuple(DTYPE_BYTES)
ROLLOUT_NAMES = ("auto", *ENGINES)
RESUME_MODES = ("auto", "disable", "resume_path")
LOGGERS = ("console", "jsonl", "tensorboard", "swanlab", "wandb")
REWARD_MANAGERS = ("naive", "dapo")
ADV_ESTIMATORS = ("grpo",)
ROUTER_REPLAY_MODES = tuple(mode.value for mode in ReplayMode)
KL_CTRL_TYPES = ("fixed", "adaptive")
FILTER_METRICS = ("score", "seq_reward", "seq_final_reward", "acc")

ACTOR = "actor_rollout_ref.actor"  # the key prefixes the rules and the checks name
ROLLOUT = "actor_rollout_ref.rollout"
_LOSS = ActorLossConfig.FIELD_RULES
RULES: dict[str, Rule] = {
    "data.train_files": lambda v: None if v else "must name at least one file (or builtin:tiny)",
    "data.max_prompt_length": POSITIVE,
    "data.max_response_length": POSITIVE,
    "data.train_batch_size": POSITIVE,
    "data.val_batch_size": POSITIVE,
    "data.truncation": one_of(TRUNCATIONS),
    "actor_rollout_ref.model.dtype": one_of(DTYPES),
    f"{ROLLOUT}.dtype": one_of(DTYPES),
    f"{ACTOR}.ppo_mini_batch_size": POSITIVE,
    f"{ACTOR}.ppo_micro_batch_size_per_gpu": POSITIVE,
    f"{ACTOR}.ppo_epochs": POSITIVE,
    f"{ACTOR}.ppo_max_token_len_per_gpu": POSITIVE,
    f"{ROLLOUT}.log_prob_max_token_len_per_gpu": POSITIVE,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": POSITIVE,
    # the loss keys and the optimizer's: their library dataclasses' rules, under the recipe's keys
    **{f"{ACTOR}.{field}": rule for field, rule in PolicyLossSettings.FIELD_RULES.items()},  # flat, as verl's
    f"{ACTOR}.policy_loss.loss_mode": _LOSS["loss_mode"],
    f"{ACTOR}.kl_loss_coef": _LOSS["kl_loss_coef"],
    f"{ACTOR}.kl_loss_type": _LOSS["kl_loss_type"],
    f"{ACTOR}.megatron.log_prob_chunk_size": _LOSS["log_prob_chunk_size"],
    f"{ROLLOUT}.temperature": _LOSS["temperature"],  # the engine samples with it, the actor divides logits by it
    **{f"{ACTOR}.optim.{field}": rule for field, rule in OptimConfig.FIELD_RULES.items()},
    f"{ACTOR}.megatron.router_replay.mode": one_of(ROUTER_REPLAY_MODES),
    f"{ACTOR}.optim.lr_warmup_steps_ratio": lambda v: None if 0 <= v < 1 else "must be in [0, 1)",
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
    f"{ROLLOUT}.name": one_of(ROLLOUT_NAMES),
    f"{ROLLOUT}.n": POSITIVE,
    f"{ROLLOUT}.top_p": in_unit_interval,
    f"{ROLLOUT}.top_k": top_k_rule,
    f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": POSITIVE,
    f"{ROLLOUT}.update_weights_bucket_megabytes": POSITIVE,
    f"{ROLLOUT}.val_kwargs.n": POSITIVE,
    f"{ROLLOUT}.val_kwargs.temperature": at_least(0),  # 0: greedy
    f"{ROLLOUT}.val_kwargs.top_p": in_unit_interval,
    f"{ROLLOUT}.val_kwargs.top_k": top_k_rule,
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
    f"{ACTOR}.checkpoint.save_contents": save_contents_rule,
    "async_training.mode": one_of(ASYNC_MODES),
    "async_training.weight_sync_timeout_s": greater_than(0),
    "async_training.weight_sync_backend": one_of(("auto", "gloo")),
    "async_training.wait_rollout_timeout_s": greater_than(0),
    "async_training.staleness_threshold": at_least(0),
    "async_training.trigger_parameter_sync_step": POSITIVE,
    "async_training.require_batches": POSITIVE,
}

"""What a rank is built from: the recipe's settings its roles use, typed, picked once by the driver
(``RankSettings.of``) from the loaded recipe. A rank never reads the recipe itself, so what it
depends on is written here, and a worker is sent these few fields rather than the whole config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from loss.megatron_hook import ActorLossConfig
from megatron_bridge.plan.layout import Layout
from megatron_bridge.runtime.optim import OptimConfig
from recipe.config import RecipeConfig

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class PassSizes:
    """How one pass cuts a rank's rows into micro-batches."""

    micro_batch_rows: int
    # with dynamic batch size: a micro-batch's token budget (verl's per-GPU budget, x context
    # parallel); None: micro-batches by rows
    max_tokens: int | None


@dataclass(frozen=True)
class ActorSettings:
    """The actor role's: its shard, its loss, its passes, its checkpoint and its weight export."""

    dtype: torch.dtype
    pack: bool  # actor_rollout_ref.model.use_remove_padding
    optim: OptimConfig
    loss: ActorLossConfig
    with_reference: bool  # KL to a reference model, in the loss or in the reward
    async_save: bool
    export_bucket_mb: int
    old_log_probs: PassSizes  # verl's rollout.log_prob_* keys
    ref_log_probs: PassSizes  # verl's ref.log_prob_* keys
    update: PassSizes
    ppo_epochs: int


@dataclass(frozen=True)
class RolloutSettings:
    """The rollout role's: its engine and how it shares the device."""

    engine: str  # a name of recipe.rollout.ENGINES
    dtype: torch.dtype
    max_model_len: int  # prompt + response tokens
    return_routed_experts: bool
    engine_kwargs: Mapping[str, Any] | None
    pausable: bool  # partial rollout: a pause stops a generation between tokens
    free_cache_engine: bool  # colocated: the engine sleeps while the actor computes


@dataclass(frozen=True)
class RankSettings:
    layout: Layout
    seed: int
    actor: ActorSettings
    rollout: RolloutSettings
    weight_sync_timeout_s: float  # a rollout pool of its own: its weight group's time limit
    weight_sync_backend: str

    @classmethod
    def of(cls, cfg: RecipeConfig) -> RankSettings:
        arr, cp = cfg.actor_rollout_ref, cfg.layout.train.cp
        a, r, ref = arr.actor, arr.rollout, arr.ref

        def sizes(micro: int, dynamic: bool, per_gpu: int) -> PassSizes:
            return PassSizes(micro, per_gpu * cp if dynamic else None)

        actor = ActorSettings(
            dtype=DTYPES[arr.model.dtype], pack=arr.model.use_remove_padding, optim=a.optim, loss=cfg.actor_loss,
            with_reference=cfg.needs_reference, async_save=a.checkpoint.async_save,
            export_bucket_mb=r.update_weights_bucket_megabytes,
            old_log_probs=sizes(r.log_prob_micro_batch_size_per_gpu, r.log_prob_use_dynamic_bsz,
                                r.log_prob_max_token_len_per_gpu),
            ref_log_probs=sizes(ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_use_dynamic_bsz,
                                ref.log_prob_max_token_len_per_gpu),
            update=sizes(a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu),
            ppo_epochs=a.ppo_epochs,
        )
        rollout = RolloutSettings(
            engine=r.name, dtype=DTYPES[r.dtype], max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
            return_routed_experts=r.enable_rollout_routing_replay, engine_kwargs=r.engine_kwargs.get(r.name),
            pausable=cfg.async_training.partial_rollout, free_cache_engine=r.free_cache_engine,
        )
        return cls(layout=cfg.layout, seed=cfg.trainer.seed, actor=actor, rollout=rollout,
                   weight_sync_timeout_s=cfg.async_training.weight_sync_timeout_s,
                   weight_sync_backend=cfg.async_training.weight_sync_backend)

"""Policy-loss library for RL post-training: loss aggregation, PPO/GSPO policy losses, KL penalties, entropy,
train-rollout mismatch metrics and rollout correction.

Importing the package registers the built-in policy losses ``vanilla``,
``gspo`` and ``gspo_token``; add more with ``@register_policy_loss(name)``.
Only torch is required.
"""

from . import gspo as _gspo, vanilla as _vanilla  # noqa: F401  (import registers the built-in modes)
from .aggregation import LOSS_AGG_MODES, Normalization, agg_loss, masked_mean
from .entropy import entropy_from_logits
from .kl import KL_PENALTY_TYPES, kl_penalty
from .policy import compute_policy_loss
from .registry import PolicyLossFn, PolicyLossSettings, get_policy_loss_fn, policy_loss_modes, register_policy_loss
from .rollout_correction import RolloutCorrectionConfig, rollout_correction, rollout_mismatch_metrics

__all__ = [
    "KL_PENALTY_TYPES",
    "LOSS_AGG_MODES",
    "Normalization",
    "PolicyLossFn",
    "PolicyLossSettings",
    "RolloutCorrectionConfig",
    "agg_loss",
    "compute_policy_loss",
    "entropy_from_logits",
    "get_policy_loss_fn",
    "kl_penalty",
    "masked_mean",
    "policy_loss_modes",
    "register_policy_loss",
    "rollout_correction",
    "rollout_mismatch_metrics",
]

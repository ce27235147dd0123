"""Policy-loss library for RL post-training: the policy losses (``vanilla``: PPO/GRPO clip;
``gspo``: GSPO and its token form) with their shared pieces (``surrogate``), the registry of
losses by name (``registry``) and the entry point that checks the inputs and calls one
(``policy``), loss aggregation (``aggregation``), KL penalties (``kl``), entropy (``entropy``),
train-rollout mismatch metrics and rollout correction (``rollout_correction``), and the Megatron
loss hook (``megatron_hook``, with the chunked vocab-parallel log-probs and entropy of
``vocab_parallel``).

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

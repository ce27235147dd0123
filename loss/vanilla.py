"""PPO/GRPO token-level clipped loss with clip-higher (DAPO) and dual clip, as verl's ``vanilla`` mode."""

import torch

from .aggregation import Normalization, agg_loss
from .registry import PolicyLossSettings, register_policy_loss
from .surrogate import apply_rollout_is_weights, clipped_surrogate, masked_inputs, policy_metrics

# verl's bound on the per-token log ratio: keeps exp() finite for any single wild token.
_MAX_ABS_LOG_RATIO = 20.0


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: PolicyLossSettings,
    norm: Normalization,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO loss; ratios are clipped to [1-low, 1+high].

    Dual clip (arXiv 1912.09729): for A < 0 the clipped loss grows without
    bound in the ratio, so it is capped at -A * clip_ratio_c (> 1, ``PolicyLossSettings`` checks).
    """
    mask = response_mask.bool()
    log_ratio, advantages = masked_inputs(old_log_prob, log_prob, advantages, mask)
    log_ratio = torch.clamp(log_ratio, -_MAX_ABS_LOG_RATIO, _MAX_ABS_LOG_RATIO)

    clip_loss, clipped = clipped_surrogate(
        advantages, torch.exp(log_ratio), settings.clip_ratio_low, settings.clip_ratio_high
    )
    dual_clip_loss = -advantages * settings.clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(clip_loss, dual_clip_loss), clip_loss)
    loss_mat = apply_rollout_is_weights(loss_mat, rollout_is_weights, mask)

    loss = agg_loss(loss_mat, mask, settings.loss_agg_mode, norm.dp_size, norm.batch_num_tokens, norm.global_batch_size)
    metrics = policy_metrics(
        mask,
        pg_clipfrac=clipped,
        ppo_kl=-log_ratio,
        pg_clipfrac_lower=(clip_loss > dual_clip_loss) & negative,
    )
    return loss, metrics

"""Building blocks shared by the built-in policy losses."""

import torch

from .aggregation import masked_mean


def masked_inputs(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log(pi / pi_old) and advantages, both exactly 0 at masked positions.

    Zeroing *before* any exp/clamp keeps padding values, however large, out of
    the loss and out of the gradient: torch.where sends a zero gradient to the
    branch it did not pick, whereas multiplying by the mask later would turn an
    overflowed padding value into 0 * inf = NaN.
    """
    log_ratio = torch.where(mask, log_prob - old_log_prob, 0.0)
    return log_ratio, torch.where(mask, advantages, 0.0)


def clipped_surrogate(
    advantages: torch.Tensor, ratio: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic loss max(-A*r, -A*clip(r, 1-low, 1+high)) and where the clipped term won."""
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(loss_unclipped, loss_clipped), loss_clipped > loss_unclipped


def apply_rollout_is_weights(
    loss_mat: torch.Tensor, rollout_is_weights: torch.Tensor | None, mask: torch.Tensor
) -> torch.Tensor:
    """The per-token loss times the rollout IS weights (verl's decoupled rollout correction).

    The weights are constants of the objective (detached). Padding entries are
    replaced by 1 so that junk there cannot reach the gradient as 0 * NaN.
    ``None`` returns ``loss_mat`` itself.
    """
    if rollout_is_weights is None:
        return loss_mat
    return loss_mat * torch.where(mask, rollout_is_weights.detach().to(loss_mat.dtype), 1.0)


@torch.no_grad()
def policy_metrics(
    mask: torch.Tensor,
    *,
    pg_clipfrac: torch.Tensor,
    ppo_kl: torch.Tensor,
    pg_clipfrac_lower: torch.Tensor | None,
) -> dict[str, float]:
    """Token-masked means over this call's tokens as Python floats.

    ``pg_clipfrac_lower=None`` means the mode has no dual clip (reported as 0.0).
    """
    lower = torch.zeros_like(pg_clipfrac) if pg_clipfrac_lower is None else pg_clipfrac_lower
    # One stacked .tolist() means one device sync instead of three .item() calls.
    values = torch.stack([masked_mean(v.to(ppo_kl.dtype), mask) for v in (pg_clipfrac, ppo_kl, lower)]).tolist()
    return dict(zip(("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"), values))

"""Entry point: validate inputs and dispatch to a registered policy loss by name."""

import torch

from .aggregation import Count, check_loss_agg_mode
from .registry import get_policy_loss_fn


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1 or any(len(s) != 2 for s in shapes.values()):
        got = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"policy-loss inputs must all have the same (batch, response_len) shape; got {got}")


def compute_policy_loss(
    loss_mode: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Count | None = None,
    global_batch_size: Count | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss of the registered mode ``loss_mode`` (e.g. ``vanilla``, ``gspo``, ``gspo_token``).

    All tensors are (batch, response_len); ``response_mask`` is 0/1. See
    ``agg_loss`` for ``loss_agg_mode`` and for how ``dp_size``,
    ``batch_num_tokens`` and ``global_batch_size`` make micro-batched,
    data-parallel losses add up to the whole-batch loss.

    Returns the scalar loss and ``actor/pg_clipfrac``, ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower`` as Python floats (masked means over this
    call's tokens; 0.0 when it has none).
    """
    fn = get_policy_loss_fn(loss_mode)
    _check_shapes(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask
    )
    # Fail before any compute (and before a mode's warnings) on a bad mode string.
    check_loss_agg_mode(loss_agg_mode)
    return fn(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
    )

"""Entry point: validate inputs and dispatch to a registered policy loss by name."""

import inspect

import torch

from .aggregation import Normalization
from .registry import PolicyLossFn, PolicyLossSettings, get_policy_loss_fn


def check_shapes(what: str, **tensors: torch.Tensor) -> None:
    """ValueError naming every tensor's shape unless all are the same (batch, response_len)."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1 or any(len(s) != 2 for s in shapes.values()):
        got = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"{what} must all have the same (batch, response_len) shape; got {got}")


def _check_takes_rollout_is_weights(loss_mode: str, fn: PolicyLossFn) -> None:
    params = inspect.signature(fn).parameters.values()
    if not any(p.name == "rollout_is_weights" or p.kind is p.VAR_KEYWORD for p in params):
        raise ValueError(
            f"policy loss {loss_mode!r} does not take rollout_is_weights: give it a keyword parameter "
            f"rollout_is_weights and multiply the weights into its per-token loss before agg_loss "
            f"(loss.surrogate.apply_rollout_is_weights), or call it without rollout_is_weights"
        )


def compute_policy_loss(
    loss_mode: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: PolicyLossSettings,
    norm: Normalization = Normalization(),
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss of the registered mode ``loss_mode`` (e.g. ``vanilla``, ``gspo``, ``gspo_token``).

    All tensors are (batch, response_len); ``response_mask`` is 0/1. ``settings`` holds the clip
    range and the aggregation mode; see ``agg_loss`` for the modes and for how ``norm`` makes
    micro-batched, data-parallel losses add up to the whole-batch loss (the default: this call is
    the whole batch).

    ``rollout_is_weights`` (batch, response_len), from ``rollout_correction``,
    multiplies the per-token loss before aggregation, as verl's decoupled
    rollout correction does; the weights are treated as constants (no
    gradient) and their padding entries are never read. It is passed to the
    mode only when given, so user modes without that parameter still work
    without weights.

    Returns the scalar loss and ``actor/pg_clipfrac``, ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower`` as Python floats (masked means over this
    call's tokens; 0.0 when it has none).
    """
    fn = get_policy_loss_fn(loss_mode)
    weights = {} if rollout_is_weights is None else {"rollout_is_weights": rollout_is_weights}
    check_shapes(
        "policy-loss inputs",
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        **weights,
    )
    if weights:
        _check_takes_rollout_is_weights(loss_mode, fn)
    return fn(old_log_prob, log_prob, advantages, response_mask, settings, norm, **weights)

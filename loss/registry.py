"""Name -> policy-loss function registry, so configs can select (and users add) modes by string."""

from typing import Callable, Protocol

import torch

from .aggregation import Count


class PolicyLossFn(Protocol):
    """Signature every registered policy loss implements.

    Returns the scalar loss (already aggregated with ``agg_loss``) and a dict of
    Python-float metrics with at least ``actor/pg_clipfrac``, ``actor/ppo_kl``
    and ``actor/pg_clipfrac_lower``.

    ``rollout_is_weights`` is optional for a mode: ``compute_policy_loss``
    passes it only when the caller gives weights, and a mode that takes it
    multiplies its per-token loss by them before aggregating.
    """

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        clip_ratio_low: float,
        clip_ratio_high: float,
        clip_ratio_c: float,
        loss_agg_mode: str,
        dp_size: int,
        batch_num_tokens: Count | None,
        global_batch_size: Count | None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name``.

    Re-registering a name raises ValueError: silently replacing a built-in mode
    would change training without any trace in the config.
    """

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``; ValueError listing known names otherwise."""
    try:
        return _POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy loss mode {name!r}; registered modes: {', '.join(policy_loss_modes())}"
        ) from None


def policy_loss_modes() -> tuple[str, ...]:
    """Names of all registered policy losses (built-in and user), sorted."""
    return tuple(sorted(_POLICY_LOSSES))

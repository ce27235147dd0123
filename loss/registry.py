"""Name -> policy-loss function registry, so configs can select (and users add) modes by string."""

from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

import torch

from .aggregation import LOSS_AGG_MODES, Normalization
from .rules import Rule, at_least, check_fields, greater_than, one_of


@dataclass(frozen=True)
class PolicyLossSettings:
    """The clip and aggregation settings every policy loss takes, passed whole.

    The defaults are verl's actor config, and the only defaults of these keys in the package (the
    recipe's config reads them from here); GSPO's paper values are ``loss.gspo.PAPER_SETTINGS``.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (``vanilla``)
    loss_agg_mode: str = "token-mean"

    # Each field's rule, declared once: checked here, and by the recipe's config under its keys.
    FIELD_RULES: ClassVar[dict[str, Rule]] = {
        "clip_ratio_low": at_least(0),
        "clip_ratio_high": at_least(0),
        "clip_ratio_c": greater_than(1),  # vanilla's dual clip caps a negative advantage's loss at -A * c
        "loss_agg_mode": one_of(LOSS_AGG_MODES),
    }

    def __post_init__(self) -> None:
        check_fields(self, self.FIELD_RULES)


class PolicyLossFn(Protocol):
    """Signature every registered policy loss implements.

    ``settings`` holds the clip range and ``settings.loss_agg_mode``; ``norm`` what ``agg_loss``
    normalises by. Returns the scalar loss (already aggregated with ``agg_loss``) and a dict of
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
        settings: PolicyLossSettings,
        norm: Normalization,
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

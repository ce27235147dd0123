"""Per-token KL estimators between the policy and a reference policy (Schulman's k1/k2/k3)."""

from typing import Callable

import torch

# verl's bounds for k3: the log ratio before exp (overflow), the estimate after (one token cannot dominate).
_K3_MAX_ABS_LOG_RATIO = 20.0
_K3_MAX_ABS_KL = 10.0


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # k3 = r - log r - 1 with r = pi_ref / pi: unbiased, non-negative, low variance.
    kl = torch.clamp(-log_ratio, -_K3_MAX_ABS_LOG_RATIO, _K3_MAX_ABS_LOG_RATIO)
    return torch.clamp(torch.exp(kl) - kl - 1, -_K3_MAX_ABS_KL, _K3_MAX_ABS_KL)


_KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "kl": _k1,
    "k1": _k1,
    "abs": _abs,
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": _k3,
    "k3": _k3,
}
KL_PENALTY_TYPES: tuple[str, ...] = tuple(_KL_ESTIMATORS)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate of type ``kl_type`` (see KL_PENALTY_TYPES).

    ``k1``/``kl``: log_prob - ref; ``abs``: |log_prob - ref|; ``k2``/``mse``:
    0.5 * (log_prob - ref)^2; ``k3``/``low_var_kl``: exp(ref - logp) - (ref - logp) - 1
    with the log ratio clamped to [-20, 20] and the result to [-10, 10].
    """
    try:
        estimator = _KL_ESTIMATORS[kl_type]
    except KeyError:
        raise ValueError(f"unknown kl_type {kl_type!r}; valid types: {', '.join(KL_PENALTY_TYPES)}") from None
    return estimator(log_prob - ref_log_prob)

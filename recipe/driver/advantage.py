"""GRPO outcome advantages: each response's score against the other responses to the same prompt;
and what shapes the scores first: verl's KL penalty in the reward and DAPO's group filter.

As verl's ``compute_grpo_outcome_advantage``: A_i = (r_i - mean_g) / (std_g + epsilon) with the
unbiased std of the group g (or r_i - mean_g without std normalisation), broadcast over the
response tokens. One deliberate difference: a group whose scores are all equal, including a
group of one, gets exactly 0 (verl gives a singleton r_i / (1 + epsilon)): it carries no
preference between responses, and its mean need not round to exactly the common value.
"""

from __future__ import annotations

import torch

from loss import kl_penalty


def _check_inputs(scores: torch.Tensor, group_ids: torch.Tensor) -> None:
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must be 1-D and the same "
            "length: one score and one prompt (group) id per response"
        )
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor (the prompt each response answers), got {group_ids.dtype}")
    if not torch.isfinite(scores).all():
        bad = torch.nonzero(~torch.isfinite(scores))[0].item()
        raise ValueError(f"scores[{bad}] is {scores[bad].item()}; every score must be finite")


def _group_reduce(values: torch.Tensor, group: torch.Tensor, groups: int, reduce: str) -> torch.Tensor:
    out = torch.zeros(groups, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, group, values, reduce, include_self=False)


def grpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, epsilon: float = 1e-6
) -> torch.Tensor:
    """Per-response advantages [N] (float32) from scores [N] and the prompt id of each response [N]."""
    _check_inputs(scores, group_ids)
    scores = scores.double()  # float64 statistics; the result is float32 like verl's
    _, group, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    groups = counts.numel()
    mean = _group_reduce(scores, group, groups, "sum") / counts
    centered = scores - mean[group]
    if norm_by_std:
        # unbiased, as torch.std; a singleton's 0/0 is replaced below, as all-equal groups are
        variance = _group_reduce(centered.square(), group, groups, "sum") / (counts - 1).clamp(min=1)
        centered = centered / (variance.sqrt()[group] + epsilon)
    all_equal = _group_reduce(scores, group, groups, "amax") == _group_reduce(scores, group, groups, "amin")
    return torch.where(all_equal[group], 0.0, centered).float()


def token_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each response's advantage on each of its tokens [B, R] (float32), 0 where the mask is unset."""
    if advantages.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be [B] and response_mask {tuple(response_mask.shape)} "
            "[B, R] with the same B (one advantage per response)"
        )
    return torch.where(response_mask.bool(), advantages.float().unsqueeze(-1), 0.0)


class KLController:
    """verl's ``algorithm.kl_ctrl``: the coefficient beta of the KL penalty in the reward.

    ``fixed``: beta = ``kl_coef`` throughout. ``adaptive`` (Ziegler et al. 2019, arXiv 1909.08593,
    as verl's ``AdaptiveKLController``): after each step with mean KL ``kl`` over ``n`` trajectories,
    beta *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) * n / horizon.
    """

    def __init__(self, kind: str, kl_coef: float, target_kl: float, horizon: int):
        if kind not in ("fixed", "adaptive"):
            raise ValueError(f"KL controller {kind!r}: use fixed or adaptive")
        self.kind, self.value, self.target_kl, self.horizon = kind, kl_coef, target_kl, horizon

    def update(self, kl: float, n: int) -> None:
        if self.kind == "adaptive":
            error = min(max(kl / self.target_kl - 1, -0.2), 0.2)
            self.value *= 1 + error * n / self.horizon


def kl_in_reward(scores: torch.Tensor, log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                 response_mask: torch.Tensor, controller: KLController, kl_type: str) -> tuple[torch.Tensor, dict]:
    """verl's ``apply_kl_penalty`` on sequence scores [N]: each response's reward is its score minus
    beta times the summed per-token KL to the reference (``kl_type``, ``loss.kl_penalty``'s names);
    beta is the controller's value before this step, which then updates with the batch's mean
    per-sequence KL. Returns the rewards [N] and verl's ``actor/reward_kl_penalty`` (that mean) and
    ``actor/reward_kl_penalty_coeff`` (beta)."""
    mask = response_mask.bool()
    kld = torch.where(mask, kl_penalty(torch.where(mask, log_probs, 0.0), torch.where(mask, ref_log_probs, 0.0),
                                       kl_type), 0.0).double()
    beta = controller.value
    per_sequence = kld.sum(-1) / mask.sum(-1).clamp(min=1)
    current = float(per_sequence.mean())
    controller.update(current, len(scores))
    rewards = (scores.double() - beta * kld.sum(-1)).float()
    return rewards, {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta}


def varying_groups(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic-sampling filter (verl's ``filter_groups``): per group id in ``group_ids``
    (ascending), whether its ``values`` differ (standard deviation > 0) or it has a single sample."""
    _check_inputs(values, group_ids)
    ids, group = torch.unique(group_ids, return_inverse=True)
    values = values.double()
    spread = _group_reduce(values, group, len(ids), "amax") > _group_reduce(values, group, len(ids), "amin")
    single = torch.bincount(group, minlength=len(ids)) == 1
    return spread | single


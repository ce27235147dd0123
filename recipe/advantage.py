"""GRPO outcome advantages: each response's score against the other responses to the same prompt.

As verl's ``compute_grpo_outcome_advantage``: A_i = (r_i - mean_g) / (std_g + epsilon) with the
unbiased std of the group g (or r_i - mean_g without std normalisation), broadcast over the
response tokens. One deliberate difference: a group whose scores are all equal, including a
group of one, gets exactly 0 (verl gives a singleton r_i / (1 + epsilon)): it carries no
preference between responses, and its mean need not round to exactly the common value.
"""

from __future__ import annotations

import torch


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

"""Masked reductions that turn a per-token loss matrix into one scalar.

Mode names follow verl (``verl/trainer/ppo/core_algos.py::agg_loss``) so that
numbers carry over between the two code bases.
"""

from dataclasses import dataclass

import torch

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# A count may arrive as a Python number (from config/bookkeeping) or as a tensor
# (e.g. the result of an all-reduce); both divide the same way.
Count = int | float | torch.Tensor


@dataclass(frozen=True)
class Normalization:
    """What a loss over one call's rows is normalised by, so that the calls of a micro-batched,
    data-parallel mini-batch add up to the whole mini-batch's loss (see ``agg_loss``). The
    defaults say: this call is the whole batch."""

    dp_size: int = 1
    batch_num_tokens: Count | None = None  # valid tokens in the whole mini-batch (all ranks)
    global_batch_size: Count | None = None  # rows with a valid token in the whole mini-batch


def _at_least_one(count: Count) -> Count:
    # An empty (fully masked) batch must give 0, not 0/0 = NaN.
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is set; 0 when none is."""
    mask = mask.bool()
    # torch.where rather than values * mask: 0 * inf would be NaN.
    return torch.where(mask, values, 0.0).sum() / _at_least_one(mask.sum())


def masked_row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row (last dim) masked mean; rows without a valid token give 0."""
    mask = mask.bool()
    return torch.where(mask, values, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Count | None = None,
    global_batch_size: Count | None = None,
) -> torch.Tensor:
    """Aggregate a (batch, response_len) loss matrix into a scalar.

    Modes (``mask`` is ``loss_mask`` as 0/1; every result is multiplied by
    ``dp_size`` because DDP *averages* gradients over data-parallel ranks):

    - ``token-mean``: sum(loss * mask) / batch_num_tokens.
      ``batch_num_tokens`` defaults to this call's mask.sum().
    - ``token-sum``: sum(loss * mask).
    - ``seq-mean-token-sum``: sum over rows of the row's token sum / global_batch_size.
    - ``seq-mean-token-mean``: sum over rows of the row's token mean / global_batch_size.
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): sum over rows of the row's token
      sum / horizon, / global_batch_size, with horizon = loss_mask.shape[-1].
      The horizon must be a constant, so every micro-batch has to be padded to
      the same response length.

    ``global_batch_size`` defaults to this call's number of rows with at least
    one valid token; rows without one contribute nothing to any mode.

    Sharding contract: if every micro-batch of every DP rank is called with the
    same ``dp_size`` and the *global* ``batch_num_tokens`` (valid tokens of the
    whole mini-batch) / ``global_batch_size`` (non-empty rows of the whole
    mini-batch), then summing each rank's micro-batch losses and averaging over
    ranks -- equivalently, summing ``loss / dp_size`` over all shards -- equals
    this function on the whole mini-batch with ``dp_size=1``; so do the
    gradients. With the local defaults this only holds for equal shards.

    A fully masked input gives 0.0. Masked entries of ``loss_mat`` are never
    read, so padding may hold any value, inf/NaN included.
    """
    mask = loss_mask.bool()

    if loss_agg_mode in ("token-mean", "token-sum"):
        total = torch.where(mask, loss_mat, 0.0).sum()
        if loss_agg_mode == "token-mean":
            total = total / _at_least_one(mask.sum() if batch_num_tokens is None else batch_num_tokens)
        return total * dp_size

    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = masked_row_mean(loss_mat, mask)
    elif loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.where(mask, loss_mat, 0.0).sum(-1)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            seq_losses = seq_losses / loss_mask.shape[-1]
    else:  # configs check the mode when they are read; a direct call with a wrong one ends here
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    # Empty rows already hold exactly 0 above; they only need leaving out of the count.
    if global_batch_size is None:
        global_batch_size = mask.any(-1).sum()
    return seq_losses.sum() / _at_least_one(global_batch_size) * dp_size

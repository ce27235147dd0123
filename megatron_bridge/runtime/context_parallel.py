"""Context parallelism (CP): each rank of a CP group holds a slice of every sequence.

The split is megatron's load-balanced one (``megatron.core.utils.get_batch_on_this_cp_rank``, and
Transformer Engine's for packed sequences): a sequence is cut into 2 x CP equal chunks and CP rank r
holds chunks r and 2 CP - 1 - r, so that under causal attention every rank has as many early
(cheap) as late (expensive) queries. Packed micro-batches (``thd``) split each of their sequences
that way, every sequence padded to a multiple of 2 x CP; megatron's rotary embedding takes the
same layout (``rope_utils._apply_rotary_pos_emb_thd``, ``get_pos_emb_on_this_cp_rank``).

The actor keeps every micro-batch whole on every CP rank and hands the model only ``held`` positions;
labels are read from the whole sequence at the global position after each held one, so they are
shifted before the split, never after. Two collectives carry everything else:

- ``gather_sequence``: the attention's K and V from every CP rank, in sequence order (forward an
  all-gather; backward the sum of every rank's gradient at this rank's positions: a reduce-scatter,
  or an all-reduce where the backend has none, gloo);
- ``loss.vocab_parallel.sum_over_context_parallel``: per-row values (log-probs, entropies) that
  each rank filled at its own tokens, added up so that every CP rank holds the whole rows and
  computes every sequence-level quantity (GSPO's ratio, per-sequence means) and the same loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_bridge.plan.layout import TrainParallel


def cp_size_rank() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()


def ulysses_degree(train: TrainParallel) -> int:
    """How many of the CP ranks split each ring rank's share contiguously (MindSpeed's algorithms,
    ``megatron_bridge.runtime.mindspeed``): 1 for megatron's ring (and this package's all-gather),
    CP for Ulysses, ``ulysses_degree_in_cp`` for the hybrid."""
    if train.cp_algo == "ulysses_cp_algo":
        return train.cp
    if train.cp_algo == "hybrid_cp_algo":
        return train.ulysses_degree_in_cp or 1
    return 1


def held(seq_len: int, cu_seqlens: torch.Tensor | None = None, cp: int | None = None,
         rank: int | None = None, device: torch.device | None = None, ulysses: int = 1) -> torch.Tensor:
    """[seq_len / CP] long: the positions on the (packed) sequence axis that CP rank ``rank`` holds,
    in the order it holds them (default: this rank of megatron's CP group). ``cu_seqlens``: the
    boundaries of a packed sequence's parts, each split on its own. ``ulysses`` (``ulysses_degree``):
    MindSpeed's split, the load-balanced one over CP / ``ulysses`` ring ranks (rank // ulysses),
    each ring rank's share then cut in ``ulysses`` contiguous parts (rank % ulysses).

    Computed from the boundaries where they are, without reading them: the layers call this with
    the micro-batch's boundaries on the device, where a read would make the host wait in every
    layer. That each part splits evenly is checked where they are on the host (the actor cuts its
    micro-batches there)."""
    if cp is None or rank is None:
        cp, rank = cp_size_rank()
    if device is None:
        device = cu_seqlens.device if cu_seqlens is not None else torch.device("cpu")
    if cp == 1:
        return torch.arange(seq_len, device=device)
    ring, ring_rank, part = cp // ulysses, rank // ulysses, rank % ulysses
    chunks = 2 * ring if ring > 1 else 1
    if cu_seqlens is None:  # made where they are used: a copy up would wait for the device too
        starts = torch.zeros(1, dtype=torch.long, device=device)
        lengths = torch.full((1,), seq_len, dtype=torch.long, device=device)
        on_host = [seq_len]
    else:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        on_host = lengths.tolist() if cu_seqlens.device.type == "cpu" else []
        starts, lengths = cu_seqlens[:-1].to(device), lengths.to(device)
    uneven = [n for n in on_host if n % (chunks * ulysses)]
    if uneven:
        raise ValueError(f"context parallel: a sequence of {uneven[0]} tokens does not split into "
                         f"{chunks * ulysses} equal chunks for CP = {cp} (the actor pads every sequence to a "
                         f"multiple of {chunks * ulysses})")
    # The ring rank holds chunks ring_rank and chunks - 1 - ring_rank of every part (the whole part
    # without a ring), this rank the part-th of ulysses contiguous cuts of that: lengths / CP tokens
    # of each part, the parts in order.
    chunk, mine = lengths // chunks, lengths // cp
    first_mine = torch.cumsum(mine, 0) - mine
    index = torch.arange(seq_len // cp, device=device)
    # which part each of this rank's tokens is in (an empty part starts where the next one does)
    of = torch.searchsorted(first_mine, index, right=True) - 1
    in_share = part * mine[of] + index - first_mine[of]  # its place in the ring rank's two chunks
    later = in_share >= chunk[of]
    which = torch.where(later, chunks - 1 - ring_rank, ring_rank)
    return starts[of] + which * chunk[of] + torch.where(later, in_share - chunk[of], in_share)


def _group():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, positions: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        group = _group()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.save_for_backward(positions, order)
        return torch.cat(parts)[order]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        positions, order = ctx.saved_tensors
        group = _group()
        if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter
            grad = grad.contiguous()
            dist.all_reduce(grad, group=group)
            return grad[positions], None, None
        by_rank = torch.empty_like(grad)
        by_rank[order] = grad  # back to the ranks' order: rank r's positions are the r-th block
        out = grad.new_empty((len(positions), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, by_rank.contiguous(), group=group)
        return out, None, None


def gather_sequence(local: torch.Tensor, seq_len: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """[seq_len / CP, ...] this rank's positions (dim 0) -> [seq_len, ...] in sequence order, from
    every CP rank; differentiable."""
    cp, rank = cp_size_rank()
    every = torch.cat([held(seq_len, cu_seqlens, cp, r, local.device) for r in range(cp)])
    order = torch.empty_like(every)
    order[every] = torch.arange(seq_len, device=local.device)  # sequence position -> index in the gather
    return _GatherSequence.apply(local, every.view(cp, -1)[rank], order)  # each rank holds seq_len / CP

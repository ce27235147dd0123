"""Per-token log-probs and entropy from tensor-parallel vocabulary shards, chunk by chunk, without
gathering the vocabulary and without a float32 copy of the whole logits.

``logits`` is always this rank's slice [..., V/tp] of megatron's current tensor-parallel group
(rank r holds vocabulary ids [r * V/tp, (r+1) * V/tp), as ``ColumnParallelLinear`` lays them out).
Results are float32 and identical on every rank of the group.

Memory. The logits arrive in the model's dtype (bf16 on accelerators: the actor builds its
GPTModel in bf16 without megatron's Float16Module, which would cast the last stage's output to
float32) and are the largest tensor of the step ([tokens, V/tp]: 4.6 GiB of bf16 for 16k tokens of
Qwen3's 151,936-token vocabulary at TP1). Only a chunk of rows is ever
held in float32: forward saves the logits and per-token statistics (the log-sum-exp and the
entropy), backward recomputes each chunk from them. A chunk of n rows costs 6 n V/tp bytes at its
peak (its float32 copy plus the bf16 gather it is cast from, or the bf16 gradient it is cast to;
float32 logits need neither: 4-5 bytes), and ``chunk_rows`` caps n at ceil(M / 16) of the M rows of
logits: the extra peak is 3 ceil(M / 16) / M of the bf16 logits — 3/16 for M a multiple of 16, at
most 1x from 4 rows up — and less once the token cap ``DEFAULT_CHUNK_SIZE`` binds (M > 16k). The
gradient may be written into the logits' own storage (``reuse_logits``), so backward needs no second
logits-sized buffer either (bench/log_prob_memory.py measures all of this).

Fused (``fused=True``, verl's ``use_fused_kernels``): the same arithmetic per chunk, but each pass
over a chunk's logits is one kernel that ``torch.compile`` generates (the max; the sums; in backward
the gradient, written in the logits' dtype), reading the logits' rows where they lie: no float32
chunk is ever held, and the logits are read 2 (forward) and 1 (backward) times instead of the
eager passes' ~10 reads and writes of float32. Needs a ``torch.compile`` backend (CUDA, CPU).

megatron is imported inside the functions, not at module import: on Ascend, MindSpeed must patch
megatron before anything imports it, and importing this module must not get in first.
"""

import functools
import math

import torch
import torch.distributed as dist

# Tokens per chunk: 1024 rows of a 151,936-token vocabulary are 0.6 GiB of float32, big enough
# for full-speed kernels, small beside the 4.6 GiB of bf16 logits of a 16k-token micro-batch.
DEFAULT_CHUNK_SIZE = 1024
# No chunk holds more than this share of the logits' rows, so short micro-batches stay under the
# memory bound too (a chunk's peak is 3x its rows of bf16 logits: 3/16 of the logits).
CHUNKS_AT_LEAST = 16


def chunk_rows(tokens: int, logits_rows: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """Rows per chunk for ``tokens`` scored tokens out of ``logits_rows`` rows of logits:
    ``chunk_size`` tokens, but at most 1/16 of the rows (rounded up); ``chunk_size`` 0 means one
    chunk of every token (no chunking, for comparisons)."""
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0: one chunk), got {chunk_size}")
    if chunk_size == 0:
        return max(tokens, 1)
    return max(1, min(chunk_size, math.ceil(logits_rows / CHUNKS_AT_LEAST)))


def _tp_group_rank_size() -> tuple[dist.ProcessGroup, int, int]:
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    if size > 1:  # a one-rank group has nothing to combine
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _scaled_rows(logits: torch.Tensor, rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 ``logits[rows] / temperature`` in fresh memory (``index_select`` copies; ``.float()``
    of a float32 copy is that copy), which the caller may overwrite."""
    return _scaled(logits.index_select(0, rows), temperature)


def _scaled(gathered: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 ``gathered / temperature``, dividing in place: ``gathered`` is a fresh gather of rows."""
    z = gathered.float()
    return z.div_(temperature) if temperature != 1.0 else z


def _chunk_max(logits, rows, temperature: float):
    return _scaled(logits[rows], temperature).amax(dim=-1)


def _chunk_sums(logits, rows, temperature: float, z_max, local, mine, with_entropy: bool):
    """[sum e, z(target) - m, (sum e (z - m))] of e = exp(z - m), as the eager forward's."""
    z = _scaled(logits[rows], temperature) - z_max.unsqueeze(-1)
    e = z.exp()
    sums = [e.sum(dim=-1), torch.where(mine, z.gather(1, local.unsqueeze(-1)).squeeze(-1), 0.0)]
    if with_entropy:
        sums.append((e * z).sum(dim=-1))
    return torch.stack(sums)


def _chunk_grad(logits, rows, temperature: float, lse, a, entropy, b, local, mine):
    """The chunk's gradient in the logits' dtype, as the eager backward's: -a p, or with the
    entropy's term -p (b (log p + H) + a); + a at the target."""
    log_p = _scaled(logits[rows], temperature) - lse.unsqueeze(-1)
    if b is None:
        g = log_p.exp() * -a
    else:
        inner = (log_p + entropy.unsqueeze(-1)) * b
        g = (inner if a is None else inner + a) * -log_p.exp()
    if a is not None:
        columns = torch.arange(logits.shape[-1], device=logits.device)
        g = torch.where((columns == local.unsqueeze(-1)) & mine.unsqueeze(-1), g + a, g)
    return g.to(logits.dtype)


@functools.cache
def _compiled(kernel):
    """``kernel`` compiled once per process, for any number of rows (dynamic shapes)."""
    return torch.compile(kernel, dynamic=True)


class _LogProbsAndEntropy(torch.autograd.Function):
    """log p(target) and H = -sum_v p_v log p_v of p = softmax(logits / T) over all TP shards, for
    the rows ``positions`` of ``logits`` [M, V/tp].

    Forward, per chunk of rows, on its float32 copy z = logits / T: a MAX all-reduce of the per-shard
    max m (z - m changes neither p nor H), e = exp(z - m) in place, then one SUM all-reduce of
    [sum e, z(target) - m, sum e log e] (the target's shard contributes its logit, the others 0; e
    log e in place as xlogy(e, e)). With S = sum e: log p(target) = z(target) - m - log S and
    H = log S - sum e (z - m) / S. Saved: the logits, the rows and targets, lse = m + log S and H.

    Backward needs no communication: with log p = z - lse, d log p(target) / dz = onehot - p and
    dH/dz = -p (log p + H); both through z = logits / T divide by T. Each chunk is recomputed from
    the saved logits; the entropy's term is computed only when H's gradient is not None.
    """

    @staticmethod
    def forward(ctx, logits, positions, targets, temperature, with_entropy, chunk, reuse_logits, fused):
        group, rank, size = _tp_group_rank_size()
        vocab_start, local_vocab = rank * logits.shape[-1], logits.shape[-1]
        tokens = positions.numel()
        log_probs = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if with_entropy else None
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            rows = positions[start:end]
            local, mine = _local_targets(targets[start:end], vocab_start, local_vocab)
            if fused:
                z_max = _all_reduce(_compiled(_chunk_max)(logits, rows, temperature), dist.ReduceOp.MAX, group, size)
                sums = _compiled(_chunk_sums)(logits, rows, temperature, z_max, local, mine, with_entropy)
            else:
                sums, z_max = _eager_chunk_sums(logits, rows, temperature, local, mine, with_entropy, group, size)
            sums = _all_reduce(sums, dist.ReduceOp.SUM, group, size)
            log_sum_exp = sums[0].log()
            log_probs[start:end] = sums[1] - log_sum_exp
            lse[start:end] = z_max + log_sum_exp
            if with_entropy:
                entropy[start:end] = log_sum_exp - sums[2] / sums[0]

        ctx.set_materialize_grads(False)  # an output nobody differentiates arrives as None
        ctx.save_for_backward(logits, positions, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.reuse_logits, ctx.fused = temperature, chunk, reuse_logits, fused
        ctx.vocab = (vocab_start, local_vocab)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, positions, targets, lse, entropy = ctx.saved_tensors
        if grad_log_probs is None and grad_entropy is None:
            return (None,) * 8
        if ctx.reuse_logits:
            # The logits are ours (see vocab_parallel_log_probs_and_entropy): rows nobody scored get a
            # zero gradient, each scored row is read before its gradient overwrites it, and rows
            # are distinct, so no row is read after it was written.
            scored = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
            scored[positions] = True
            grad = logits.masked_fill_(~scored.unsqueeze(-1), 0.0)
            del scored
        else:
            grad = torch.zeros_like(logits)
        vocab_start, local_vocab = ctx.vocab
        inv_t = 1.0 / ctx.temperature
        for start in range(0, positions.numel(), ctx.chunk):
            end = min(start + ctx.chunk, positions.numel())
            rows = positions[start:end]
            # a = dL/dlog p(target) / T, b = dL/dH / T, per token
            a = None if grad_log_probs is None else (grad_log_probs[start:end] * inv_t).unsqueeze(-1)
            b = None if grad_entropy is None else (grad_entropy[start:end] * inv_t).unsqueeze(-1)
            h = None if b is None else entropy[start:end]
            local, mine = _local_targets(targets[start:end], vocab_start, local_vocab)
            if ctx.fused:
                g = _compiled(_chunk_grad)(logits, rows, ctx.temperature, lse[start:end], a, h, b, local, mine)
            else:
                g = _scaled_rows(logits, rows, ctx.temperature).sub_(lse[start:end].unsqueeze(-1))  # log p
                if b is None:
                    g.exp_().mul_(-a)  # -a p
                else:
                    _entropy_term_(g, h, b, a)
                if a is not None:  # + a at the target, on the shard that holds it
                    g.scatter_add_(1, local.unsqueeze(-1), torch.where(mine.unsqueeze(-1), a, 0.0))
            grad.index_copy_(0, rows, g.to(grad.dtype))
            del g
        return grad, None, None, None, None, None, None, None


def _eager_chunk_sums(logits, rows, temperature, local, mine, with_entropy, group, size):
    """The forward's per-chunk sums (before their SUM all-reduce) and the max, pass by pass on a
    float32 copy of the chunk."""
    z = _scaled_rows(logits, rows, temperature)
    z_max = _all_reduce(z.amax(dim=-1), dist.ReduceOp.MAX, group, size)
    z.sub_(z_max.unsqueeze(-1))
    z_target = torch.where(mine, z.gather(1, local.unsqueeze(-1)).squeeze(-1), 0.0)
    exp = z.exp_()  # z is not needed any more: e log e = xlogy(e, e) recovers it
    sums = [exp.sum(dim=-1), z_target]
    if with_entropy:
        sums.append(torch.xlogy(exp, exp, out=exp).sum(dim=-1))
    return torch.stack(sums), z_max


def _entropy_term_(log_p: torch.Tensor, entropy: torch.Tensor, b: torch.Tensor, a: torch.Tensor | None) -> None:
    """log p becomes -p (b (log p + H) + a) in place (a, b per token, [n, 1]). It needs p beside
    log p: p is made a quarter of the columns at a time, so the second float32 buffer is a quarter
    of the chunk."""
    h = entropy.unsqueeze(-1)
    for cols in log_p.split(-(-log_p.shape[-1] // 4), dim=-1):
        minus_p = cols.exp().neg_()
        cols.add_(h).mul_(b)
        if a is not None:
            cols.add_(a)
        cols.mul_(minus_p)
        del minus_p  # before the next block's is made


def _local_targets(targets: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids as columns of this shard (clamped into it) and whether this shard holds them."""
    local = targets - vocab_start
    mine = (local >= 0) & (local < local_vocab)
    return local.clamp_(0, local_vocab - 1), mine


def _held_by_caller(tensor: torch.Tensor) -> bool:
    # A leaf (or a view of one: ``_base`` is the viewed tensor) is where the caller keeps its data
    # and its .grad.
    return tensor.is_leaf or (tensor._base is not None and tensor._base.is_leaf)


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    reuse_logits: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 log softmax(logits / T)[target] and, if ``with_entropy``, the entropy of
    softmax(logits / T), over the full vocabulary, for the rows ``positions`` of ``logits``;
    differentiable in ``logits``.

    ``logits`` [M, V/tp] is this rank's vocabulary shard (any float dtype); ``positions`` [N] long
    are distinct rows of it and ``targets`` [N] the global token ids scored there. Returns
    ([N], [N] or None). Rows are processed ``chunk_rows(N, M, chunk_size)`` at a time.

    The gradient is zero outside ``positions``, and the entropy's part is only computed when the
    entropy is differentiated. ``reuse_logits=True`` hands ``logits`` over to this function:
    backward writes the gradient into their storage and returns it, so that no second
    logits-sized buffer exists. Only pass it for logits that nothing reads after backward — a
    model's output passed straight in, which only the autograd graph holds (a second backward, or
    another autograd node that saved them, then fails autograd's in-place check instead of reading
    the gradient). A leaf, or a view of one, is the caller's own and is never overwritten.
    ``fused``: each chunk's passes as kernels ``torch.compile`` generates (the module's docstring).
    """
    if logits.dim() != 2 or positions.dim() != 1 or positions.shape != targets.shape:
        raise ValueError(
            f"expected logits [M, V/tp], positions [N], targets [N]; got "
            f"{tuple(logits.shape)}, {tuple(positions.shape)}, {tuple(targets.shape)}"
        )
    if positions.numel():
        ordered = positions.sort().values
        if bool((ordered[0] < 0) | (ordered[-1] >= logits.shape[0]) | (ordered.diff() == 0).any()):
            raise ValueError(f"positions must be distinct rows of the {logits.shape[0]} rows of logits")
    return log_probs_and_entropy(logits, positions, targets, temperature, with_entropy, chunk_size, reuse_logits,
                                 fused)


def log_probs_and_entropy(logits: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor, temperature: float,
                          with_entropy: bool, chunk_size: int, reuse_logits: bool,
                          fused: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``vocab_parallel_log_probs_and_entropy`` without its check of ``positions``, which reads
    them back from the device: for callers whose positions are distinct rows by construction."""
    chunk = chunk_rows(positions.numel(), logits.shape[0], chunk_size)
    reuse = reuse_logits and logits.requires_grad and not _held_by_caller(logits)
    return _LogProbsAndEntropy.apply(logits, positions, targets, temperature, with_entropy, chunk, reuse, fused)


class _SumOverContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, group) -> torch.Tensor:
        values = values.clone()
        dist.all_reduce(values, group=group)
        return values

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_context_parallel(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over megatron's context-parallel group, where each CP rank filled the
    tokens it holds (zeros elsewhere): every CP rank then holds the whole rows. The gradient
    passes through unchanged: every CP rank computes the same loss from the same whole rows, and
    each rank's gradient reaches only the logits of its own tokens (megatron's schedule multiplies
    the loss by CP, its DDP divides by DP x CP). Without CP, ``values`` as they are."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() <= 1:
        return values
    return _SumOverContextParallel.apply(values, parallel_state.get_context_parallel_group())

"""Per-token log-probs and entropy from tensor-parallel vocabulary shards, without gathering the vocabulary.

``logits`` is always this rank's slice [..., V/tp] of megatron's current tensor-parallel group
(rank r holds vocabulary ids [r * V/tp, (r+1) * V/tp), as ``ColumnParallelLinear`` lays them out).
Results are float32 and identical on every rank of the group.

megatron is imported inside the functions, not at module import: on Ascend, MindSpeed must patch
megatron before anything imports it, and importing this module must not get in first.
"""

import torch
import torch.distributed as dist


def _tp_group_and_size() -> tuple[dist.ProcessGroup, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_world_size()


def _scaled_fp32_copy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A contiguous float32 ``logits / temperature`` in fresh memory that in-place ops may overwrite.

    ``copy=True`` matters: for float32 input ``.float()`` returns the caller's tensor itself, and
    megatron's cross entropy subtracts the max from its input in place.
    """
    scaled = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    # In place on our own copy: one vocabulary-sized buffer instead of two.
    return scaled.div_(temperature) if temperature != 1.0 else scaled


def vocab_parallel_log_probs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 log softmax(logits / temperature)[target] over the full vocabulary; differentiable.

    ``logits`` [..., V/tp] is this rank's vocabulary shard (any float dtype), ``target`` [...] holds
    global token ids. Uses megatron's ``vocab_parallel_cross_entropy``; the caller's ``logits`` are
    never modified.
    """
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(_scaled_fp32_copy(logits, temperature), target)


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    if size > 1:  # a one-rank group has nothing to combine
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelEntropy(torch.autograd.Function):
    """H = log S - E_p[z] with z = logits / T, S = sum_v exp(z_v), p = exp(z) / S, over all TP shards.

    Forward: MAX all-reduce of the per-shard max (z is shifted by it, which changes neither H nor
    p), then one SUM all-reduce of [sum exp(z), sum exp(z) * z].
    Backward needs no communication: dH/dz_i = -p_i (z_i - E_p[z]) involves only the local z_i and
    the two reduced statistics; the chain rule through z = logits / T divides by T.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        group, size = _tp_group_and_size()
        shifted = _scaled_fp32_copy(logits, temperature)
        z_max = _all_reduce(shifted.amax(dim=-1), dist.ReduceOp.MAX, group, size)
        shifted.sub_(z_max.unsqueeze(-1))

        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), exp.mul_(shifted).sum(dim=-1)])
        del exp
        sum_exp, sum_exp_z = _all_reduce(sums, dist.ReduceOp.SUM, group, size).unbind(0)
        log_sum_exp = sum_exp.log()
        mean_z = sum_exp_z / sum_exp  # E_p[z] of the shifted z

        ctx.save_for_backward(shifted, log_sum_exp, mean_z)
        ctx.temperature, ctx.input_dtype = temperature, logits.dtype
        return log_sum_exp - mean_z

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor) -> tuple[torch.Tensor, None]:
        shifted, log_sum_exp, mean_z = ctx.saved_tensors
        probs = (shifted - log_sum_exp.unsqueeze(-1)).exp_()
        grad = (shifted - mean_z.unsqueeze(-1)).mul_(probs)
        del probs
        grad.mul_((grad_entropy / -ctx.temperature).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None


def vocab_parallel_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 entropy of softmax(logits / temperature) over the full vocabulary; differentiable.

    ``logits`` [..., V/tp] is this rank's vocabulary shard; returns [...]. Works for TP = 1 too.
    """
    return _VocabParallelEntropy.apply(logits, temperature)

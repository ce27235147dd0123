"""Core attention for megatron's local layer spec on ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core 0.12.1's local ``DotProductAttention`` materialises every head's [s, s] scores and
probabilities (quadratic memory: 16.4 GiB for one 8k-token layer of Qwen3-30B-A3B, docs/kernels.md),
and repeats K/V for grouped-query attention. SDPA dispatches to a fused kernel whose memory is
linear in the sequence length: flash or memory-efficient attention on CUDA, the CPU's own flash
kernel on the CPU; K/V heads stay grouped (``enable_gqa``).

Same inputs and output as ``DotProductAttention`` (``[s, b, heads, head_dim]`` in, ``[s, b,
heads x head_dim]`` out), causal, with the actor's padding convention: sequences are right-padded,
so a causal mask alone keeps every real token from seeing padding. Packed micro-batches (``thd``,
``PackedSeqParams`` with ``cu_seqlens``) attend within each sequence.

With context parallel (CP > 1) each rank holds megatron's load-balanced chunks r and 2 CP - 1 - r of
every sequence (``megatron_bridge.runtime.context_parallel``). K and V are all-gathered over the CP
group, and each local chunk of queries attends to the keys up to its own end (the causal mask
aligned at the bottom right, never materialised: ``_attend_to_prefix``); backward sums the K/V
gradients back to their ranks. Packed micro-batches go one sequence at a time. All-gather
rather than a ring: K/V are the small side under grouped-query attention (Qwen3-30B-A3B: 4 K/V
heads to 32 query heads, so a whole sequence's K/V is 1/4 of the local queries' size at CP 2), it
is one collective per layer that any backend has (gloo included), and the result is exact
attention, not a merge of partial softmaxes; the price is each rank holding one layer's whole K/V
while it attends, where a ring holds 2 x 1/CP of it.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from torch.nn.attention.bias import causal_lower_right

from megatron_bridge.runtime import context_parallel
from megatron_bridge.runtime.batch import packed_places


class SDPAttention(MegatronModule):
    """Causal self-attention through SDPA, a drop-in for megatron's ``DotProductAttention``."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention is causal self-attention; got attn_mask_type={attn_mask_type}")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp = config.context_parallel_size
        if self.cp > 1 and self.dropout:
            raise ValueError(f"SDPAttention with context_parallel_size={self.cp} has no attention dropout "
                             f"(attention_dropout={self.dropout}); the actor builds the model without it")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                attn_mask_type: AttnMaskType | None = None, attention_bias=None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        if packed_seq_params is not None:
            if self.cp > 1:
                return self._packed_context_parallel(query, key, value, packed_seq_params)
            return self._packed(query, key, value, packed_seq_params)
        s, b = query.shape[:2]
        if self.cp > 1:
            return self._context_parallel(query, key, value).reshape(s, b, -1)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._attend(q, k, v)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=self.heads != self.groups)

    def _context_parallel(self, query, key, value) -> torch.Tensor:
        """[s/CP, b, n, d] of this rank's two chunks: each attends to the whole sequence's keys up to
        its own end."""
        local = query.shape[0]
        seq_len, chunk = local * self.cp, local // 2
        key, value = (context_parallel.gather_sequence(t, seq_len) for t in (key, value))
        outs = []
        for part, start in enumerate(context_parallel.held(seq_len)[::chunk].tolist()):
            q = query[part * chunk:(part + 1) * chunk].permute(1, 2, 0, 3)
            k, v = (t[: start + chunk].permute(1, 2, 0, 3) for t in (key, value))
            outs.append(self._attend_to_prefix(q, k, v))
        return torch.cat(outs, dim=2).permute(2, 0, 1, 3)

    def _packed_context_parallel(self, query, key, value, packed: PackedSeqParams) -> torch.Tensor:
        """``thd`` with each sequence split over CP (``cu_seqlens_q``: the whole packed sequence's
        boundaries): each of this rank's chunks attends to its own sequence's keys up to the chunk's
        end, one sequence at a time (CP is for few long sequences). The loop takes the boundaries
        from the host where the actor put them there (``host_bounds``)."""
        bounds = getattr(packed, "host_bounds", None) or packed.cu_seqlens_q.tolist()
        key, value = (context_parallel.gather_sequence(t, query.shape[0] * self.cp, packed.cu_seqlens_q)
                      for t in (key, value))
        outs, row = [], 0
        for first, end in zip(bounds[:-1], bounds[1:]):
            chunk = (end - first) // (2 * self.cp)
            starts = context_parallel.held(end - first)[::chunk].tolist() if chunk else []
            for start in starts:
                q = query[row:row + chunk].permute(1, 0, 2).unsqueeze(0)  # [1, heads, chunk, d]
                k, v = (t[first:first + start + chunk].permute(1, 0, 2).unsqueeze(0) for t in (key, value))
                outs.append(self._attend_to_prefix(q, k, v).squeeze(0).permute(1, 0, 2))
                row += chunk
        return torch.cat(outs).reshape(query.shape[0], 1, -1)

    def _packed(self, query, key, value, packed: PackedSeqParams) -> torch.Tensor:
        """``thd``: [t, n, d] with sequences back to back (``cu_seqlens_q``); each attends to itself.
        On CUDA in 16-bit, torch's variable-length flash attention; elsewhere the sequences padded
        to the longest inside this call, one batched SDPA call (the CPU's kernel costs a fixed
        price per call, which one call per sequence paid for each row)."""
        if packed.qkv_format != "thd":
            raise ValueError(f"SDPAttention packs sequences in the thd format, got {packed.qkv_format!r}")
        bounds = packed.cu_seqlens_q
        lengths = bounds[1:] - bounds[:-1]
        # the actor's micro-batch carries it on the host: reading it off the device in every layer
        # would make the host wait there for the device
        longest = packed.max_seqlen_q if packed.max_seqlen_q is not None else int(lengths.max())
        varlen = _varlen_attention()
        if varlen is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and not (
                self.training and self.dropout):
            out = varlen(query, key, value, bounds, bounds, longest, longest, scale=self.scale,
                         enable_gqa=self.heads != self.groups)
            return out.reshape(query.shape[0], 1, -1)
        span = torch.arange(longest, device=query.device)
        index = (bounds[:-1, None] + span).clamp(max=query.shape[0] - 1)  # [rows, longest]
        # past a row's end sit other rows' tokens; causal attention never lets the row's own see them
        q, k, v = (t[index].permute(0, 2, 1, 3) for t in (query, key, value))  # [rows, heads, longest, d]
        out = self._attend(q, k, v).permute(0, 2, 1, 3).flatten(0, 1)  # [rows * longest, heads, d]
        # the rows' own tokens back to back, by their places in the padded rows (selecting them with
        # a mask would read their number back from the device, in every layer)
        row, position = packed_places(bounds, torch.arange(query.shape[0], device=query.device))
        out = out.index_select(0, row * longest + position)
        return out.reshape(query.shape[0], 1, -1)

    def _attend_to_prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Queries [B, heads, c, d] at the last c of the keys' [B, groups, L, d] positions: each sees
        the keys up to its own. On the CPU two flash-attention calls merged by their log-sum-exp
        (``_PrefixThenCausal``): there torch's bottom-right causal mask is a dense mask of [c, L]
        that every layer would keep. Elsewhere that mask is the flash kernel's own alignment."""
        prefix = k.shape[2] - q.shape[2]
        if prefix == 0:
            return self._attend(q, k, v)
        if q.device.type == "cpu":
            return _PrefixThenCausal.apply(q.contiguous(), k, v, self.scale)
        return self._attend(q, k, v, causal_lower_right(q.shape[2], k.shape[2]))


class _PrefixThenCausal(torch.autograd.Function):
    """CPU attention of queries [B, h, c, d] over keys and values [B, g, P + c, d] whose last c are
    the queries' own positions: all of the first P, causally the last c. Two calls of the CPU flash
    kernel (grouped-query heads as they are) merged by their log-sum-exp, as ring attention merges
    its blocks; backward runs the kernel's backward of each part from the merged output and
    log-sum-exp, so no [c, P + c] tensor is kept, only the inputs, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        prefix = k.shape[2] - q.shape[2]
        # views of the gathered K/V (the kernel takes any strides): saving them keeps no copy
        parts = [k[:, :, :prefix], v[:, :, :prefix], k[:, :, prefix:], v[:, :, prefix:]]
        out_p, lse_p = flash(q, parts[0], parts[1], 0.0, False, scale=scale)
        out_c, lse_c = flash(q, parts[2], parts[3], 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_p, lse_c)
        out = (out_p * (lse_p - lse).exp().unsqueeze(-1) + out_c * (lse_c - lse).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, *parts, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k_p, v_p, k_c, v_c, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq_p, dk_p, dv_p = backward(grad, q, k_p, v_p, out, lse, 0.0, False, scale=ctx.scale)
        dq_c, dk_c, dv_c = backward(grad, q, k_c, v_c, out, lse, 0.0, True, scale=ctx.scale)
        return dq_p + dq_c, torch.cat([dk_p, dk_c], dim=2), torch.cat([dv_p, dv_c], dim=2), None


@functools.cache
def _varlen_attention():
    """torch's variable-length flash attention (``torch.nn.attention.varlen``, CUDA), made causal,
    or None where this torch has none with grouped-query heads. torch 2.10 names causal attention
    ``is_causal=True``, later releases ``window_size=(-1, 0)``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" not in params:
        return None
    return functools.partial(varlen_attn, **({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}))

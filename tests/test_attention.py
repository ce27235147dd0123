"""The SDPA core attention (``megatron_bridge.runtime.attention``) computes what megatron's
``DotProductAttention`` computes, forward and backward, with grouped-query heads, in fp32 and bf16,
and a packed micro-batch (``thd``) gives each sequence what it gets alone, its rotary positions
restarting at each sequence (in one call, with megatron's loop's numbers), without reading its
longest sequence back from the device. The whole model
with either attention is compared in tests/test_actor_update.py (the same update under every
layout) and against transformers in tests/test_actor_parity.py."""

import pytest
import torch

from tests.distributed import run_ranks
from tests.numerics import rounding
from tests.test_host_syncs import OpNames

pytestmark = pytest.mark.numerics

HEADS, GROUPS, HEAD_DIM = 8, 2, 16


def _config(dtype):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, kv_channels=HEAD_DIM, params_dtype=dtype,
                             bf16=dtype == torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0)


def _qkv(seq: int, batch: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(seq, batch, HEADS, HEAD_DIM), (seq, batch, GROUPS, HEAD_DIM), (seq, batch, GROUPS, HEAD_DIM)]
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _run(module, q, k, v, seed: int, **kwargs):
    out = module(q, k, v, None, **kwargs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype))
    return [out.detach().float(), *(t.grad.float() for t in (q, k, v))]


def _compare(rank, world_size, dtype_name):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.runtime.actor import initialize_parallel
    from megatron_bridge.runtime.attention import SDPAttention

    initialize_parallel(TrainParallel())
    dtype = getattr(torch, dtype_name)
    config = _config(dtype)
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    seq, batch = 37, 3
    fused = _run(SDPAttention(**args), *_qkv(seq, batch, dtype, 0), seed=1)
    local = _run(DotProductAttention(**args), *_qkv(seq, batch, dtype, 0), seed=1)
    return {"max_abs": [float(t.abs().max()) for t in local],
            "diff": [float((a - b).abs().max()) for a, b in zip(fused, local)], "seq": seq}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sdpa_equals_megatron_dot_product_attention(tmp_path, dtype):
    (result,) = run_ranks(_compare, 1, tmp_path, dtype)
    # output, dq, dk, dv: each a sum over the sequence (softmax-weighted values) and the head dim
    for name, diff, magnitude in zip(("out", "dq", "dk", "dv"), result["diff"], result["max_abs"]):
        tolerance = rounding(magnitude, result["seq"] + HEAD_DIM, getattr(torch, dtype))
        assert diff <= tolerance, f"{name}: {diff} > {tolerance}"


def _packed(rank, world_size, dtype_name="float32"):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.runtime.actor import initialize_parallel
    from megatron_bridge.runtime.attention import SDPAttention

    initialize_parallel(TrainParallel())
    dtype = getattr(torch, dtype_name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    attention = SDPAttention(_config(dtype), 1, AttnMaskType.causal, "self")
    lengths = [5, 11, 3]
    q, k, v = (t.detach().to(device) for t in _qkv(sum(lengths), 1, dtype, 2))
    bounds = torch.tensor([0, 5, 16, 19], dtype=torch.int32, device=device)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    # megatron hands thd tensors over without the batch axis
    with OpNames() as ops:
        together = attention(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=packed)
    alone = torch.cat([attention(q[a:b], k[a:b], v[a:b], None) for a, b in zip(bounds[:-1], bounds[1:])])
    mixed = attention(q, k, v, None)  # one causal sequence: the later ones would see the earlier
    return {"shape": list(together.shape), "diff": float((together - alone).abs().max()),
            "max_abs": float(alone.abs().max()), "diff_unpacked": float((together - mixed).abs().max()),
            "longest": max(lengths), "values_read_back": sorted(ops.names & {"_local_scalar_dense"})}


@pytest.mark.parametrize("dtype,platform", [("float32", "cpu"), pytest.param("bfloat16", "cuda", marks=pytest.mark.gpu)])
def test_packed_sequences_attend_only_within_themselves(tmp_path, dtype, platform):
    """On the CPU the packed rows are padded inside one batched call; on a GPU in bf16 torch's
    variable-length flash attention takes them as they are."""
    (result,) = run_ranks(_packed, 1, tmp_path, dtype, platform_name=platform)
    assert result["shape"] == [19, 1, HEADS * HEAD_DIM]
    # each sequence as alone (rounding only) ...
    assert result["diff"] <= rounding(result["max_abs"], result["longest"] + HEAD_DIM, getattr(torch, dtype))
    # ... and not as one sequence, where the later ones would see the earlier
    assert result["diff_unpacked"] > 0.1
    # the longest sequence comes from the parameters, not read off the device in every layer
    assert result["values_read_back"] == []


def _packed_rope(rank, world_size):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.runtime.actor import initialize_parallel

    initialize_parallel(TrainParallel())  # the platform's megatron covers are installed
    freqs = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)(32)
    t = torch.randn(19, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    bounds = torch.tensor([0, 5, 16, 19], dtype=torch.int32)
    one_call = rope_utils._apply_rotary_pos_emb_thd(t, bounds, freqs)
    per_sequence = rope_utils._apply_rotary_pos_emb_thd.__wrapped__(t, bounds, freqs)  # megatron's loop
    return {"replaced": rope_utils._apply_rotary_pos_emb_thd is not rope_utils._apply_rotary_pos_emb_thd.__wrapped__,
            "equal": torch.equal(one_call, per_sequence),
            "restarts": torch.equal(one_call[5:7], rope_utils._apply_rotary_pos_emb_bshd(t[5:7, None], freqs[:2])[:, 0])}


def test_packed_rope_in_one_call_equals_megatrons_loop_over_sequences(tmp_path):
    (result,) = run_ranks(_packed_rope, 1, tmp_path)
    assert result == {"replaced": True, "equal": True, "restarts": True}


@pytest.mark.parametrize("prefix", [8, 24])
def test_a_cp_chunk_attends_to_its_prefix_without_a_dense_mask(prefix):
    """A CP rank's chunk of 16 queries over the keys up to its end (``prefix`` earlier keys, then its
    own): on the CPU two flash calls merged by their log-sum-exp, equal to SDPA with torch's
    bottom-right causal mask in output and every input's gradient (grouped-query heads: 8 to 2)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from megatron_bridge.runtime.attention import _PrefixThenCausal

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, 32, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, prefix + 16, 32, generator=g, requires_grad=True) for _ in range(2))
    scale = 32 ** -0.5
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(16, prefix + 16), scale=scale,
                                          enable_gqa=True)
    got = _PrefixThenCausal.apply(q, k, v, scale)
    grad = torch.randn(want.shape, generator=g)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    # fp32, sums over at most 40 keys: rounding only (measured below 1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=rounding(float(want.abs().max()), prefix + 16))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=rounding(float(b.abs().max()), 2 * (prefix + 16)))

"""The HF <-> megatron tensor mapping for Qwen3-MoE, checked on tensors whose entries name their
origin (so a wrong interleave or split shows up as a wrong number, not a small error)."""

import pytest
import torch

from megatron_bridge.weights.hf_checkpoint import CheckpointError, HFCheckpoint
from megatron_bridge.weights.hf_mapping import (
    HFPart,
    ShardPlacement,
    UnknownParameterError,
    hf_parts,
    hf_slices,
    join_parts,
    split_parts,
    to_hf,
    to_megatron,
)
from megatron_bridge.plan.model_spec import load_model_spec
from megatron_bridge.tiny_model import tiny_hf_model as hf_model

SPEC = load_model_spec("tiny_qwen3_moe")  # 8 heads, 4 query groups, head_dim 16, hidden 64


def _labelled(rows: int, cols: int, tag: float) -> torch.Tensor:
    """Entry (r, c) = tag * 1e4 + r: every row says which tensor and row it came from."""
    return (tag * 1e4 + torch.arange(rows, dtype=torch.float64))[:, None].expand(rows, cols).clone()


def _read(tensors, part: HFPart):
    shapes = [tuple(t.shape) for t in tensors]
    out = []
    for t, (rows, cols) in zip(tensors, hf_slices(part, shapes)):
        out.append(t[rows if rows is not None else slice(None)][:, cols if cols is not None else slice(None)]
                   if t.dim() == 2 else t)
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_shard_holds_whole_query_groups_in_megatron_order(tp):
    h, hd = SPEC.hidden_size, SPEC.head_dim
    q, k, v = _labelled(SPEC.q_dim, h, 1), _labelled(SPEC.kv_dim, h, 2), _labelled(SPEC.kv_dim, h, 3)
    heads_per_group = SPEC.num_attention_heads // SPEC.num_query_groups
    groups_per_rank = SPEC.num_query_groups // tp
    for rank in range(tp):
        part = HFPart(("q", "k", "v"), "qkv", rank, tp)
        shard = to_megatron(part, _read([q, k, v], part), SPEC)
        expected = []
        for g in range(rank * groups_per_rank, (rank + 1) * groups_per_rank):
            # megatron's per-group block: this group's q heads, then its k head, then its v head
            expected += [1e4 + r for r in range(g * heads_per_group * hd, (g + 1) * heads_per_group * hd)]
            expected += [2e4 + r for r in range(g * hd, (g + 1) * hd)]
            expected += [3e4 + r for r in range(g * hd, (g + 1) * hd)]
        assert shard[:, 0].tolist() == expected
        back = to_hf(part, shard, SPEC)
        assert [t.shape[0] for t in back] == [SPEC.q_dim // tp, SPEC.kv_dim // tp, SPEC.kv_dim // tp]
        assert torch.equal(torch.cat(back), torch.cat(_read([q, k, v], part)))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_fc1_shard_is_gate_slice_then_up_slice(size):
    i, h = SPEC.moe_ffn_hidden_size, SPEC.hidden_size
    gate, up = _labelled(i, h, 1), _labelled(i, h, 2)
    step = i // size
    for rank in range(size):
        part = HFPart(("gate", "up"), "gate_up", rank, size)
        shard = to_megatron(part, _read([gate, up], part), SPEC)
        assert shard[:, 0].tolist() == [1e4 + r for r in range(rank * step, (rank + 1) * step)] + [
            2e4 + r for r in range(rank * step, (rank + 1) * step)
        ]
        assert [torch.equal(a, b) for a, b in zip(to_hf(part, shard, SPEC), _read([gate, up], part))] == [True, True]


def test_row_parallel_and_vocab_splits():
    o = torch.arange(64 * 128, dtype=torch.float32).reshape(64, 128)
    part = HFPart(("o",), "cols", 1, 2)
    assert torch.equal(_read([o], part)[0], o[:, 64:])
    emb = torch.arange(512 * 4, dtype=torch.float32).reshape(512, 4)
    part = HFPart(("e",), "rows", 3, 4)
    assert torch.equal(_read([emb], part)[0], emb[384:])
    with pytest.raises(ValueError, match="does not split into 3"):
        hf_slices(HFPart(("e",), "rows", 0, 3), [(512, 4)])


WHERE = ShardPlacement(layer_numbers={0: 2, 1: 3}, tp_rank=1, tp_size=2, ep_rank=1, num_local_experts=4,
                       etp_rank=0, etp_size=1)


@pytest.mark.parametrize(
    "name, hf_names, kind",
    [
        ("decoder.layers.0.input_layernorm.weight", ("model.layers.2.input_layernorm.weight",), "full"),
        # Transformer Engine fuses the input norm into the QKV projection
        ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", ("model.layers.2.input_layernorm.weight",), "full"),
        ("decoder.layers.1.self_attention.linear_qkv.weight",
         tuple(f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
        ("decoder.layers.1.self_attention.linear_proj.weight", ("model.layers.3.self_attn.o_proj.weight",), "cols"),
        ("decoder.layers.1.pre_mlp_layernorm.weight", ("model.layers.3.post_attention_layernorm.weight",), "full"),
        ("decoder.layers.1.mlp.router.weight", ("model.layers.3.mlp.gate.weight",), "full"),
        # local spec (SequentialMLP) and TE grouped names: local expert 1 on EP rank 1 is global expert 5
        ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
         ("model.layers.2.mlp.experts.5.gate_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight"), "gate_up"),
        ("decoder.layers.0.mlp.experts.linear_fc1.weight1",
         ("model.layers.2.mlp.experts.5.gate_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight"), "gate_up"),
        ("decoder.layers.0.mlp.experts.linear_fc2.weight3", ("model.layers.2.mlp.experts.7.down_proj.weight",), "cols"),
        # GroupedExperts and legacy GroupedMLP: one tensor holds all local experts (tested below)
        ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "rows"),
        ("output_layer.weight", ("lm_head.weight",), "rows"),
        ("decoder.final_layernorm.weight", ("model.norm.weight",), "full"),
    ],
)
def test_megatron_names_map_to_global_hf_names(name, hf_names, kind):
    (part,) = hf_parts(name, WHERE)
    assert (part.hf_names, part.kind) == (hf_names, kind)
    expert = "experts" in name
    assert (part.rank, part.size) == ((0, 1) if expert else (1, 2) if kind in ("qkv", "cols", "rows") else (0, 1))


def test_unknown_names_are_refused():
    for name in ("decoder.layers.9.input_layernorm.weight", "decoder.layers.0.mlp.shared_expert.weight", "foo"):
        with pytest.raises(UnknownParameterError):
            hf_parts(name, WHERE)


@pytest.mark.parametrize("module, fc1, fc2", [
    ("GroupedExperts", "decoder.layers.1.mlp.experts.fc1_weight", "decoder.layers.1.mlp.experts.fc2_weight"),
    ("GroupedMLP", "decoder.layers.1.mlp.experts.weight1", "decoder.layers.1.mlp.experts.weight2"),
])
def test_tensors_of_all_local_experts_hold_them_as_megatron_reads_them(module, fc1, fc2):
    """GroupedExperts stacks each expert's fc1 [2I, H] / fc2 [H, I] as [E, 2I, H] / [E, H, I];
    GroupedMLP reads weight1 as view(E, H, -1) and weight2 as view(E, -1, H) (each transposed)."""
    h, i, experts = 6, 4, WHERE.num_local_experts
    w_fc1 = [torch.randn(2 * i, h) for _ in range(experts)]
    w_fc2 = [torch.randn(h, i) for _ in range(experts)]
    t1, t2 = join_parts(fc1, w_fc1), join_parts(fc2, w_fc2)
    if module == "GroupedExperts":
        assert t1.shape == (experts, 2 * i, h) and t2.shape == (experts, h, i)
        views = t1, t2
    else:
        assert t1.shape == (h, experts * 2 * i) and t2.shape == (experts * i, h)
        views = t1.view(experts, h, -1).transpose(1, 2), t2.view(experts, -1, h).transpose(1, 2)
    for e in range(experts):
        assert torch.equal(views[0][e], w_fc1[e]) and torch.equal(views[1][e], w_fc2[e])
    for name, tensor, per_expert in ((fc1, t1, w_fc1), (fc2, t2, w_fc2)):
        back = split_parts(name, tensor, experts)
        assert all(torch.equal(a, b) for a, b in zip(back, per_expert, strict=True))
        assert all(b.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() for b in back)  # views
    # one part per local expert, global ids of EP rank 1 in order
    parts = hf_parts(fc1, WHERE)
    assert [p.hf_names for p in parts] == [(f"model.layers.3.mlp.experts.{e}.gate_proj.weight",
                                            f"model.layers.3.mlp.experts.{e}.up_proj.weight") for e in range(4, 8)]
    assert {(p.kind, p.rank, p.size) for p in parts} == {("gate_up", 0, 1)}
    assert [p.hf_names for p in hf_parts(fc2, WHERE)] == [(f"model.layers.3.mlp.experts.{e}.down_proj.weight",)
                                                          for e in range(4, 8)]


def test_a_tensor_of_one_expert_or_none_is_its_own_part():
    dense = torch.randn(3, 2)
    for name in ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", "decoder.layers.0.mlp.router.weight",
                 "output_layer.weight"):
        assert join_parts(name, [dense]) is dense and split_parts(name, dense, 1) == [dense]


def test_fused_transformers5_checkpoint_reads_like_the_hub_format(tmp_path):
    model = hf_model(seed=3)
    model.save_pretrained(tmp_path / "hub")
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    with HFCheckpoint(str(tmp_path / "hub")) as hub, HFCheckpoint(str(tmp_path / "fused")) as fused:
        assert "model.layers.0.mlp.experts.gate_up_proj" in fused.weight_map
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.1.mlp.experts.6.{proj}.weight"
            assert fused.shape(name) == hub.shape(name)
            assert torch.equal(fused.read(name), hub.read(name))
            assert torch.equal(fused.read(name, rows=slice(8, 16)), hub.read(name, rows=slice(8, 16)))
        assert fused.bytes_read == hub.bytes_read > 0


def test_checkpoint_errors_name_the_directory_and_tensor(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        HFCheckpoint(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        HFCheckpoint(str(tmp_path / "empty"))
    hf_model().save_pretrained(tmp_path / "ok")
    with HFCheckpoint(str(tmp_path / "ok")) as ckpt, pytest.raises(CheckpointError, match="model.layers.7.mlp.gate.weight"):
        ckpt.shape("model.layers.7.mlp.gate.weight")

"""Qwen3-MoE tensors: which Hugging Face tensors make up each megatron-core shard, and how.

One table serves three megatron naming schemes, all of which can hold a Qwen3-MoE model:

- local spec (CPU; ``SequentialMLP``): ``decoder.layers.N.input_layernorm.weight``,
  ``mlp.experts.local_experts.{e}.linear_fc1.weight``
- Transformer Engine spec (GPU, and MindSpeed with ``--transformer-impl transformer_engine``):
  the input norm fused into ``self_attention.linear_qkv.layer_norm_weight``, grouped experts as
  ``mlp.experts.linear_fc1.weight{e}``
- legacy ``GroupedMLP`` (MindSpeed's grouped-matmul path): all local experts in one
  ``mlp.experts.weight1`` [H, E_local*2I/ETP] and ``weight2`` [E_local*I/ETP, H]

Conversions work on one shard at a time, in both directions, so a rank reads (and later sends)
only the slice it owns:

- ``qkv``: megatron stores, per query group, that group's q heads then its k head then its v head;
  HF stores all q, all k, all v. TP splits whole query groups.
- ``gate_up``: megatron's fc1 is [gate; up]; TP/ETP rank r holds [gate_r; up_r].
- ``rows`` / ``cols``: split along dim 0 (column-parallel, vocab-parallel) or dim 1 (row-parallel).
- ``full``: replicated (norms, router).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_bridge.plan.model_spec import ModelSpec

@dataclass(frozen=True)
class HFPart:
    """One megatron shard (or, for grouped experts, one expert's part of it) and its HF sources."""

    hf_names: tuple[str, ...]
    kind: str
    rank: int  # in the TP group for dense tensors, the ETP group for experts
    size: int


@dataclass(frozen=True)
class ShardPlacement:
    """Where this rank sits: the coordinates that turn a local name into global HF names."""

    layer_numbers: dict[int, int]  # local layer index in this chunk -> global layer index (0-based)
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    num_local_experts: int = 1
    etp_rank: int = 0
    etp_size: int = 1


# megatron suffix inside one decoder layer -> (HF suffixes inside model.layers.N, kind)
_LAYER_TENSORS = {
    "input_layernorm.weight": (("input_layernorm.weight",), "full"),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "full"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "full"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "full"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "cols"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "full"),
    # dist_checkpointing's name for it (Transformer Engine's fused one)
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "full"),
    "mlp.router.weight": (("mlp.gate.weight",), "full"),
}
_TOP_TENSORS = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", "rows"),
    "decoder.final_layernorm.weight": ("model.norm.weight", "full"),
    "output_layer.weight": ("lm_head.weight", "rows"),
}
_EXPERT_FC = {"linear_fc1": (("gate_proj", "up_proj"), "gate_up"), "linear_fc2": (("down_proj",), "cols")}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
_LEGACY_GROUPED = {"mlp.experts.weight1": "linear_fc1", "mlp.experts.weight2": "linear_fc2"}


class UnknownParameterError(KeyError):
    pass


def hf_parts(name: str, where: ShardPlacement) -> list[HFPart]:
    """The HF sources of local megatron parameter ``name``: one part, or one per local expert for
    the legacy grouped tensors (in local expert order)."""
    if name in _TOP_TENSORS:
        hf, kind = _TOP_TENSORS[name]
        rank, size = (where.tp_rank, where.tp_size) if kind == "rows" else (0, 1)
        return [HFPart((hf,), kind, rank, size)]
    m = _LAYER.match(name)
    if not m:
        raise UnknownParameterError(name)
    layer, suffix = int(m[1]), m[2]
    if layer not in where.layer_numbers:
        raise UnknownParameterError(name)
    prefix = f"model.layers.{where.layer_numbers[layer]}."
    if suffix in _LAYER_TENSORS:
        hf, kind = _LAYER_TENSORS[suffix]
        rank, size = (where.tp_rank, where.tp_size) if kind in ("qkv", "cols") else (0, 1)
        return [HFPart(tuple(prefix + s for s in hf), kind, rank, size)]

    def expert(local: int, fc: str) -> HFPart:
        projs, kind = _EXPERT_FC[fc]
        global_id = where.ep_rank * where.num_local_experts + local
        names = tuple(f"{prefix}mlp.experts.{global_id}.{p}.weight" for p in projs)
        return HFPart(names, kind, where.etp_rank, where.etp_size)

    if m := _SEQUENTIAL_EXPERT.match(suffix):
        return [expert(int(m[1]), m[2])]
    if m := _TE_GROUPED_EXPERT.match(suffix):
        return [expert(int(m[2]), m[1])]
    if suffix in _LEGACY_GROUPED:
        return [expert(e, _LEGACY_GROUPED[suffix]) for e in range(where.num_local_experts)]
    raise UnknownParameterError(name)


def is_legacy_grouped(name: str) -> bool:
    return any(name.endswith(suffix) for suffix in _LEGACY_GROUPED)


def _chunk(n: int, rank: int, size: int, what: str) -> slice:
    if n % size:
        raise ValueError(f"{what}: dimension {n} does not split into {size} parallel ranks")
    step = n // size
    return slice(rank * step, (rank + 1) * step)


def hf_slices(part: HFPart, hf_shapes: list[tuple[int, ...]]) -> list[tuple[slice | None, slice | None]]:
    """(rows, cols) of each HF tensor of ``part`` that this shard holds (None: all)."""
    out = []
    for name, shape in zip(part.hf_names, hf_shapes):
        if part.kind == "full" or part.size == 1:
            out.append((None, None))
        elif part.kind == "cols":
            out.append((None, _chunk(shape[1], part.rank, part.size, name)))
        else:  # rows, qkv (whole query groups: q, k and v rows split alike), gate_up
            out.append((_chunk(shape[0], part.rank, part.size, name), None))
    return out


def to_megatron(part: HFPart, tensors: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """One megatron shard from this rank's HF slices."""
    if part.kind == "qkv":
        q, k, v = tensors
        hidden = q.shape[-1]
        groups = k.shape[0] // spec.head_dim
        per_group = spec.num_attention_heads // spec.num_query_groups * spec.head_dim
        grouped = [q.reshape(groups, per_group, hidden), k.reshape(groups, spec.head_dim, hidden),
                   v.reshape(groups, spec.head_dim, hidden)]
        return torch.cat(grouped, dim=1).reshape(-1, hidden)
    if part.kind == "gate_up":
        return torch.cat(tensors, dim=0)
    (tensor,) = tensors
    return tensor


def to_hf(part: HFPart, shard: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """Inverse of ``to_megatron``: this shard's slices of each HF tensor of ``part``."""
    if part.kind == "qkv":
        hidden = shard.shape[-1]
        per_group = spec.num_attention_heads // spec.num_query_groups * spec.head_dim
        groups = shard.shape[0] // (per_group + 2 * spec.head_dim)
        q, k, v = shard.reshape(groups, -1, hidden).split([per_group, spec.head_dim, spec.head_dim], dim=1)
        return [q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]
    if part.kind == "gate_up":
        return list(shard.chunk(2, dim=0))
    return [shard]


def legacy_grouped(name: str, experts: list[torch.Tensor]) -> torch.Tensor:
    """GroupedMLP's storage of local experts: it views weight1 as [E, H, 2I] and weight2 as
    [E, I, H], i.e. each expert's fc1/fc2 transposed, expert-major."""
    stacked = torch.stack([w.t() for w in experts])
    hidden = stacked.shape[1] if name.endswith("weight1") else stacked.shape[2]
    return stacked.reshape(hidden, -1) if name.endswith("weight1") else stacked.reshape(-1, hidden)


def split_legacy_grouped(name: str, tensor: torch.Tensor, num_local_experts: int) -> list[torch.Tensor]:
    """Inverse of ``legacy_grouped``: each local expert's fc1 [2I, H] or fc2 [H, I]."""
    if name.endswith("weight1"):
        hidden = tensor.shape[0]
        per_expert = tensor.reshape(num_local_experts, hidden, -1)
    else:
        hidden = tensor.shape[1]
        per_expert = tensor.reshape(num_local_experts, -1, hidden)
    return [w.t() for w in per_expert]

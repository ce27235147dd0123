"""Qwen3-MoE tensors: which Hugging Face tensors make up each megatron-core shard, and how.

One table serves megatron's naming schemes, all of which can hold a Qwen3-MoE model:

- local spec: ``decoder.layers.N.input_layernorm.weight``; its experts as megatron's
  ``SequentialMLP`` (``moe_grouped_gemm=False``), ``mlp.experts.local_experts.{e}.linear_fc1.weight``,
  or as this package's ``GroupedExperts`` (``megatron_bridge.runtime.experts``), all local experts
  stacked in one ``mlp.experts.fc1_weight`` [E_local, 2I/ETP, H] and ``fc2_weight`` [E_local, H, I/ETP]
- Transformer Engine spec (GPU, and MindSpeed with ``--transformer-impl transformer_engine``):
  the input norm fused into ``self_attention.linear_qkv.layer_norm_weight``, grouped experts as
  ``mlp.experts.linear_fc1.weight{e}``
- legacy ``GroupedMLP`` (MindSpeed's grouped-matmul path): all local experts in one
  ``mlp.experts.weight1`` [H, E_local*2I/ETP] and ``weight2`` [E_local*I/ETP, H], each transposed

A tensor that holds all local experts has one part per expert; ``join_parts`` and ``split_parts``
turn the experts' shards into it and back.

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
_EXPERT_FC = {"1": (("gate_proj", "up_proj"), "gate_up"), "2": (("down_proj",), "cols")}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# The expert tensors inside a decoder layer, by module: name pattern (``fc``: the projection, 1 or 2;
# ``expert``: the local expert, for a tensor of one expert) and how a tensor of all local experts
# stores them (None: it is one expert's [out, in]).
_EXPERT_TENSORS = (
    (re.compile(r"^mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc(?P<fc>[12])\.weight$"), None),  # SequentialMLP
    (re.compile(r"^mlp\.experts\.linear_fc(?P<fc>[12])\.weight(?P<expert>\d+)$"), None),  # TEGroupedMLP
    (re.compile(r"^mlp\.experts\.fc(?P<fc>[12])_weight$"), "stacked"),  # GroupedExperts: [E, out, in]
    (re.compile(r"^mlp\.experts\.weight(?P<fc>[12])$"), "transposed"),  # legacy GroupedMLP
)


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

    match = _expert_tensor(suffix)
    if match is None:
        raise UnknownParameterError(name)
    m, storage = match
    projs, kind = _EXPERT_FC[m["fc"]]
    local = range(where.num_local_experts) if storage else [int(m["expert"])]
    first = where.ep_rank * where.num_local_experts
    return [HFPart(tuple(f"{prefix}mlp.experts.{first + e}.{p}.weight" for p in projs), kind, where.etp_rank,
                   where.etp_size) for e in local]


def _expert_tensor(suffix: str) -> tuple[re.Match, str | None] | None:
    """(match, storage) of an expert tensor's name inside a decoder layer; None for others."""
    for pattern, storage in _EXPERT_TENSORS:
        if m := pattern.match(suffix):
            return m, storage
    return None


def _all_experts(name: str) -> tuple[str, str] | None:
    """(storage, projection "1" / "2") of a local parameter that holds all local experts; None for
    any other."""
    layer = _LAYER.match(name)
    match = _expert_tensor(layer[2]) if layer else None
    if match is None or match[1] is None:
        return None
    return match[1], match[0]["fc"]


def join_parts(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Local parameter ``name`` from the shards of its parts (``hf_parts``' order): the one shard,
    or the local experts' fc1 [2I, H] / fc2 [H, I] in the tensor that holds them all."""
    held = _all_experts(name)
    if held is None:
        (shard,) = shards
        return shard
    storage, fc = held
    if storage == "stacked":
        return torch.stack(shards)
    # legacy GroupedMLP views weight1 as [E, H, 2I] and weight2 as [E, I, H]: each expert
    # transposed, expert-major, in a 2-D tensor
    stacked = torch.stack([w.t() for w in shards])
    return stacked.reshape(stacked.shape[1], -1) if fc == "1" else stacked.reshape(-1, stacked.shape[2])


def split_parts(name: str, tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Inverse of ``join_parts`` for ``parts`` parts: views of ``tensor``, no copies."""
    held = _all_experts(name)
    if held is None:
        return [tensor]
    storage, fc = held
    if storage == "stacked":
        return list(tensor.unbind(0))
    per_expert = tensor.reshape(parts, tensor.shape[0], -1) if fc == "1" else tensor.reshape(parts, -1, tensor.shape[1])
    return [w.t() for w in per_expert]


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

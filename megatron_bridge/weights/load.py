"""Load a Hugging Face Qwen3-MoE checkpoint into this rank's megatron-core shards.

Every rank reads only the slices it owns (its PP stage's layers, its TP/ETP slice, its EP rank's
experts) straight from the safetensors files. All tensors are checked (present, right shape)
before any parameter is written, and the outcome is agreed across ranks, so a bad checkpoint
fails everywhere with the same message and leaves the model untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_bridge.weights.hf_checkpoint import CheckpointError, HFCheckpoint
from megatron_bridge.weights.hf_mapping import (
    HFPart,
    ShardPlacement,
    UnknownParameterError,
    hf_parts,
    hf_slices,
    join_parts,
    to_megatron,
)
from megatron_bridge.plan.model_spec import ModelSpec


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def placement(model: torch.nn.Module) -> ShardPlacement:
    """This rank's coordinates for one model chunk (parallel state must be initialised)."""
    from megatron.core import parallel_state as ps

    layers = model.decoder.layers if getattr(model, "decoder", None) is not None else []
    num_experts = model.config.num_moe_experts or 1
    return ShardPlacement(
        layer_numbers={i: layer.layer_number - 1 for i, layer in enumerate(layers)},
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        num_local_experts=num_experts // ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
    )


def hf_shape(spec: ModelSpec, hf_name: str) -> tuple[int, ...]:
    """The shape a Qwen3-MoE checkpoint of this config must give ``hf_name``."""
    h, i = spec.hidden_size, spec.moe_ffn_hidden_size
    by_suffix = {
        "embed_tokens.weight": (spec.vocab_size, h),
        "lm_head.weight": (spec.vocab_size, h),
        "q_proj.weight": (spec.q_dim, h),
        "k_proj.weight": (spec.kv_dim, h),
        "v_proj.weight": (spec.kv_dim, h),
        "o_proj.weight": (h, spec.q_dim),
        "q_norm.weight": (spec.head_dim,),
        "k_norm.weight": (spec.head_dim,),
        "mlp.gate.weight": (spec.num_experts, h),
        "gate_proj.weight": (i, h),
        "up_proj.weight": (i, h),
        "down_proj.weight": (h, i),
    }
    for suffix, shape in by_suffix.items():
        if hf_name.endswith(suffix):
            return shape
    return (h,)  # the RMSNorm weights


def hub_tensor_names(spec: ModelSpec) -> list[str]:
    """Every tensor of a Qwen3-MoE checkpoint of this config as on the Hub (per-expert names), in
    checkpoint order; ``hf_shape`` gives each one's shape."""
    names = ["model.embed_tokens.weight"]
    layer_tensors = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate")
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        names += [f"{prefix}{t}.weight" for t in layer_tensors]
        names += [f"{prefix}mlp.experts.{e}.{p}.weight" for e in range(spec.num_experts)
                  for p in ("gate_proj", "up_proj", "down_proj")]
    names.append("model.norm.weight")
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


@dataclass
class LoadReport:
    tensors: int  # local parameters written
    bytes_read: int  # bytes read from the checkpoint by this rank


def _plan(model, spec: ModelSpec, ckpt: HFCheckpoint):
    """(parameter, name, parts, slices) for every local parameter; raises on the first problem."""
    where = placement(model)
    plan = []
    for name, param in model.named_parameters():
        try:
            parts = hf_parts(name, where)
        except UnknownParameterError:
            raise CheckpointError(f"model parameter {name!r} has no Qwen3-MoE checkpoint mapping") from None
        slices = []
        for part in parts:
            shapes = []
            for hf_name in part.hf_names:
                found, expected = ckpt.shape(hf_name), hf_shape(spec, hf_name)
                if found != expected:
                    raise CheckpointError(
                        f"checkpoint {ckpt.directory!r}: tensor {hf_name!r} has shape {list(found)}, "
                        f"but the model config needs {list(expected)}"
                    )
                shapes.append(found)
            slices.append(hf_slices(part, shapes))
        plan.append((param, name, parts, slices))
    return plan


def _read_shard(ckpt: HFCheckpoint, spec: ModelSpec, name: str, parts: list[HFPart], slices) -> torch.Tensor:
    shards = [
        to_megatron(part, [ckpt.read(n, rows, cols) for n, (rows, cols) in zip(part.hf_names, part_slices)], spec)
        for part, part_slices in zip(parts, slices)
    ]
    return join_parts(name, shards)


def _agree(error: str | None) -> None:
    """Raise on every rank if any rank failed, with the first failing rank's message."""
    if not torch.distributed.is_initialized():
        if error:
            raise CheckpointError(error)
        return
    errors = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(errors, error)
    for rank, message in enumerate(errors):
        if message:
            raise CheckpointError(message if message == error else f"rank {rank}: {message}")


def read_shards(chunks: list[torch.nn.Module], spec: ModelSpec, directory: str) -> tuple[list, int]:
    """([(parameter, name, shard)], bytes read): this rank's shards as the checkpoint gives them,
    checked against the parameters they are for; nothing is written."""
    with HFCheckpoint(directory) as ckpt:
        error, plans = None, []
        try:
            plans = [_plan(unwrap(c), spec, ckpt) for c in chunks]
        except (CheckpointError, ValueError) as e:
            error = str(e)
        _agree(error)
        shards = []
        try:
            for plan in plans:
                for param, name, parts, slices in plan:
                    shard = _read_shard(ckpt, spec, name, parts, slices)
                    if shard.shape != param.shape:
                        raise CheckpointError(
                            f"{name}: converted checkpoint slice has shape {list(shard.shape)}, "
                            f"the model parameter {list(param.shape)} (model built from another config?)"
                        )
                    shards.append((param, name, shard))
        except (CheckpointError, ValueError) as e:
            error = str(e)
        _agree(error)
        return shards, ckpt.bytes_read


def load_hf_checkpoint(chunks: list[torch.nn.Module], spec: ModelSpec, directory: str) -> LoadReport:
    """Copy the checkpoint in ``directory`` into ``chunks`` (this rank's model chunks).

    Load before building the optimizer: a distributed optimizer keeps its own fp32 copy of the
    weights, made when it is built.
    """
    shards, bytes_read = read_shards(chunks, spec, directory)
    with torch.no_grad():
        for param, _, shard in shards:
            param.copy_(shard)
    return LoadReport(tensors=len(shards), bytes_read=bytes_read)

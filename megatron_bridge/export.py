"""This rank's shards in Hugging Face terms: the inverse of ``load``, one local slice at a time.

``local_hf_slices`` is the first stage of the weight export to the rollout engine: each yielded
slice says which HF tensor it belongs to and where in it, so gathering over TP/ETP/EP/PP is a
matter of placing slices.
"""

from __future__ import annotations

from typing import Iterator

import torch

from megatron_bridge.hf_mapping import hf_parts, hf_slices, is_legacy_grouped, split_legacy_grouped, to_hf
from megatron_bridge.load import hf_shape, placement, unwrap
from megatron_bridge.model_spec import ModelSpec

Slice = tuple[str, slice | None, slice | None, torch.Tensor]  # (hf_name, rows, cols, values)


def local_hf_slices(chunks: list[torch.nn.Module], spec: ModelSpec) -> Iterator[Slice]:
    """Every (hf_name, rows, cols, tensor) this rank holds; None rows/cols mean the whole dim.
    Replicated tensors (norms, router) come from every rank that holds them."""
    for chunk in chunks:
        model = unwrap(chunk)
        where = placement(model)
        for name, param in model.named_parameters():
            parts = hf_parts(name, where)
            values = param.detach()
            shards = split_legacy_grouped(name, values, len(parts)) if is_legacy_grouped(name) else [values]
            for part, shard in zip(parts, shards):
                shapes = [hf_shape(spec, n) for n in part.hf_names]
                for hf_name, (rows, cols), tensor in zip(part.hf_names, hf_slices(part, shapes), to_hf(part, shard, spec)):
                    yield hf_name, rows, cols, tensor

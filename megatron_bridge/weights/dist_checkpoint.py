"""The actor's torch_dist checkpoint (``megatron_bridge.runtime.checkpoint``), written under any
parallel layout, read back as Hugging Face tensors under their Hub names, one group at a time.

A checkpoint stores each model tensor as its global tensor, layers (and experts) as leading axes:
``decoder.layers.self_attention.linear_qkv.weight`` [layers, qkv rows, hidden],
``decoder.layers.mlp.experts.experts.linear_fc1.weight`` [layers, experts, 2 x ffn, hidden], the
same whether the experts were megatron's ``SequentialMLP`` or ``GroupedExperts`` (which writes
``SequentialMLP``'s sharded tensors, ``megatron_bridge.runtime.experts``). A
group is one such tensor, or one layer of a layer-stacked one (for the experts: one projection
of all of one layer's experts), read with torch.distributed.checkpoint (only the stored chunks
that overlap it; one process, no process group) and turned into HF tensors by
``megatron_bridge.weights.hf_mapping`` as if it were the shard of a one-rank model. Peak memory
is the largest group, not the model.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megatron_bridge.errors import UserError
from megatron_bridge.plan.model_spec import ModelSpec
from megatron_bridge.weights.hf_mapping import ShardPlacement, UnknownParameterError, hf_parts, to_hf
from megatron_bridge.weights.load import hf_shape, hub_tensor_names

MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
LAYERS = "decoder.layers."
EXPERTS = LAYERS + "mlp.experts.experts."


class CheckpointMismatchError(UserError, ValueError):
    pass


class CheckpointFilesError(UserError, FileNotFoundError):
    pass


class UnsafeMetadataError(UserError, pickle.UnpicklingError):
    """A checkpoint's ``.metadata`` asks to build something a checkpoint's metadata never holds."""


# What torch's and megatron's writers put in ``.metadata``, a pickle: classes of their checkpoint
# modules, plus these few. Anything else (a function to call, another module's class) is refused
# before it runs; megatron's own load, and torch's loader, still unpickle it as written.
_METADATA_MODULES = ("torch.distributed.checkpoint.", "megatron.core.dist_checkpointing.")
_METADATA_GLOBALS = {("torch", "Size"), ("pathlib", "PosixPath"), ("torch.serialization", "_get_layout"),
                     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" or module.startswith(_METADATA_MODULES):
            found = super().find_class(module, name)  # imports only torch's and megatron's own modules
            if isinstance(found, torch.dtype) if module == "torch" else isinstance(found, type):
                return found
        raise UnsafeMetadataError(f"{module}.{name}")


def read_metadata(directory: str | os.PathLike):
    """The checkpoint's ``.metadata`` (torch.distributed.checkpoint's ``Metadata``), unpickled with
    only the classes such metadata holds: a crafted file cannot run code here."""
    with open(Path(directory) / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if getattr(metadata, "storage_meta", None) is None:  # as torch's FileSystemReader fills it in
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata.storage_meta = StorageMeta()
    return metadata


def damage(directory: str | os.PathLike) -> list[str]:
    """What makes the torch_dist checkpoint in ``directory`` unloadable, as far as the format's own
    metadata tells without reading the tensors, each beginning with the file's name (empty:
    nothing): a missing file, a shard file shorter than the bytes its metadata places in it,
    metadata or common state that cannot be read."""
    directory = Path(directory)
    found = [f"{n} is missing" for n in ("metadata.json", ".metadata", "common.pt") if not (directory / n).is_file()]
    if (directory / "metadata.json").is_file():
        try:
            json.loads((directory / "metadata.json").read_text())
        except ValueError:
            found.append("metadata.json is not JSON")
    if (directory / "common.pt").is_file():  # torch.save's zip: its CRCs tell a damaged file
        try:
            with zipfile.ZipFile(directory / "common.pt") as z:
                bad = z.testzip()
            if bad is not None:
                found.append(f"common.pt fails its checksum ({bad})")
        except (zipfile.BadZipFile, OSError, EOFError):
            found.append("common.pt is not a complete torch.save file")
    if not (directory / ".metadata").is_file():
        return found
    try:
        storage = read_metadata(directory).storage_data
    except UnsafeMetadataError as e:
        return found + [f".metadata asks to build {e}, which no checkpoint's metadata holds (not loaded: it could "
                        "run code)"]
    except Exception as e:  # a truncated pickle raises whatever unpickling hits first
        return found + [f".metadata cannot be read ({type(e).__name__})"]
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = directory / name
        if not path.is_file():
            found.append(f"{name} is missing")
        elif path.stat().st_size < end:
            found.append(f"{name} has {path.stat().st_size} bytes, its metadata places {end}")
    return found


def check_complete(directory: str | os.PathLike) -> None:
    """A clear error naming the checkpoint and what is wrong with it."""
    found = damage(directory)
    if found:
        raise CheckpointFilesError(f"checkpoint {directory} is incomplete or damaged: {'; '.join(found)}")


@dataclass(frozen=True)
class Group:
    key: str  # the checkpoint's tensor
    layer: int | None  # its slice along the layer axis (None: the whole tensor)
    hf_names: tuple[str, ...]  # what it becomes, in this order


class DistCheckpoint:
    """One torch_dist checkpoint directory of a model with ``spec``."""

    def __init__(self, directory: str | os.PathLike, spec: ModelSpec):
        from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
            CachedMetadataFileSystemReader,
        )
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        check_complete(directory)
        self.directory, self.spec = str(directory), spec
        self.reader = CachedMetadataFileSystemReader(self.directory)
        self.reader._cached_metadata = read_metadata(self.directory)  # torch's loader reads it from here
        every = self.reader.read_metadata().state_dict_metadata
        self.tensors = {k: v for k, v in every.items()
                        if k.startswith(MODEL_PREFIXES) and isinstance(v, TensorStorageMetadata)}
        self.placement = ShardPlacement(layer_numbers={i: i for i in range(spec.num_layers)},
                                        num_local_experts=spec.num_experts)
        self.groups = self._plan()

    def _plan(self) -> list[Group]:
        """Every group in Hub order (embedding, layer by layer, final norm, LM head); refuses a
        checkpoint whose tensors are not this model's."""
        first, last = [], []  # the embedding; the final norm and the LM head
        for key in sorted(k for k in self.tensors if not k.startswith(LAYERS)):
            (first if key.startswith("embedding.") else last).append(Group(key, None, self._hf_names(key, None)))
        layered = sorted(k for k in self.tensors if k.startswith(LAYERS))
        groups = first + [Group(key, layer, self._hf_names(key, layer))
                          for layer in range(self.spec.num_layers) for key in layered] + last
        names = [n for g in groups for n in g.hf_names]
        expected = hub_tensor_names(self.spec)
        if sorted(names) != sorted(expected):
            missing, extra = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
            raise CheckpointMismatchError(
                f"checkpoint {self.directory} does not hold the model of its config: missing {missing[:3]}"
                f"{' ...' if len(missing) > 3 else ''}, unexpected {extra[:3]}{' ...' if len(extra) > 3 else ''}")
        for key, meta in self.tensors.items():
            layers = self.spec.num_layers if key.startswith(LAYERS) else None
            if layers is not None and meta.size[0] != layers:
                raise CheckpointMismatchError(f"checkpoint {self.directory}: {key} has {meta.size[0]} "
                                              f"layers, the model's config {layers}")
        for group in groups:  # every shape, before anything is read (on the meta device: no memory)
            for _ in self._to_hf(group, torch.empty(self._shape(group), device="meta")):
                pass
        return groups

    def _local_names(self, key: str, layer: int | None) -> list[str]:
        """The names of a one-rank model's parameters that this group holds (one per expert)."""
        if layer is None:
            return [key]
        suffix = key[len(LAYERS):]
        if key.startswith(EXPERTS):
            fc = key[len(EXPERTS):]
            return [f"{LAYERS}{layer}.mlp.experts.local_experts.{e}.{fc}" for e in range(self.spec.num_experts)]
        return [f"{LAYERS}{layer}.{suffix}"]

    def _hf_names(self, key: str, layer: int | None) -> tuple[str, ...]:
        try:
            return tuple(n for local in self._local_names(key, layer) for part in hf_parts(local, self.placement)
                         for n in part.hf_names)
        except UnknownParameterError as e:
            raise CheckpointMismatchError(f"checkpoint {self.directory}: {key} is no Qwen3-MoE tensor") from e

    def dtype(self) -> torch.dtype:
        dtypes = {meta.properties.dtype for meta in self.tensors.values()}
        if len(dtypes) != 1:
            raise CheckpointMismatchError(f"checkpoint {self.directory} mixes dtypes {sorted(map(str, dtypes))}")
        return dtypes.pop()

    def _shape(self, group: Group) -> tuple[int, ...]:
        size = tuple(self.tensors[group.key].size)
        return size if group.layer is None else size[1:]

    def read(self, group: Group) -> torch.Tensor:
        """The group's global tensor, or its slice at ``group.layer``."""
        import torch.distributed.checkpoint as dcp

        shape, dtype = self._shape(group), self.tensors[group.key].properties.dtype
        if group.layer is None:
            buffer, offsets = torch.empty(shape, dtype=dtype), (0,) * len(shape)
        else:
            buffer, offsets = torch.empty((1, *shape), dtype=dtype), (group.layer,) + (0,) * len(shape)
        dcp.load({group.key: buffer}, storage_reader=self.reader, planner=_SlicePlanner(group.key, offsets),
                 no_dist=True)
        return buffer if group.layer is None else buffer[0]

    def hf_tensors(self, group: Group) -> Iterator[tuple[str, torch.Tensor]]:
        return self._to_hf(group, self.read(group))

    def _to_hf(self, group: Group, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The group's HF tensors, shapes checked against the model's config."""
        locals_ = self._local_names(group.key, group.layer)
        pieces = tensor.unbind(0) if len(locals_) > 1 else [tensor]
        for local, piece in zip(locals_, pieces, strict=True):
            (part,) = hf_parts(local, self.placement)
            for name, hf in zip(part.hf_names, to_hf(part, piece, self.spec), strict=True):
                if tuple(hf.shape) != hf_shape(self.spec, name):
                    raise CheckpointMismatchError(f"checkpoint {self.directory}: {name} has shape {tuple(hf.shape)}, "
                                                  f"the model's config {hf_shape(self.spec, name)}")
                yield name, hf

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        for group in self.groups:
            yield from self.hf_tensors(group)


class _SlicePlanner(DefaultLoadPlanner):
    """torch.distributed.checkpoint's planner, reading one slice of one stored global tensor (at
    ``offsets``, of the shape of the buffer it is given) rather than all of it."""

    def __init__(self, key: str, offsets: tuple[int, ...]):
        super().__init__()
        self.key, self.offsets = key, offsets

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.state_dict[self.key].shape)
        return LoadPlan(create_read_items_for_chunk_list(self.key, self.metadata.state_dict_metadata[self.key],
                                                         [chunk]))

    def resolve_tensor(self, read_item):
        tensor = self.state_dict[self.key]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        return tensor

"""The actor's torch_dist checkpoint written as a Hugging Face model directory (``export_hf``).

From a checkpoint written under any parallel layout, it writes safetensors shards with
``model.safetensors.index.json``, ``config.json`` (its dtype set to the weights'),
``generation_config.json`` and the rest of the base model's directory but its weights (tokenizer:
``copy_hf_files``). Tensors are streamed one group at a time (``megatron_bridge.weights.dist_checkpoint``)
straight into their shard files, so memory is bounded by the largest group (one layer's experts of
one projection), not by the model or a shard. One process, no process group. The target is written
beside itself and renamed into place when complete.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import torch

from megatron_bridge.errors import UserError
from megatron_bridge.plan.model_spec import ModelSpec, load_model_spec
from megatron_bridge.weights.dist_checkpoint import DistCheckpoint
from megatron_bridge.weights.hf_checkpoint import INDEX_FILE
from megatron_bridge.weights.load import hf_shape

SHARD_FILE = "model-{index:05d}-of-{count:05d}.safetensors"
SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")


class HFExportError(UserError, ValueError):
    """A base model directory without its config, or a target that is in use; the message names it."""


def copy_hf_files(model_dir: Path, target: Path) -> None:
    """Everything of a HF model directory but its weights: config, generation config, tokenizer."""
    target.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, target / f.name)


def export_hf(checkpoint_dir: Path, target_dir: Path, hf_model_dir: Path, shard_megabytes: float = 5000,
              overwrite: bool = False) -> dict:
    """Write the torch_dist checkpoint in ``checkpoint_dir`` as a HF model in ``target_dir``, with the
    config and tokenizer of the base model in ``hf_model_dir``; returns what was written (tensors,
    bytes, shards)."""
    if not (hf_model_dir / "config.json").is_file():
        raise HFExportError(f"{hf_model_dir}: no config.json (the base model's; pass --hf_model_path)")
    target = _checked_target(target_dir, checkpoint_dir, hf_model_dir, overwrite)
    checkpoint = DistCheckpoint(checkpoint_dir, load_model_spec(str(hf_model_dir)))
    dtype = checkpoint.dtype()
    shards = _plan_shards(checkpoint, dtype, int(shard_megabytes * 2**20))
    tmp = target.parent / f".{target.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        copy_hf_files(hf_model_dir, tmp)
        _write_configs(tmp, dtype)
        stream = checkpoint.stream()
        weight_map, total = {}, 0
        for index, names in enumerate(shards, start=1):
            file = SHARD_FILE.format(index=index, count=len(shards))
            total += _write_shard(tmp / file, names, stream, checkpoint.spec, dtype)
            weight_map.update({name: file for name in names})
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half written
        raise
    if target.exists():  # the previous export, set aside until the new one is in place
        old = target.parent / f".{target.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old)
    else:
        tmp.rename(target)
    return {"tensors": len(weight_map), "bytes": total, "shards": len(shards)}


def _checked_target(target_dir: Path, checkpoint_dir: Path, hf_model_dir: Path, overwrite: bool) -> Path:
    """``target_dir`` as a real path, refused where writing it would remove what the export did
    not write: the working directory, the checkpoint, the base model, a folder holding any of them,
    or (with ``overwrite``) a folder with anything but a previous export in it."""
    target = target_dir.resolve()
    for what, path in (("the current directory", Path.cwd()), ("the checkpoint", checkpoint_dir),
                       ("the base model", hf_model_dir)):
        path = path.resolve()
        if target == path or target in path.parents:
            relation = "is" if target == path else "holds"
            raise HFExportError(f"--target_dir {target_dir} {relation} {what} ({path}), which replacing it would "
                                "remove: name a new directory for the export")
    if not target.exists():
        return target
    if not target.is_dir():
        raise HFExportError(f"--target_dir {target_dir} is a file: name a directory")
    entries = sorted(target.iterdir())
    if entries and not overwrite:
        raise HFExportError(f"--target_dir {target_dir} is not empty (pass --overwrite to replace an earlier export)")
    ours = {"config.json", "generation_config.json", INDEX_FILE,
            *(f.name for f in hf_model_dir.iterdir() if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES))}
    foreign = [e.name + "/" * e.is_dir() for e in entries
               if e.is_dir() or not (e.name in ours or SHARD_PATTERN.fullmatch(e.name))]
    if foreign:
        raise HFExportError(f"--target_dir {target_dir} holds files an export does not write "
                            f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); --overwrite replaces "
                            "only an earlier export: name a new or empty directory")
    return target


def _plan_shards(checkpoint: DistCheckpoint, dtype: torch.dtype, limit: int) -> list[list[str]]:
    """The HF names in stream order, cut into shards of at most ``limit`` bytes (a larger tensor
    gets a shard of its own)."""
    shards, size = [[]], 0
    for name in (n for group in checkpoint.groups for n in group.hf_names):
        nbytes = _nbytes(hf_shape(checkpoint.spec, name), dtype)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * dtype.itemsize


def _write_shard(path: Path, names: list[str], stream, spec: ModelSpec, dtype: torch.dtype) -> int:
    """A safetensors file written as the tensors arrive: its header is known from the shapes, so
    no tensor waits for the others."""
    header, offset = {}, 0
    for name in names:
        shape = hf_shape(spec, name)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + _nbytes(shape, dtype)]}
        offset += _nbytes(shape, dtype)
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for expected in names:
            name, tensor = next(stream)
            if name != expected:
                raise RuntimeError(f"the stream gave {name} where the plan has {expected}")
            f.write(tensor.contiguous().view(torch.uint8).numpy())  # no copy when contiguous
    return offset


def _write_configs(directory: Path, dtype: torch.dtype) -> None:
    """config.json with the weights' dtype; generation_config.json (the base model's, or one
    derived from the config)."""
    from transformers import AutoConfig, GenerationConfig  # seconds to import: only when exporting

    config = AutoConfig.from_pretrained(directory)
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)  # transformers >= 4.56: dtype
    config.save_pretrained(directory)
    if not (directory / "generation_config.json").is_file():
        GenerationConfig.from_model_config(config).save_pretrained(directory)

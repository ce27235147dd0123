"""Export a checkpoint's actor as a Hugging Face model (verl's ``model_merger`` spelling):

    python -m recipe.model_merger merge --backend megatron \\
        --local_dir <run>/checkpoints/global_step_N/actor --target_dir <dir>

From a checkpoint written under any parallel layout (``recipe.driver.checkpoint``), it writes
safetensors shards with ``model.safetensors.index.json``, ``config.json`` (its dtype set to the
weights'), ``generation_config.json`` and the base model's tokenizer, from the
checkpoint's ``huggingface/`` folder. Tensors are streamed one group at a time
(``megatron_bridge.weights.dist_checkpoint``) straight into their shard files, so memory is
bounded by the largest group (one layer's experts of one projection), not by the model or a shard.
No Ray and no process group: one process. The target is written beside itself and renamed into
place when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

import torch

from recipe.driver.checkpoint import ACTOR_DIR, HF_DIR, copy_hf_files

INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = "model-{index:05d}-of-{count:05d}.safetensors"
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class MergeError(ValueError):
    pass


def actor_dir(local_dir: Path) -> Path:
    """The actor checkpoint in ``local_dir``: the directory itself or its ``actor/``."""
    for candidate in (local_dir, local_dir / ACTOR_DIR):
        if (candidate / "metadata.json").is_file():
            return candidate
    raise MergeError(f"--local_dir {local_dir}: not a checkpoint (no metadata.json in it or in its {ACTOR_DIR}/)")


def merge(local_dir: Path, target_dir: Path, hf_model_path: Path | None = None, shard_megabytes: float = 5000,
          overwrite: bool = False) -> dict:
    """Write the HF model; returns what was written (tensors, bytes, shards)."""
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.weights.dist_checkpoint import DistCheckpoint

    actor = actor_dir(local_dir)
    hf = hf_model_path or actor / HF_DIR
    if not (hf / "config.json").is_file():
        raise MergeError(f"{hf}: no config.json (the base model's; pass --hf_model_path)")
    if target_dir.exists() and any(target_dir.iterdir()) and not overwrite:
        raise MergeError(f"--target_dir {target_dir} is not empty (pass --overwrite to replace it)")
    checkpoint = DistCheckpoint(actor, load_model_spec(str(hf)))
    dtype = checkpoint.dtype()
    shards = _plan_shards(checkpoint, dtype, int(shard_megabytes * 2**20))
    tmp = target_dir.parent / f".{target_dir.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        copy_hf_files(hf, tmp)
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
    if target_dir.exists():
        shutil.rmtree(target_dir)
    tmp.rename(target_dir)
    return {"tensors": len(weight_map), "bytes": total, "shards": len(shards)}


def _plan_shards(checkpoint, dtype: torch.dtype, limit: int) -> list[list[str]]:
    """The HF names in stream order, cut into shards of at most ``limit`` bytes (a larger tensor
    gets a shard of its own)."""
    from megatron_bridge.weights.load import hf_shape

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


def _write_shard(path: Path, names: list[str], stream, spec, dtype: torch.dtype) -> int:
    """A safetensors file written as the tensors arrive: its header is known from the shapes, so
    no tensor waits for the others."""
    from megatron_bridge.weights.load import hf_shape

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
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(directory)
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)  # transformers >= 4.56: dtype
    config.save_pretrained(directory)
    if not (directory / "generation_config.json").is_file():
        GenerationConfig.from_model_config(config).save_pretrained(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.model_merger", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    m = commands.add_parser("merge", help="write a checkpoint's actor as a Hugging Face model",
                            description="Write a checkpoint's actor as a Hugging Face model (safetensors).")
    m.add_argument("--backend", required=True, choices=["megatron"],
                   help="the checkpoint's trainer (megatron: the torch_dist checkpoints this package writes)")
    m.add_argument("--local_dir", required=True, type=Path,
                   help="the checkpoint: global_step_N/actor, or global_step_N")
    m.add_argument("--target_dir", required=True, type=Path, help="where the HF model goes (new or empty)")
    m.add_argument("--hf_model_path", type=Path, default=None,
                   help="config and tokenizer from here (default: the checkpoint's actor/huggingface/)")
    m.add_argument("--shard_megabytes", type=float, default=5000, help="largest safetensors shard (default 5000)")
    m.add_argument("--overwrite", action="store_true", help="replace a non-empty --target_dir")
    args = parser.parse_args(argv)
    from megatron_bridge.weights.dist_checkpoint import CheckpointFilesError, CheckpointMismatchError

    try:
        written = merge(args.local_dir, args.target_dir, args.hf_model_path, args.shard_megabytes, args.overwrite)
    except (MergeError, CheckpointMismatchError, CheckpointFilesError) as e:
        print(f"model_merger: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written['tensors']} tensors ({written['bytes'] / 2**20:.1f} MiB) in {written['shards']} "
          f"shard(s) to {args.target_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

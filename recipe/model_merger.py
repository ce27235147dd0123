"""Export a checkpoint's actor as a Hugging Face model (verl's ``model_merger`` spelling):

    python -m recipe.model_merger merge --backend megatron \\
        --local_dir <run>/checkpoints/global_step_N/actor --target_dir <dir>

From a checkpoint written under any parallel layout (``recipe.run_dir``), it writes
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
import sys
from pathlib import Path

from megatron_bridge.weights.dist_checkpoint import CheckpointFilesError, CheckpointMismatchError
from megatron_bridge.weights.hf_export import HFExportError, export_hf
from recipe.run_dir import ACTOR_DIR, HF_DIR


def actor_dir(local_dir: Path) -> Path:
    """The actor checkpoint in ``local_dir``: the directory itself or its ``actor/``."""
    for candidate in (local_dir, local_dir / ACTOR_DIR):
        if (candidate / "metadata.json").is_file():
            return candidate
    raise HFExportError(f"--local_dir {local_dir}: not a checkpoint (no metadata.json in it or in its {ACTOR_DIR}/)")


def merge(local_dir: Path, target_dir: Path, hf_model_path: Path | None = None, shard_megabytes: float = 5000,
          overwrite: bool = False) -> dict:
    """Write the HF model of the checkpoint in ``local_dir`` (a ``global_step_N`` or its ``actor/``), with
    the config and tokenizer of ``hf_model_path`` (default: the checkpoint's ``actor/huggingface/``);
    returns what was written (tensors, bytes, shards)."""
    actor = actor_dir(local_dir)
    return export_hf(actor, target_dir, hf_model_path or actor / HF_DIR, shard_megabytes, overwrite)


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
    try:
        written = merge(args.local_dir, args.target_dir, args.hf_model_path, args.shard_megabytes, args.overwrite)
    except (HFExportError, CheckpointMismatchError, CheckpointFilesError) as e:
        print(f"model_merger: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written['tensors']} tensors ({written['bytes'] / 2**20:.1f} MiB) in {written['shards']} "
          f"shard(s) to {args.target_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

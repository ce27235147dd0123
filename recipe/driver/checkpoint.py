"""A checkpoint's writing and reading by the workers, around the run directory's format
(``recipe.run_dir``): the actor's reshardable checkpoint written by every rank into the staging
directory, the base model's config and tokenizer and the driver's state beside it, an optional HF
export, and the load under any layout; the run's provenance as the workers fingerprint the weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_bridge.weights.hf_export import copy_hf_files, export_hf
from recipe import run_dir
from recipe.run_dir import ACTOR_DIR, HF_DIR, TRAINER_STATE
from recipe.workers.rank import Rank

if TYPE_CHECKING:
    from recipe.workers.group import WorkerGroup


def load(workers: WorkerGroup, checkpoint: Path) -> tuple[dict, bool]:
    """Every worker loads its part of the actor checkpoint, whatever layout wrote it; the driver's
    state as saved, and whether the workers' RNG states came back (same layout only)."""
    state = run_dir.trainer_state(checkpoint)
    restored = workers.call(Rank.load, [(str(checkpoint / ACTOR_DIR),)] * workers.world_size, "checkpoint load")
    return state, all(restored)


def start_save(workers: WorkerGroup, directory: Path, step: int, state: dict, model_dir: str) -> Path:
    """The workers write the actor checkpoint into the staging directory (in the background with
    ``actor.checkpoint.async_save``), beside the base model's config and tokenizer (from
    ``model_dir``) and the driver's ``state``. Returns the staging directory: ``finish_save``
    completes it and ``run_dir.publish`` renames it into place."""
    tmp = run_dir.staging(directory, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    workers.call(Rank.save, [(str(tmp / ACTOR_DIR),)] * workers.world_size, "checkpoint save")
    copy_hf_files(Path(model_dir), tmp / ACTOR_DIR / HF_DIR)
    (tmp / TRAINER_STATE).write_text(json.dumps(state))
    return tmp


def finish_save(workers: WorkerGroup, tmp: Path, hf_model_from: str | None = None) -> Path:
    """Wait for the workers' files in ``tmp``: complete, not yet in place (``run_dir.publish``). With
    ``hf_model_from`` (the base model's directory: config and tokenizer), the checkpoint's weights
    are exported into ``actor/huggingface/`` first, as ``recipe.model_merger`` would (verl's
    ``checkpoint.save_contents`` with ``hf_model``)."""
    workers.call(Rank.finish_save, phase="checkpoint save")
    if hf_model_from is not None:
        export_hf(tmp / ACTOR_DIR, tmp / ACTOR_DIR / HF_DIR, Path(hf_model_from), overwrite=True)
    return tmp


def record_provenance(directory: Path, workers: WorkerGroup, model_dir: str, trainer_seed: int, data_seed: int,
                      total_steps: int) -> None:
    """What a comparison needs to show that runs started alike: the initial weights' fingerprint per
    rank (the checkpoint as loaded, before any resume) and the seeds. Kept from the run's first start."""
    if (directory / run_dir.PROVENANCE_FILE).is_file():
        return
    fingerprints = workers.call(Rank.weights_fingerprint, phase="weights fingerprint")
    run_dir.write_provenance(directory, {"model_dir": model_dir, "initial_weights_fingerprint": fingerprints,
                                         "trainer_seed": trainer_seed, "data_seed": data_seed,
                                         "total_steps": total_steps})

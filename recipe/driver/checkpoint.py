"""What a run keeps on disk besides its metrics: checkpoints (every worker's shard and the driver's
state, renamed into place once complete), which one to resume from, and the run's provenance.

``<run dir>/checkpoints/global_step_K/``: one file per rank (``recipe.workers.actor``) and
``trainer_state.json`` (step, sampler position, KL coefficient); ``<run dir>/provenance.json``:
the initial weights' fingerprint and the seeds, written at the run's first start.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from megatron_bridge.errors import ConfigError
from recipe.config import TrainerConfig
from recipe.workers.group import WorkerGroup

CHECKPOINT_PREFIX = "global_step_"
PROVENANCE_FILE = "provenance.json"
TRAINER_STATE = "trainer_state.json"


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a temporary one has another name until it is renamed)."""
    found = [p for p in directory.glob(f"{CHECKPOINT_PREFIX}*")
             if p.name[len(CHECKPOINT_PREFIX):].isdigit() and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def to_resume(t: TrainerConfig, directory: Path) -> Path | None:
    """The checkpoint ``trainer.resume_mode`` asks for: none, the given path, or the latest in ``directory``."""
    if t.resume_mode == "disable":
        return None
    if t.resume_mode == "resume_path":
        path = Path(t.resume_from_path)
        if not (path / TRAINER_STATE).is_file():
            what = f"has no {TRAINER_STATE}" if path.is_dir() else "does not exist"
            raise ConfigError(f"trainer.resume_from_path={path} {what}: give a checkpoint directory "
                              f"(<run dir>/checkpoints/{CHECKPOINT_PREFIX}K)")
        return path
    done = checkpoints(directory)
    return done[-1] if done else None


def rerun_note(t: TrainerConfig, directory: Path) -> str:
    """Where a re-run of the same command resumes: the checkpoint ``to_resume`` picks now, and its step."""
    resume = to_resume(t, directory)
    if resume is None:
        why = "trainer.resume_mode=disable" if t.resume_mode == "disable" else f"no checkpoint in {directory}"
        return f"a re-run starts fresh ({why})"
    step = json.loads((resume / TRAINER_STATE).read_text())["step"]
    return f"a re-run resumes from {resume} (step {step})"


def remove_stale(directory: Path) -> list[Path]:
    """Remove the temporary checkpoints of saves that never finished (a killed run's); the removed."""
    stale = sorted(p for p in directory.glob(f".{CHECKPOINT_PREFIX}*.tmp") if p.is_dir())
    for path in stale:
        shutil.rmtree(path)
    return stale


def load(workers: WorkerGroup, checkpoint: Path) -> dict:
    """Every worker loads its shard; the driver's state as saved."""
    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    workers.call("load", [(str(checkpoint),)] * workers.world_size, "checkpoint load")
    return state


def save(workers: WorkerGroup, directory: Path, step: int, state: dict, keep: int) -> Path:
    """Every worker writes its shard into a temporary directory, which is renamed into place once
    complete with the driver's ``state``; checkpoints beyond the last ``keep`` are removed (0: none)."""
    final = directory / f"{CHECKPOINT_PREFIX}{step}"
    tmp = directory / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    workers.call("save", [(str(tmp),)] * workers.world_size, "checkpoint save")
    (tmp / TRAINER_STATE).write_text(json.dumps(state))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for old in checkpoints(directory)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def record_provenance(run_dir: Path, workers: WorkerGroup, model_dir: str, trainer_seed: int, data_seed: int,
                      total_steps: int) -> None:
    """What a comparison needs to show that runs started alike: the initial weights' fingerprint per
    rank (the checkpoint as loaded, before any resume) and the seeds. Kept from the run's first start."""
    path = run_dir / PROVENANCE_FILE
    if path.is_file():
        return
    fingerprints = workers.call("weights_fingerprint", phase="weights fingerprint")
    path.write_text(json.dumps({"model_dir": model_dir, "initial_weights_fingerprint": fingerprints,
                                "trainer_seed": trainer_seed, "data_seed": data_seed, "total_steps": total_steps},
                               indent=2))

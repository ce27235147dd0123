"""What a run keeps on disk besides its metrics: checkpoints (the actor's reshardable checkpoint and
the driver's state, renamed into place once complete), which one to resume from, and the run's
provenance.

``<run dir>/checkpoints/global_step_K/`` (as verl lays out its Megatron checkpoints):

- ``actor/``: megatron-core's torch_dist checkpoint written by all ranks together
  (``megatron_bridge.runtime.checkpoint``), loadable under any parallel layout;
- ``actor/huggingface/``: the base model's config and tokenizer files (what an HF export needs
  besides the weights: ``python -m recipe.model_merger``);
- ``trainer_state.json``: step, sampler position, adaptive KL coefficient.

``<run dir>/provenance.json``: the initial weights' fingerprint and the seeds, written at the
run's first start.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_bridge.errors import ConfigError
from megatron_bridge.weights.dist_checkpoint import damage as actor_damage
from megatron_bridge.weights.hf_export import copy_hf_files, export_hf
from recipe.config import TrainerConfig

if TYPE_CHECKING:
    from recipe.workers.group import WorkerGroup

ACTOR_DIR = "actor"
HF_DIR = "huggingface"
CHECKPOINT_PREFIX = "global_step_"
PROVENANCE_FILE = "provenance.json"
TRAINER_STATE = "trainer_state.json"


def step_dirs(directory: Path) -> list[Path]:
    """The ``global_step_K`` directories, oldest first (a temporary one has another name until it
    is renamed, a damaged one set aside too)."""
    found = [p for p in directory.glob(f"{CHECKPOINT_PREFIX}*")
             if p.is_dir() and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return [p for p in step_dirs(directory) if (p / TRAINER_STATE).is_file()]


def damage(checkpoint: Path) -> list[str]:
    """Why ``checkpoint`` cannot be resumed from, each reason beginning with the file's name (empty:
    it is intact as far as the files and the format's metadata tell, without reading the tensors)."""
    found = []
    try:
        state = json.loads((checkpoint / TRAINER_STATE).read_text())
        if not isinstance(state, dict) or not {"step", "sampler"} <= state.keys():
            found.append(f"{TRAINER_STATE} lacks the step or the sampler's position")
    except FileNotFoundError:
        found.append(f"{TRAINER_STATE} is missing")
    except (ValueError, OSError):  # a truncated file, or bytes that are not text
        found.append(f"{TRAINER_STATE} cannot be read as JSON")
    actor = checkpoint / ACTOR_DIR
    if not actor.is_dir():
        return found + [f"{ACTOR_DIR}/ is missing"]
    return found + [f"{ACTOR_DIR}/{d}" for d in actor_damage(actor)]


def resume_point(t: TrainerConfig, directory: Path) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """The checkpoint ``trainer.resume_mode`` asks for (none, the given path, or the newest intact
    one in ``directory``), and the newer ones skipped as damaged, with why. A ``resume_from_path``
    that is not a complete checkpoint is a config error naming what it lacks."""
    if t.resume_mode == "disable":
        return None, []
    if t.resume_mode == "resume_path":
        path = Path(t.resume_from_path)
        if not path.is_dir():
            raise ConfigError(f"trainer.resume_from_path={path} does not exist: give a checkpoint directory "
                              f"(<run dir>/checkpoints/{CHECKPOINT_PREFIX}K)")
        found = damage(path)
        if found:
            raise ConfigError(f"trainer.resume_from_path={path} is not a complete checkpoint: {'; '.join(found)}; "
                              f"give another one (<run dir>/checkpoints/{CHECKPOINT_PREFIX}K)")
        return path, []
    skipped = []
    for path in reversed(step_dirs(directory)):
        found = damage(path)
        if not found:
            return path, skipped
        skipped.append((path, found))
    return None, skipped


def to_resume(t: TrainerConfig, directory: Path) -> Path | None:
    """The checkpoint a start with ``t`` resumes from (``resume_point``)."""
    return resume_point(t, directory)[0]


def set_aside(checkpoint: Path) -> Path:
    """Rename a damaged checkpoint out of the way of resume and retention (kept for inspection)."""
    target = checkpoint.with_name(checkpoint.name + ".damaged")
    n = 1
    while target.exists():
        n += 1
        target = checkpoint.with_name(f"{checkpoint.name}.damaged{n}")
    os.rename(checkpoint, target)
    return target


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


def load(workers: WorkerGroup, checkpoint: Path) -> tuple[dict, bool]:
    """Every worker loads its part of the actor checkpoint, whatever layout wrote it; the driver's
    state as saved, and whether the workers' RNG states came back (same layout only)."""
    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    restored = workers.call("load", [(str(checkpoint / ACTOR_DIR),)] * workers.world_size, "checkpoint load")
    return state, all(restored)


def start_save(workers: WorkerGroup, directory: Path, step: int, state: dict, model_dir: str) -> Path:
    """The workers write the actor checkpoint into a temporary directory (in the background with
    ``actor.checkpoint.async_save``), beside the base model's config and tokenizer (from
    ``model_dir``) and the driver's ``state``. Returns the temporary directory: ``finish_save``
    completes it and ``publish`` renames it into place, so an unfinished save is never resumed from."""
    final = directory / f"{CHECKPOINT_PREFIX}{step}"
    tmp = directory / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    workers.call("save", [(str(tmp / ACTOR_DIR),)] * workers.world_size, "checkpoint save")
    copy_hf_files(Path(model_dir), tmp / ACTOR_DIR / HF_DIR)
    (tmp / TRAINER_STATE).write_text(json.dumps(state))
    return tmp


def finish_save(workers: WorkerGroup, tmp: Path, hf_model_from: str | None = None) -> Path:
    """Wait for the workers' files in ``tmp``: complete, not yet in place (``publish``). With
    ``hf_model_from`` (the base model's directory: config and tokenizer), the checkpoint's weights
    are exported into ``actor/huggingface/`` first, as ``recipe.model_merger`` would (verl's
    ``checkpoint.save_contents`` with ``hf_model``)."""
    workers.call("finish_save", phase="checkpoint save")
    if hf_model_from is not None:
        export_hf(tmp / ACTOR_DIR, tmp / ACTOR_DIR / HF_DIR, Path(hf_model_from), overwrite=True)
    return tmp


def publish(tmp: Path, keep: int) -> Path:
    """Rename the complete checkpoint in ``tmp`` into place, where a re-run resumes from it;
    checkpoints beyond the last ``keep`` are removed (0: none)."""
    final = tmp.parent / tmp.name[1 : -len(".tmp")]
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for old in checkpoints(tmp.parent)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def disk_bytes(checkpoint: Path) -> int:
    """What a checkpoint occupies on disk: the bytes its files hold."""
    return sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())


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

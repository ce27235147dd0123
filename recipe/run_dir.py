"""A run's directory on disk, as the trainer writes it and ``evaluate``, ``compare`` and
``model_merger`` read it:

- ``config.json``: the resolved config (``CONFIG_FILE``);
- ``provenance.json``: the initial weights' fingerprint per rank and the seeds, from the run's first
  start (``PROVENANCE_FILE``);
- ``metrics.jsonl`` (``recipe.tracking.loggers.METRICS_FILE``) and ``reward_curve.txt``;
- ``checkpoints/global_step_K/`` (as verl lays out its Megatron checkpoints):

  - ``actor/``: megatron-core's torch_dist checkpoint written by all ranks together
    (``megatron_bridge.runtime.checkpoint``), loadable under any parallel layout;
  - ``actor/huggingface/``: the base model's config and tokenizer files (what an HF export needs
    besides the weights: ``python -m recipe.model_merger``);
  - ``trainer_state.json``: step, sampler position, adaptive KL coefficient.

One run at a time: a run holds ``.run.lock`` in its directory for its life (``hold``).

A checkpoint is written into ``checkpoints/.global_step_K.tmp`` and renamed into place once
complete (``publish``), so an unfinished save is never resumed from. Writing a checkpoint takes the
workers: ``recipe.driver.checkpoint``. Importing this module is cheap (what reads a checkpoint's
metadata is imported when asked for): the commands' ``--help`` uses it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING

from megatron_bridge.atomic import write_text
from megatron_bridge.errors import ConfigError

if TYPE_CHECKING:
    from recipe.config import TrainerConfig

CONFIG_FILE = "config.json"
PROVENANCE_FILE = "provenance.json"
REWARD_CURVE_FILE = "reward_curve.txt"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "global_step_"
ACTOR_DIR = "actor"
HF_DIR = "huggingface"
TRAINER_STATE = "trainer_state.json"
LOCK_FILE = ".run.lock"


class RunDirInUse(ConfigError):
    """Another run holds the run directory; the message names it."""


_held: dict[Path, tuple[IO[str], int]] = {}  # this process's holds: lock file, depth


@contextmanager
def hold(directory: Path) -> Iterator[None]:
    """Hold ``directory`` for this process's run, or refuse naming the run that holds it. The hold is
    an exclusive ``flock`` on its ``LOCK_FILE``, which the kernel drops when the process ends however it
    ends, so a dead run's lock is no lock; the holder's pid, host and start are written in it for the
    message. Where the file system has no locks (some network file systems) the record decides: a
    live pid on this host, or any record from another host, holds it. Nested holds of one process
    (``recipe.compare`` around ``train``) are one."""
    directory = directory.resolve()
    if directory in _held:
        file, depth = _held[directory]
        _held[directory] = (file, depth + 1)
        try:
            yield
        finally:
            _held[directory] = (file, depth)
        return
    directory.mkdir(parents=True, exist_ok=True)
    file = open(directory / LOCK_FILE, "a+")
    try:
        _lock(file, directory)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        file.seek(0)
        file.truncate()
        file.write(json.dumps(me) + "\n")
        file.flush()
    except BaseException:
        file.close()
        raise
    _held[directory] = (file, 1)
    try:
        yield
    finally:
        del _held[directory]
        file.truncate(0)  # no record: where there are no locks, the record is the lock
        file.close()  # drops the lock


def check_free(directory: Path) -> None:
    """Refuse now if another run holds ``directory`` (for a command that starts a run elsewhere)."""
    if directory.is_dir():
        with hold(directory):
            pass


def _lock(file: IO[str], directory: Path) -> None:
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        holder, gone = _holder(file), ""
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        holder = _holder(file)
        if not holder or (holder.get("host") == socket.gethostname() and not _alive(holder.get("pid"))):
            return  # no record, or one of a run on this host that has ended
        gone = f"; if that run has ended, remove {directory / LOCK_FILE}"
    who = (f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}" if holder
           else "its record is not written yet")
    raise RunDirInUse(f"trainer.default_local_dir={directory} is in use by another run ({who}): wait for it to end, "
                      f"stop it, or give this run another trainer.default_local_dir{gone}")


def _holder(file: IO[str]) -> dict:
    file.seek(0)
    try:
        return json.loads(file.read() or "{}")
    except ValueError:
        return {}


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def staging(directory: Path, step: int) -> Path:
    """Where step ``step``'s checkpoint is written before ``publish`` puts it in place."""
    return directory / f".{CHECKPOINT_PREFIX}{step}.tmp"


def step_dirs(directory: Path) -> list[Path]:
    """The ``global_step_K`` directories, oldest first (a temporary one has another name until it
    is renamed, a damaged one set aside too)."""
    found = [p for p in directory.glob(f"{CHECKPOINT_PREFIX}*")
             if p.is_dir() and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return [p for p in step_dirs(directory) if (p / TRAINER_STATE).is_file()]


def trainer_state(checkpoint: Path) -> dict:
    """The driver's state saved with ``checkpoint``."""
    return json.loads((checkpoint / TRAINER_STATE).read_text())


def damage(checkpoint: Path) -> list[str]:
    """Why ``checkpoint`` cannot be resumed from, each reason beginning with the file's name (empty:
    it is intact as far as the files and the format's metadata tell, without reading the tensors)."""
    from megatron_bridge.weights.dist_checkpoint import damage as actor_damage  # torch.distributed.checkpoint: seconds

    found = []
    try:
        state = trainer_state(checkpoint)
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
        if path.exists() and not path.is_dir():
            raise ConfigError(f"trainer.resume_from_path={path} is a file, not a checkpoint directory: give a checkpoint "
                              f"directory (<run dir>/{CHECKPOINTS_DIR}/{CHECKPOINT_PREFIX}K)")
        if not path.is_dir():
            raise ConfigError(f"trainer.resume_from_path={path} does not exist: give a checkpoint directory "
                              f"(<run dir>/{CHECKPOINTS_DIR}/{CHECKPOINT_PREFIX}K)")
        found = damage(path)
        if found:
            raise ConfigError(f"trainer.resume_from_path={path} is not a complete checkpoint: {'; '.join(found)}; "
                              f"give another one (<run dir>/{CHECKPOINTS_DIR}/{CHECKPOINT_PREFIX}K)")
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
    return f"a re-run resumes from {resume} (step {trainer_state(resume)['step']})"


def remove_stale(directory: Path) -> list[Path]:
    """Remove the temporary checkpoints of saves that never finished (a killed run's); the removed."""
    stale = sorted(p for p in directory.glob(f".{CHECKPOINT_PREFIX}*.tmp") if p.is_dir())
    for path in stale:
        shutil.rmtree(path)
    return stale


def publish(tmp: Path, keep: int) -> Path:
    """Rename the complete checkpoint in ``tmp`` (``staging``) into place, where a re-run resumes
    from it; checkpoints beyond the last ``keep`` are removed (0: none)."""
    final = tmp.parent / tmp.name[1 : -len(".tmp")]
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for old in checkpoints(tmp.parent)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def disk_bytes(checkpoint: Path) -> int:
    """What a checkpoint occupies on disk: the bytes its files hold."""
    return sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())


def write_provenance(directory: Path, record: dict) -> None:
    """``record`` as the run's provenance (the trainer writes it at the run's first start only)."""
    write_text(directory / PROVENANCE_FILE, json.dumps(record, indent=2))

"""One run per directory (``recipe.run_dir.hold``): a second run, comparison or launcher on a
directory another process holds is one line naming that process, and touches nothing; the lock of
a run that died is no lock."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recipe import run_dir
from recipe.run_dir import LOCK_FILE, RunDirInUse, check_free, hold
from tests.recipe_runs import REPO, TINY, main_in_process


def holder(directory: Path) -> subprocess.Popen:
    """Another process holding ``directory`` until killed (as a running trainer does)."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from recipe.run_dir import hold
        with hold(Path({str(directory)!r})):
            print("held", flush=True)
            time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


@pytest.fixture
def held(tmp_path):
    proc = holder(tmp_path / "run")
    yield tmp_path / "run", proc
    proc.kill()
    proc.wait()


def in_use(directory: Path, pid: int) -> str:
    return (f"trainer.default_local_dir={directory} is in use by another run (pid {pid} on {socket.gethostname()}, "
            "since ")


def test_a_held_directory_is_refused_naming_the_holder_and_a_dead_holders_lock_is_free(held):
    directory, proc = held
    with pytest.raises(RunDirInUse) as info:
        with hold(directory):
            pytest.fail("held twice")
    assert str(info.value).startswith(in_use(directory, proc.pid))
    assert str(info.value).endswith("): wait for it to end, stop it, or give this run another trainer.default_local_dir")
    proc.send_signal(signal.SIGKILL)  # no clean-up of its own: the kernel drops the lock
    proc.wait()
    with hold(directory):
        record = json.loads((directory / LOCK_FILE).read_text())
        assert (record["pid"], record["host"]) == (os.getpid(), socket.gethostname())
        with hold(directory):  # nested in one process (compare around its trainer): one hold
            pass
        other = subprocess.run([sys.executable, "-c", f"from pathlib import Path; from recipe.run_dir import check_free; "
                                f"check_free(Path({str(directory)!r}))"], cwd=REPO, capture_output=True, text=True)
        assert other.returncode == 1 and in_use(directory, os.getpid()) in other.stderr  # still held after the nested one
    check_free(directory)  # released at the end


def test_without_file_locks_the_record_decides(tmp_path, monkeypatch):
    """Where the file system has no locks: a live pid on this host holds the directory (the message
    says how to clear a record left by a run that has ended), a dead one does not."""

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_dir.fcntl, "flock", no_locks)
    directory = tmp_path / "run"
    directory.mkdir()
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        record = {"pid": sleeper.pid, "host": socket.gethostname(), "since": "2026-01-01 00:00:00"}
        (directory / LOCK_FILE).write_text(json.dumps(record))
        with pytest.raises(RunDirInUse, match=re.escape(f"; if that run has ended, remove {directory / LOCK_FILE}")):
            check_free(directory)
    finally:
        sleeper.kill()
        sleeper.wait()
    with hold(directory):
        assert json.loads((directory / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert (directory / LOCK_FILE).read_text() == ""  # released: no record left to refuse the next run


def test_a_second_run_on_a_held_directory_changes_nothing(held, capsys):
    """The second run would have removed the first's unfinished checkpoint as stale and rewritten
    its config: refused before it reads or writes anything, exit 2."""
    directory, proc = held
    unfinished = directory / "checkpoints" / ".global_step_6.tmp"
    unfinished.mkdir(parents=True)
    (directory / "config.json").write_text("the first run's")
    out = main_in_process(["--config", TINY["gspo"], f"trainer.default_local_dir={directory}"], capsys)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1].startswith("error: " + in_use(directory, proc.pid))
    assert unfinished.is_dir() and (directory / "config.json").read_text() == "the first run's"
    assert "workers:" not in out.stdout


def test_a_comparison_and_the_launcher_refuse_a_held_run_directory(tmp_path, capsys):
    from recipe.cluster import main as cluster_main
    from recipe.compare.runs import main as compare_main

    out = tmp_path / "cmp"
    proc = holder(out / "grpo" / "seed_1")
    try:
        assert compare_main(["--config", TINY["grpo"], "--variants", "grpo", "--out", str(out),
                             "trainer.total_training_steps=1"]) == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith("error: " + in_use(out / "grpo" / "seed_1", proc.pid))
        assert sorted(p.name for p in (out / "grpo" / "seed_1").iterdir()) == [LOCK_FILE]  # no variant.json written
        assert cluster_main(["prepare", "--recipe", "tiny_grpo", "--out-dir", str(tmp_path / "job"), "--",
                             f"trainer.default_local_dir={out / 'grpo' / 'seed_1'}"]) == 2
        assert in_use(out / "grpo" / "seed_1", proc.pid) in capsys.readouterr().err
    finally:
        proc.kill()
        proc.wait()

"""SIGTERM and SIGINT stop the tiny CPU recipe (real Ray workers, megatron-core on gloo ranks)
cleanly, with one line saying where a re-run resumes, under a cluster of its own or a joined one
(``ray job submit``); a re-run resumes there; a damaged checkpoint is skipped or refused. The runs take
one training rank (``ONE_TRAIN_RANK``): the subject is the stop, not the training pool."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.distributed import free_port
from tests.recipe_runs import ONE_TRAIN_RANK, REPO, TINY, metrics, run_main

# Every process the driver starts (Ray's and its workers) inherits its environment: a unique value
# of this variable finds them in /proc, and no other run's.
TAG = "MOE_RL_TEST_RUN"
RUN_S = 600  # hang guard for a tiny run and the signal's stop (a step takes seconds)


def tagged(tag: str) -> list[int]:
    """Live processes whose environment has TAG=tag."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone, or not ours to read
            pass
    return found


def signalled_run(args: list[str], marker: str, signals: list[int], tmp_path: Path,
                  env: dict[str, str] | None = None, group: bool = False,
                  timing: dict | None = None) -> tuple[int, str, str]:
    """Run ``recipe.main`` (with ``env`` added to its environment); when its output has a line
    starting with ``marker`` (the per-step line of a step, so the driver is in the next one, which
    takes seconds), send ``signals`` to the driver 0.5 s apart (``group``: to its whole process
    group, Ray's local processes too, as a scheduler's cancel does). Returns the exit status, stdout
    and stderr, after checking that no process the run started is left; ``timing["exit_s"]``: from
    the last signal to the driver's exit."""
    tag = uuid.uuid4().hex
    env = {**os.environ, **(env or {}), TAG: tag, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "stderr.txt", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "recipe.main", *args], cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        guard = threading.Timer(RUN_S, os.killpg, (proc.pid, signal.SIGKILL))
        guard.start()
        try:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if line.startswith(marker):
                    for i, signum in enumerate(signals):
                        time.sleep(0.5 * (i > 0))
                        os.killpg(proc.pid, signum) if group else proc.send_signal(signum)
                    signalled = time.monotonic()
                    code = proc.wait()  # the driver's own exit (a few lines after the signal fit the pipe)
                    if timing is not None:
                        timing["exit_s"] = time.monotonic() - signalled
                    break
            lines += proc.stdout.readlines()
            code = proc.wait()
        finally:
            guard.cancel()
        deadline = time.time() + 60  # Ray's processes end within seconds of the driver
        while tagged(tag) and time.time() < deadline:
            time.sleep(1)
        left = tagged(tag)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        err.seek(0)
        stderr = err.read()
    assert any(line.startswith(marker) for line in lines), "".join(lines) + stderr[-3000:]
    assert not left, f"processes the run started are still alive: {left}"
    return code, "".join(lines), stderr


def assert_clean_stop(stderr: str, line: str) -> None:
    """No traceback, no Ray stack dump, and the stop's line as given."""
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert [s for s in stderr.splitlines() if s.startswith("stopped by")] == [line], stderr


STEPS = ["--config", TINY["gspo"], "trainer.test_freq=-1", "trainer.val_before_train=false", *ONE_TRAIN_RANK]


@pytest.mark.slow
def test_sigterm_to_the_process_group_stops_cleanly(tmp_path):
    """SIGTERM to the driver's whole process group (a scheduler's cancel, `timeout`, a container's
    stop): Ray's local processes end with it, and the driver still exits 143 with the resume line,
    well within a scheduler's grace period (about 30 s), instead of waiting 60 s for Ray's GCS. (A
    re-run after a stop: test_sigint_twice_stops_once_and_a_damaged_checkpoint_is_skipped.)"""
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    timing = {}
    code, _, stderr = signalled_run(STEPS + ["trainer.save_freq=2", "trainer.total_training_steps=8",
                                             f"trainer.default_local_dir={run}"], "step 3 |", [signal.SIGTERM], tmp_path,
                                    group=True, timing=timing)
    assert code == 143, stderr[-3000:]
    assert timing["exit_s"] < 30 and "Failed to connect to GCS" not in stderr, (timing, stderr[-3000:])
    # the last completed step and the checkpoint a re-run takes are not the same here
    assert_clean_stop(stderr, f"stopped by SIGTERM; last completed step: 3; a re-run resumes from "
                              f"{ckpt / 'global_step_2'} (step 2)")
    assert [p.name for p in ckpt.iterdir()] == ["global_step_2"]


@pytest.mark.slow
def test_sigterm_with_a_grace_period_saves_at_the_step_end(tmp_path):
    run = tmp_path / "run"
    code, _, stderr = signalled_run(STEPS + [
        "trainer.save_freq=-1", "trainer.total_training_steps=8", "trainer.save_on_sigterm_grace_s=600",
        f"trainer.default_local_dir={run}"], "step 1 |", [signal.SIGTERM], tmp_path)
    assert code == 143
    # the signal lands at the end of step 1 (between its line and the step's end) or during step 2:
    # the run stops after that step, with its checkpoint
    step = 2 if "last completed step: 2;" in stderr else 1
    assert_clean_stop(stderr, f"stopped by SIGTERM (checkpoint saved at the end of the step); last completed step: "
                              f"{step}; a re-run resumes from {run / 'checkpoints' / f'global_step_{step}'} (step {step})")
    assert sorted(metrics(run)) == list(range(1, step + 1))


@pytest.mark.slow
def test_sigint_twice_stops_once_and_a_damaged_checkpoint_is_skipped(tmp_path):
    """The second SIGINT comes while the first one's shutdown runs (it takes seconds): ignored. The
    checkpoints left then serve the faults of a resume: what a run killed in a save leaves is
    removed; the newest checkpoint cut short is skipped (named, with why, and moved aside) for the
    one before it; one whose bytes are corrupt passes the metadata's checks, and the workers that
    read it refuse in one line."""
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    args = STEPS + ["trainer.save_freq=1", f"trainer.default_local_dir={run}"]
    code, _, stderr = signalled_run(args + ["trainer.total_training_steps=8"], "step 2 |",
                                    [signal.SIGINT, signal.SIGINT], tmp_path)
    assert code == 130
    assert_clean_stop(stderr, f"stopped by SIGINT; last completed step: 2; a re-run resumes from "
                              f"{ckpt / 'global_step_2'} (step 2)")

    shard = sorted((ckpt / "global_step_2" / "actor").glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])  # what a full disk or a lost node leaves
    (ckpt / ".global_step_3.tmp").mkdir()  # what a run killed in a save leaves
    out = run_main(args + ["trainer.total_training_steps=2"], timeout=RUN_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"removed {ckpt / '.global_step_3.tmp'}" in out.stdout and not (ckpt / ".global_step_3.tmp").exists()
    assert re.search(rf"skipped {re.escape(str(ckpt / 'global_step_2'))}: actor/{shard.name} has 100 bytes, its "
                     rf"metadata places \d+; moved to {re.escape(str(ckpt / 'global_step_2.damaged'))}\n", out.stdout)
    assert f"resumed from {ckpt / 'global_step_1'} (step 1)" in out.stdout
    assert sorted(metrics(run)) == [1, 2]

    shard = sorted((ckpt / "global_step_2" / "actor").glob("*.distcp"))[-1]  # the re-run's
    shard.write_bytes(bytes(shard.stat().st_size))
    out = run_main(args + ["trainer.total_training_steps=3"], timeout=RUN_S)
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"error: checkpoint {ckpt / 'global_step_2' / 'actor'} is damaged: " in out.stderr, out.stderr
    assert re.search(r"\n  \(raised by worker rank \d on node [\d.]+(, worker rank \d on node [\d.]+)? during "
                     r"checkpoint load\)\n$", out.stderr), out.stderr
    assert "Traceback" not in out.stderr and "RayTaskError" not in out.stderr


@pytest.mark.slow
def test_sigterm_under_a_joined_cluster_leaves_the_cluster_up(tmp_path):
    """As under ``ray job submit`` (RAY_ADDRESS set): the stopped driver ends its workers and
    disconnects; the cluster's processes stay, with every CPU free again."""
    port = free_port()
    cluster = uuid.uuid4().hex
    # the head and its clients share Ray's auth token, as the launchers arrange (launch/common.sh)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex + uuid.uuid4().hex}
    head_log = open(tmp_path / "head.txt", "w+")
    head = subprocess.Popen(["ray", "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false",
                             "--disable-usage-stats", "--block"], env={**os.environ, **auth, TAG: cluster},
                            stdout=head_log, stderr=subprocess.STDOUT, start_new_session=True)
    client = {**auth, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    probe = [sys.executable, "-c", "import ray; ray.init(); r = ray.available_resources(); "
             "print(r.get('CPU', 0), ray.cluster_resources()['CPU'])"]

    def free_cpus() -> list[str]:
        """The cluster's free and total CPUs, as a new client sees them; [] while it cannot connect."""
        try:
            return subprocess.run(probe, env={**os.environ, **client}, capture_output=True, text=True,
                                  timeout=60).stdout.split()
        except subprocess.TimeoutExpired:
            return []

    try:
        # the cluster up before the run joins it (on a loaded machine the head takes a while)
        deadline = time.time() + RUN_S
        while free_cpus() != ["4.0", "4.0"]:
            head_log.seek(0)
            assert head.poll() is None and time.time() < deadline, f"the Ray head did not come up:\n{head_log.read()}"
            time.sleep(2)
        run = tmp_path / "run"
        code, _, stderr = signalled_run(STEPS + [
            "trainer.save_freq=1", "trainer.total_training_steps=8", f"trainer.default_local_dir={run}"],
            "step 1 |", [signal.SIGTERM], tmp_path, env=client)
        assert code == 143
        assert_clean_stop(stderr, f"stopped by SIGTERM; last completed step: 1; a re-run resumes from "
                                  f"{run / 'checkpoints' / 'global_step_1'} (step 1)")
        assert head.poll() is None
        deadline = time.time() + 60  # Ray frees a gone driver's resources within seconds
        while (free := free_cpus()) != ["4.0", "4.0"]:
            assert time.time() < deadline, free
            time.sleep(2)
    finally:
        head.terminate()
        head.wait(timeout=RUN_S)
        head_log.close()
        for pid in tagged(cluster):
            os.kill(pid, signal.SIGKILL)

"""The tiny CPU recipe end to end: real Ray workers, megatron-core on gloo ranks, the transformers
rollout engine, the built-in task. Learning, resume, signals, DP invariance, dead workers, bad inputs."""

from __future__ import annotations

import json
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
import torch

from recipe.tracking.loggers import read_jsonl

REPO = Path(__file__).resolve().parents[1]
TINY = {"gspo": "configs/recipe/tiny_gspo.yaml", "grpo": "configs/recipe/tiny_grpo.yaml"}
# metrics that measure the machine, not the computation; on the CPU the train-rollout gap is fp32
# rounding between two kernels (1e-7..1e-6), which changes with the threads each rank gets
VOLATILE = ("timing_s/", "perf/", "reshard/export_s", "training/rollout_", "rollout_corr/")


def run_main(args: list[str], timeout: int = 900, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipe.main", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, **popen)


def main_in_process(args: list[str], capsys) -> subprocess.CompletedProcess:
    """``python -m recipe.main`` in this process, for runs that end before Ray starts (the command's
    own error handling, without a new interpreter's imports)."""
    from recipe.main import main

    code = main(args)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def metrics(run_dir: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_jsonl(str(run_dir / "metrics.jsonl"))}


def stable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(VOLATILE)}


# --- bad inputs: each a clear message, no traceback ---------------------------------------------


def test_unknown_key_names_the_nearest(tmp_path, capsys):
    out = main_in_process(["--config", TINY["gspo"], "actor_rollout_ref.actor.clip_ratio_hihg=0.3"], capsys)
    assert out.returncode == 2
    assert "clip_ratio_hihg" in out.stderr and "clip_ratio_high" in out.stderr
    assert "Traceback" not in out.stderr


def test_invalid_layout_fails_before_start(tmp_path, capsys):
    out = main_in_process(["--config", TINY["gspo"], "actor_rollout_ref.actor.megatron.expert_model_parallel_size=3",
                           f"trainer.default_local_dir={tmp_path}"], capsys)
    assert out.returncode == 2
    assert "expert" in out.stderr.lower() and "Traceback" not in out.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def _write_rows(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _row(i: int, **over) -> dict:
    row = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"copy {i % 10}"}],
           "reward_model": {"style": "rule", "ground_truth": str(i % 10)}, "extra_info": {"index": i}}
    row.update(over)
    return row


@pytest.mark.parametrize("bad, field", [
    ({"prompt": []}, "prompt"),
    ({"reward_model": {"style": "rule", "ground_truth": None}}, "reward_model.ground_truth"),
])
def test_bad_parquet_row_is_named(tmp_path, capsys, bad, field):
    rows = [_row(i) for i in range(8)]
    rows[5] = _row(5, **bad)
    path = _write_rows(tmp_path / "bad.parquet", rows)
    out = main_in_process(["--config", TINY["gspo"], f"data.train_files=[{path}]", "data.val_files=[]",
                           f"trainer.default_local_dir={tmp_path / 'run'}"], capsys)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "bad.parquet" in out.stderr and "row 5" in out.stderr and field in out.stderr
    assert "Traceback" not in out.stderr


# --- the main job learns ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("algo, steps", [("gspo", 50), ("grpo", 20)])
def test_tiny_recipe_raises_the_score(tmp_path, algo, steps):
    """The README's main job as it is (GSPO, its 50 steps): the score rises clearly. Its GRPO twin
    runs the same loop with the other loss, so 20 of its steps show the rise (-0.41 -> +0.65
    measured, first / last 5) at 2/5 of the time."""
    out = run_main(["--config", TINY[algo], f"trainer.default_local_dir={tmp_path}",
                    f"trainer.total_training_steps={steps}"])
    assert out.returncode == 0, out.stderr[-3000:]
    history = metrics(tmp_path)
    steps = sorted(k for k in history if k > 0)
    scores = [history[k]["critic/score/mean"] for k in steps]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    print(f"{algo}: score first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last - first > RISE_MARGIN, (first, last, scores)
    assert (tmp_path / "reward_curve.txt").is_file() and "reward curve" in out.stdout
    # captured output is no terminal: one console line per step and no progress-bar redraws
    assert "\r" not in out.stdout + out.stderr and "steps:" not in out.stdout + out.stderr
    lines = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("step ") and "| score" in line]
    assert lines == [str(k) for k in steps]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
                "response_length/mean", "timing_s/gen", "timing_s/reshard", "timing_s/old_log_prob",
                "timing_s/update_actor", "perf/throughput", "moe/load_imbalance_mean", "moe/routing_drift/slot_frac",
                "moe/routing_drift/slot_frac/layer_3", "moe/routing_drift/token_any_frac", "moe/router_entropy/mean",
                "moe/rollout_routing_mismatch/slot_frac", "moe/routing_bytes", "timing_s/routing_drift"):
        assert all(key in history[k] for k in steps), key
    # each update moves the router: the same tokens route to other experts afterwards; the rollout
    # engine (fp32, the actor's weights) routes exactly as the trainer's old-log-prob pass
    drift = [history[k]["moe/routing_drift/slot_frac"] for k in steps]
    assert all(0 <= d < 0.5 for d in drift) and sum(drift) > 0, drift
    assert all(history[k]["moe/rollout_routing_mismatch/slot_frac"] < 1e-3 for k in steps)
    # ... and gives the same probabilities up to fp32 rounding: |p_trainer - p_rollout| < 5e-5 on
    # every token while both route alike (measured up to 6e-6; a near-tied router that flips moves
    # one token by up to ~5e-3: seen in 2 of 360 steps of the stability preset), the mean gap
    # below 1e-5 always
    for k in steps:
        m = history[k]
        assert m["training/rollout_probs_diff_mean"] < 1e-5 and m["rollout_corr/k3_kl"] < 1e-6, m
        if m["moe/rollout_routing_mismatch/slot_frac"] == 0:
            assert m["training/rollout_probs_diff_max"] < 5e-5, m


@pytest.mark.slow
def test_the_long_preset_runs_with_worked_out_responses(tmp_path):
    """configs/recipe/tiny_long.yaml through the trainer for 3 steps: responses of tens of tokens, in
    the format (its learning: tests/test_tiny_task.py and docs/recipe.md)."""
    out = run_main(["--config", "configs/recipe/tiny_long.yaml", "trainer.total_training_steps=3",
                    "trainer.save_freq=-1", f"trainer.default_local_dir={tmp_path}"])
    assert out.returncode == 0, out.stderr[-3000:]
    history = metrics(tmp_path)
    for step in (1, 2, 3):
        m = history[step]
        assert 40 < m["response_length/mean"] < 56 and m["response_length/clip_ratio"] < 0.1, m
        assert m["critic/score/max"] == 1.0 and -0.8 < m["critic/score/mean"] < 0.5, m  # signal from the start


# Measured with the shipped seeds through this trainer (docs/recipe.md): GSPO -0.41 -> +0.97, GRPO
# -0.41 -> +0.96 (first / last 5 steps of 50). The task's plain-PyTorch twin over 5 seeds ended at
# +0.71..+0.97 after 40 steps, so 0.3 sits far below every measured rise and far above the noise.
RISE_MARGIN = 0.3


# --- resume ---------------------------------------------------------------------------------------


def assert_hf_copy_is_the_export(checkpoint: Path, merged: Path) -> None:
    """``save_contents`` with ``hf_model`` wrote what ``recipe.model_merger`` exports from the same
    checkpoint: the trained weights (not the base model's), loadable by transformers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from recipe.model_merger import main as merger

    hf = checkpoint / "actor" / "huggingface"
    assert merger(["merge", "--backend", "megatron", "--local_dir", str(checkpoint / "actor"),
                   "--target_dir", str(merged)]) == 0
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert index == json.loads((merged / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):
        saved, exported = load_file(hf / file), load_file(merged / file)
        assert saved.keys() == exported.keys() and all(torch.equal(saved[k], exported[k]) for k in saved), file
    model = AutoModelForCausalLM.from_pretrained(hf)
    base = AutoModelForCausalLM.from_pretrained(json.loads((checkpoint.parents[1] / "provenance.json").read_text())
                                                ["model_dir"])
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), base.state_dict().values()))


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_metrics(tmp_path):
    common = ["--config", TINY["gspo"], "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false"]
    whole = tmp_path / "whole"  # also writes the HF copy at each save (it changes nothing else)
    out = run_main(common + ["trainer.total_training_steps=3", f"trainer.default_local_dir={whole}",
                             "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert_hf_copy_is_the_export(whole / "checkpoints" / "global_step_3", tmp_path / "merged")

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "recipe.main", *common, "trainer.total_training_steps=8",
                             f"trainer.default_local_dir={killed}"], cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while not (killed / "checkpoints" / "global_step_2").is_dir():
            assert proc.poll() is None and time.time() < deadline, "run ended before its step-2 checkpoint"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (killed / "checkpoints" / "global_step_4").exists()

    out = run_main(common + ["trainer.total_training_steps=3", f"trainer.default_local_dir={killed}"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stderr + out.stdout
    resumed, reference = metrics(killed), metrics(whole)
    assert sorted(resumed) == [1, 2, 3]  # each step once: lines past the checkpoint were dropped
    assert stable(resumed[3]) == stable(reference[3])
    # the save's blocking time and size, logged at the step that saved
    saved = [f for f in (killed / "checkpoints" / "global_step_3").rglob("*") if f.is_file()]
    assert resumed[3]["perf/checkpoint_bytes"] == sum(f.stat().st_size for f in saved)
    assert resumed[3]["timing_s/save_checkpoint"] > 0 and "timing_s/save_checkpoint" not in resumed[1]


@pytest.mark.slow
def test_bf16_rollout_beside_a_fp32_trainer_opens_a_train_rollout_gap(tmp_path):
    """actor_rollout_ref.rollout.dtype=bfloat16: the engine rounds the trainer's fp32 weights to 8
    mantissa bits (relative 2^-9) and computes in bf16, router included. That moves a token's
    probability by ~1e-3 and flips near-tied routers, where matching precision stays below the fp32
    ceilings of test_tiny_recipe_raises_the_score (1e-5 mean, k3 KL 1e-6): the gap is asserted to
    clear those ceilings fivefold on every step (measured: 14-60 times), and some tokens to route
    differently."""
    out = run_main(["--config", TINY["gspo"], f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=2",
                    "trainer.test_freq=-1", "trainer.val_before_train=false", "actor_rollout_ref.rollout.dtype=bfloat16"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert '"dtype": "bfloat16"' in (tmp_path / "config.json").read_text()  # the resolved rollout dtype, recorded
    history = metrics(tmp_path)
    for k in (1, 2):
        m = history[k]
        assert m["training/rollout_probs_diff_mean"] > 5e-5 and m["rollout_corr/k3_kl"] > 5e-6, m
    assert sum(history[k]["moe/rollout_routing_mismatch/token_any_frac"] for k in (1, 2)) > 0


# --- signals and resume errors ---------------------------------------------------------------------

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
                  env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``recipe.main`` (with ``env`` added to its environment); when its output has a line
    starting with ``marker`` (the per-step line of a step, so the driver is in the next one, which
    takes seconds), send ``signals`` to the driver 0.5 s apart. Returns the exit status, stdout and
    stderr, after checking that no process the run started is left."""
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
                        proc.send_signal(signum)
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


STEPS = ["--config", TINY["gspo"], "trainer.test_freq=-1", "trainer.val_before_train=false"]


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_a_rerun_resumes(tmp_path):
    run = tmp_path / "run"
    ckpt = run / "checkpoints"
    code, _, stderr = signalled_run(STEPS + ["trainer.save_freq=2", "trainer.total_training_steps=8",
                                             f"trainer.default_local_dir={run}"], "step 3 |", [signal.SIGTERM], tmp_path)
    assert code == 143
    # the last completed step and the checkpoint a re-run takes are not the same here
    assert_clean_stop(stderr, f"stopped by SIGTERM; last completed step: 3; a re-run resumes from "
                              f"{ckpt / 'global_step_2'} (step 2)")
    assert [p.name for p in ckpt.iterdir()] == ["global_step_2"]

    (ckpt / ".global_step_4.tmp").mkdir()  # what a run killed in a save leaves
    out = run_main(STEPS + ["trainer.save_freq=2", "trainer.total_training_steps=3", f"trainer.default_local_dir={run}"],
                   timeout=RUN_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"removed {ckpt / '.global_step_4.tmp'}" in out.stdout and not (ckpt / ".global_step_4.tmp").exists()
    assert f"resumed from {ckpt / 'global_step_2'} (step 2)" in out.stdout
    assert sorted(metrics(run)) == [1, 2, 3]


@pytest.mark.slow
def test_sigterm_with_a_grace_period_saves_at_the_step_end(tmp_path):
    run = tmp_path / "run"
    code, _, stderr = signalled_run(STEPS + ["trainer.save_freq=-1", "trainer.total_training_steps=8",
                                             "trainer.save_on_sigterm_grace_s=600", f"trainer.default_local_dir={run}"],
                                    "step 1 |", [signal.SIGTERM], tmp_path)
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
    checkpoints left then serve the faults of a resume: the newest one cut short is skipped (named,
    with why, and moved aside) for the one before it; one whose bytes are corrupt passes the
    metadata's checks, and the workers that read it refuse in one line."""
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
    out = run_main(args + ["trainer.total_training_steps=2"], timeout=RUN_S)
    assert out.returncode == 0, out.stderr[-3000:]
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
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = uuid.uuid4().hex
    # the head and its clients share Ray's auth token, as the launchers arrange (launch/common.sh)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex + uuid.uuid4().hex}
    head = subprocess.Popen(["ray", "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false",
                             "--disable-usage-stats", "--block"], env={**os.environ, **auth, TAG: cluster},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    client = {**auth, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    probe = [sys.executable, "-c", "import ray; ray.init(); r = ray.available_resources(); "
             "print(r.get('CPU', 0), ray.cluster_resources()['CPU'])"]
    try:
        run = tmp_path / "run"
        code, _, stderr = signalled_run(STEPS + ["trainer.save_freq=1", "trainer.total_training_steps=8",
                                                 f"trainer.default_local_dir={run}"], "step 1 |", [signal.SIGTERM],
                                        tmp_path, env=client)
        assert code == 143
        assert_clean_stop(stderr, f"stopped by SIGTERM; last completed step: 1; a re-run resumes from "
                                  f"{run / 'checkpoints' / 'global_step_1'} (step 1)")
        assert head.poll() is None
        deadline = time.time() + 60  # Ray frees a gone driver's resources within seconds
        while (free := subprocess.run(probe, env={**os.environ, **client}, capture_output=True,
                                      text=True, timeout=RUN_S).stdout.split()) != ["4.0", "4.0"]:
            assert time.time() < deadline, free
            time.sleep(2)
    finally:
        head.terminate()
        head.wait(timeout=RUN_S)
        for pid in tagged(cluster):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("make, what", [
    (lambda p: None, "does not exist: give a checkpoint directory"),
    (Path.mkdir, "is not a complete checkpoint: trainer_state.json is missing; actor/ is missing; give another one"),
])
def test_resume_from_path_not_a_checkpoint_fails_before_anything_starts(tmp_path, capsys, make, what):
    path = tmp_path / "global_step_5"
    make(path)
    run = tmp_path / "run"
    out = main_in_process(["--config", TINY["gspo"], "trainer.resume_mode=resume_path",
                           f"trainer.resume_from_path={path}", f"trainer.default_local_dir={run}"], capsys)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == (f"error: trainer.resume_from_path={path} {what} "
                                           "(<run dir>/checkpoints/global_step_K)")
    assert "workers:" not in out.stdout and not run.exists()  # no Ray, no config.json or provenance.json


def test_unwritable_run_directory_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    run = tmp_path / "file" / "run"  # a path through a file: uncreatable, even for root
    out = main_in_process(["--config", TINY["gspo"], f"trainer.default_local_dir={run}"], capsys)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == (f"error: trainer.default_local_dir={run}: cannot write the run directory "
                                           f"(Not a directory: {run}); give a directory this user can write")
    assert "Traceback" not in out.stderr and "workers:" not in out.stdout


# --- DP invariance and dead workers (in-process trainer) ----------------------------------------------


@pytest.fixture(scope="module")
def local_ray():
    import ray

    yield
    ray.shutdown()


def _trainer(tmp_path: Path, name: str, overrides: list[str]):
    from recipe.config import load_config
    from recipe.driver.trainer import Trainer

    cfg = load_config(str(REPO / TINY["gspo"]), [f"trainer.default_local_dir={tmp_path / name}",
                                                  "trainer.val_before_train=false", "trainer.save_freq=-1",
                                                  "trainer.test_freq=-1", *overrides])
    trainer = Trainer(cfg)
    trainer.start()
    return trainer


@pytest.mark.slow
def test_update_is_the_same_with_one_or_two_workers(tmp_path, local_ray):
    results = {}
    for workers in (1, 2):
        trainer = _trainer(tmp_path, f"dp{workers}", [
            f"trainer.n_gpus_per_node={workers}", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
            f"actor_rollout_ref.rollout.data_parallel_size={workers}",
        ])
        try:
            assert trainer.dp_size == workers
            results[workers] = [trainer.train_step(step) for step in (1, 2)]
        finally:
            trainer.close()
    for one, two in zip(results[1], results[2]):
        assert_same_step(one, two, trainer.cfg)


@pytest.mark.slow
def test_resume_under_another_layout_continues_the_run(tmp_path, local_ray):
    """A checkpoint written under EP2 (tiny_cpu.yaml) after step 1, in the background while step 2
    trains (async save: not resumable until complete), resumed under TP2 with sequence parallel:
    step 2 samples the same rollouts (the data position and the weights came back exactly) and
    updates within fp32 rounding of the EP2 run's step 2 (weights, Adam moments, LR schedule)."""
    from recipe.driver.checkpoint import checkpoints

    writer = _trainer(tmp_path, "ep2", ["actor_rollout_ref.actor.checkpoint.async_save=true"])
    try:
        writer.train_step(1)
        writer.step = 1
        blocking = writer.save_checkpoint(wait=False)
        assert blocking["timing_s/save_checkpoint"] > 0 and "perf/checkpoint_bytes" not in blocking
        assert checkpoints(writer.ckpt_dir) == []  # still being written
        expected = writer.train_step(2)
        saved = writer._finish_save()
    finally:
        writer.close()
    assert checkpoints(writer.ckpt_dir) == [saved]
    assert sorted(p.name for p in saved.iterdir()) == ["actor", "trainer_state.json"]
    assert (saved / "actor" / "metadata.json").is_file() and (saved / "actor" / "huggingface" / "config.json").is_file()
    reader = _trainer(tmp_path, "tp2", [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2",
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
        "trainer.resume_mode=resume_path", f"trainer.resume_from_path={saved}",
    ])
    try:
        assert reader.step == 1 and reader.kl_ctrl.value == writer.kl_ctrl.value
        got = reader.train_step(2)
    finally:
        reader.close()
    for key in ("critic/score/mean", "response_length/mean", "critic/advantages/max", "actor/lr"):
        assert got[key] == expected[key], key
    tolerance = split_tolerances(expected, reader.cfg)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
        assert got[key] == pytest.approx(expected[key], rel=0, abs=tolerance[key]), key


# A sampled token is never as unlikely as e^-30: per token the chance is below vocabulary x e^-30 = 5e-11.
SAMPLED_LOG_PROB_BOUND = 30.0


def assert_same_step(one: dict, two: dict, cfg) -> None:
    """One step's metrics from two runs of the same samples over other workers or hosts: the same
    samples (per-request seeds), and the update equal up to the rounding of split_tolerances."""
    for key in ("critic/score/mean", "response_length/mean", "critic/advantages/max"):
        assert one[key] == two[key], key
    for key, tolerance in split_tolerances(one, cfg).items():
        assert one[key] == pytest.approx(two[key], rel=0, abs=tolerance), key


def split_tolerances(metrics: dict, cfg) -> dict[str, float]:
    """The same samples through another number of workers: metrics that differ by the rounding of
    the model's log-probs of sampled tokens (tests.numerics), times each metric's slope in them:
    |advantage| x ratio (at most 1 + clip_ratio_high on policy) for the loss; the gradient carries
    that rounding relative to the log-probs' size, through the backward pass."""
    from megatron_bridge.plan.model_spec import load_model_spec
    from tests.numerics import forward_terms, rounding

    data, actor = cfg.data, cfg.actor_rollout_ref.actor
    terms = forward_terms(load_model_spec("tiny_qwen3_moe"), data.max_prompt_length + data.max_response_length)
    log_prob = rounding(SAMPLED_LOG_PROB_BOUND, terms)
    return {"actor/entropy": log_prob, "actor/ppo_kl": log_prob,
            "actor/pg_loss": max(abs(metrics["critic/advantages/max"]), abs(metrics["critic/advantages/min"]))
                             * (1 + actor.clip_ratio_high) * log_prob,
            "actor/grad_norm": metrics["actor/grad_norm"] * rounding(1.0, 2 * terms)}


@pytest.mark.slow
def test_a_dead_worker_is_named(tmp_path, local_ray):
    import ray

    from recipe.workers.group import WorkerDiedError

    trainer = _trainer(tmp_path, "dead", [])
    try:
        trainer.step = 1
        ray.kill(trainer.workers.workers[1])
        with pytest.raises(WorkerDiedError, match="worker rank 1") as info:
            trainer.fit()
        assert any("last completed step: 1" in n for n in info.value.__notes__)
    finally:
        trainer.close()


@pytest.mark.slow
def test_reward_function_error_names_the_sample(tmp_path, local_ray):
    from recipe.reward import RewardError

    fn = tmp_path / "reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                  "    raise KeyError('oops')\n")
    trainer = _trainer(tmp_path, "reward", [f"custom_reward_function.path={fn}"])
    try:
        with pytest.raises(RewardError, match="row 0") as info:
            trainer.fit()
        assert isinstance(info.value.__cause__, KeyError)
        assert any("last completed step: 0" in n for n in info.value.__notes__)
    finally:
        trainer.close()


def _dp_rows(dp_size: int, dynamic: bool, ends: list[int], mini: int) -> list[list[int]]:
    from recipe.driver.trainer import Trainer

    t = Trainer.__new__(Trainer)
    t.dp_size, t.dynamic_batches = dp_size, dynamic
    batch = {"input_ids": torch.zeros(len(ends), 1), "prompt_lengths": torch.tensor(ends) - 1,
             "response_mask": torch.ones(len(ends), 1)}
    return [s.tolist() for s in t.dp_rows(batch, mini)]


def test_dp_rows_keep_each_mini_batch_whole():
    ends = [5, 9, 2, 7, 3, 8, 4, 6]
    assert _dp_rows(2, False, ends, 4) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert _dp_rows(1, False, ends, 4) == [list(range(8))]
    # dynamic batch size: longest first, dealt in snake order within each mini-batch
    # mini-batch 0 (rows 0-3) by length: 1 (9), 3 (7), 0 (5), 2 (2); mini-batch 1: 5 (8), 7 (6), 6 (4), 4 (3)
    assert _dp_rows(2, True, ends, 4) == [[1, 2, 5, 4], [3, 0, 7, 6]]
    assert _dp_rows(1, True, ends, 4) == [[1, 3, 0, 2, 5, 7, 6, 4]]
    for dynamic in (False, True):  # every row once, each mini-batch whole
        first, second = _dp_rows(2, dynamic, ends, 4)
        assert sorted(first[:2] + second[:2]) == [0, 1, 2, 3] and sorted(first + second) == list(range(8))


# --- verl's reward shaping: DAPO dynamic sampling and the KL penalty in the reward ---------------


@pytest.mark.slow
def test_dapo_dynamic_sampling_and_kl_in_reward(tmp_path):
    # GSPO has no KL loss: the reference model is built for the reward's KL alone
    out = run_main(["--config", TINY["gspo"], f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=2",
                    "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.val_before_train=false",
                    "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "data.gen_batch_size=8",
                    "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.05"])
    assert out.returncode == 0, out.stderr[-3000:]
    history = metrics(tmp_path)
    for step in (1, 2):
        m = history[step]
        # 16 prompts whose 8 answers are not all right or all wrong, from batches of 8 prompts
        assert m["train/num_gen_batches"] >= 2 and m["critic/acc/mean"] not in (0.0, 1.0)
        assert m["actor/reward_kl_penalty_coeff"] == 0.05
    # step 1: the actor is the reference, no penalty; step 2: it moved
    assert history[1]["actor/reward_kl_penalty"] == 0.0 and history[1]["critic/rewards/mean"] == history[1]["critic/score/mean"]
    assert history[2]["actor/reward_kl_penalty"] != 0.0


@pytest.mark.slow
def test_dapo_gives_up_after_max_num_gen_batches(tmp_path):
    reward = tmp_path / "flat.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    out = run_main(["--config", TINY["grpo"], f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.val_before_train=false",
                    f"custom_reward_function.path={reward}", "algorithm.filter_groups.enable=true",
                    "algorithm.filter_groups.metric=score", "algorithm.filter_groups.max_num_gen_batches=2"])
    assert out.returncode == 1
    assert "after 2 generation batches only 0 of 16 prompts" in out.stderr and "max_num_gen_batches=2" in out.stderr
    assert "Traceback" not in out.stderr

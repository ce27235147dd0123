"""A run of the tiny CPU recipe (real Ray workers, megatron-core on gloo ranks) killed mid-way
resumes to the same metrics as the README's main job, and its HF copy is the merger's export.
Stops by signal: tests/test_recipe_stops.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.recipe_runs import REPO, TINY, metrics, run_main, stable

@pytest.mark.slow
def test_killed_run_resumes_to_the_same_metrics(tmp_path, main_job):
    """SIGKILL after the step-2 checkpoint, then the same command: the run resumes at step 2 and its
    step 3 is the main job's (the same settings but when it saves and validates). The resumed
    run's save also writes the HF copy (``hf_model``), which is what the merger exports."""
    reference_run, _ = main_job
    common = ["--config", TINY["gspo"], "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false"]
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
    # a checkpoint is put in place only after its step's metrics line is complete
    assert {1, 2} <= logged_steps(killed)

    out = run_main(common + ["trainer.total_training_steps=3", f"trainer.default_local_dir={killed}",
                             "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stderr + out.stdout
    resumed, reference = metrics(killed), metrics(reference_run)
    assert sorted(resumed) == [1, 2, 3]  # each step once: lines past the checkpoint were dropped
    assert stable(resumed[3]) == stable(reference[3])
    # the save's blocking time and size, logged at the step that saved
    saved = [f for f in (killed / "checkpoints" / "global_step_3").rglob("*") if f.is_file()]
    assert resumed[3]["perf/checkpoint_bytes"] == sum(f.stat().st_size for f in saved)
    assert resumed[3]["timing_s/save_checkpoint"] > 0 and "timing_s/save_checkpoint" not in resumed[1]
    assert_hf_copy_is_the_export(killed / "checkpoints" / "global_step_3", tmp_path / "merged")


def logged_steps(run: Path) -> set[int]:
    """The steps whose metrics line is complete in ``run``'s metrics.jsonl so far."""
    path = run / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.is_file() else []  # the last piece may be half-written
    return {json.loads(line)["step"] for line in lines if line}


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

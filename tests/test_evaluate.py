"""``python -m recipe.evaluate``: the estimators on hand-computed cases, the answers the built-in
rewards extract, a tiny run evaluated against what its trainer logged, and bad inputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipe.evaluate import ks, maj_at_k, pass_at_k
from recipe.reward import answer_extractor
from recipe.tracking.loggers import read_jsonl
from tests.recipe_runs import main_in_process

REPO = Path(__file__).resolve().parents[1]


def evaluate(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipe.evaluate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def evaluate_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """The command in this process, for inputs it refuses before any model loads."""
    return main_in_process(list(args), capsys, "recipe.evaluate")


# --- estimators ------------------------------------------------------------------------------------


def test_ks_are_powers_of_two_up_to_n():
    assert ks(1) == [1] and ks(6) == [1, 2, 4] and ks(8) == [1, 2, 4, 8]


def test_pass_at_k_hand_computed():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == 0.5  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0


def test_maj_at_k_hand_computed():
    answers, correct = ["4", "5", "4", None], [1.0, 0.0, 1.0, 0.0]
    assert maj_at_k(answers, correct, 1) == 0.5  # blocks 4 | 5 | 4 | no answer
    assert maj_at_k(answers, correct, 2) == 1.0  # {4, 5}: a tie, the first seen wins; {4, none}: 4
    assert maj_at_k(answers, correct, 4) == 1.0  # 4 twice, 5 once
    assert maj_at_k(["3", "5", "5", "3"], [0.0, 1.0, 1.0, 0.0], 4) == 0.0  # a tie: 3 was seen first
    assert maj_at_k(["7", "7", "7", "2"], [0.0, 0.0, 0.0, 1.0], 4) == 0.0  # the majority is wrong
    assert maj_at_k([None, None], [0.0, 0.0], 2) == 0.0  # no answer, no vote
    assert maj_at_k(["1", "1", "2"], [1.0, 1.0, 0.0], 2) == 1.0  # n // k blocks: the third sample is left out


def test_answers_are_what_the_built_in_rewards_compare():
    assert answer_extractor("math_dapo")("so Answer: 4") == "4"
    assert answer_extractor("aime_2024")("no answer line") is None
    assert answer_extractor("openai/gsm8k")("it is #### 1,000") == "1000"
    assert answer_extractor("HuggingFaceH4/MATH-500")("\\boxed{\\dfrac12}") == "\\frac{1}{2}"
    assert answer_extractor("my_own_task") is None  # a custom reward's source: no maj@k


# --- a tiny run, evaluated ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(main_job) -> Path:
    """The README's main job (tests/conftest.py): validation (greedy) before training and every 10
    steps, checkpoints at steps 20, 40 and 50, the last two kept."""
    return main_job[0]


@pytest.mark.slow
def test_a_run_is_evaluated_at_every_checkpoint_as_its_trainer_validated(run_dir):
    out = evaluate("--model", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert [(m["label"], m["step"]) for m in results["models"]] == [("base", 0), ("global_step_40", 40),
                                                                     ("global_step_50", 50)]
    logged = {m["step"]: m for m in read_jsonl(str(run_dir / "metrics.jsonl")) if "val/acc/mean" in m}
    assert sorted(logged) == [0, 10, 20, 30, 40, 50]
    for model in results["models"]:
        assert set(model["results"]) == {"math_dapo"}
        row = model["results"]["math_dapo"]
        assert row["prompts"] == 64
        # the same prompts, weights and greedy decoding as the trainer's validation: the same numbers
        assert row["greedy_acc"] == logged[model["step"]]["val/acc/mean"], model["label"]
        assert row["greedy_score"] == logged[model["step"]]["val/score/mean"], model["label"]
        assert row["mean@1"] == row["greedy_score"] and row["pass@1"] == row["greedy_acc"]  # n=1 is greedy
    assert (run_dir / "eval" / "score.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (run_dir / "eval" / "results.md").read_text()
    assert "| global_step_50 | 50 | math_dapo |" in table and table in out.stdout
    assert not list((run_dir / "eval").glob(".*"))  # no temporary files or exports left


@pytest.mark.slow
def test_a_checkpoint_with_samples(run_dir, tmp_path):
    out = evaluate("--model", str(run_dir / "checkpoints" / "global_step_50"), "--data", "builtin:tiny", "--n", "2",
                   "--out", str(tmp_path / "eval"))
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["settings"]["temperature"] == 1.0 and results["settings"]["n"] == 2
    (model,) = results["models"]
    row = model["results"]["math_dapo"]
    assert set(row) == {"prompts", "mean@2", "pass@1", "pass@2", "maj@1", "maj@2", "greedy_acc", "greedy_score"}
    assert row["pass@1"] <= row["pass@2"] and row["maj@1"] == row["pass@1"]  # every tiny response has an answer
    logged = {m["step"]: m for m in read_jsonl(str(run_dir / "metrics.jsonl"))}
    assert row["greedy_acc"] == logged[50]["val/acc/mean"]
    assert not (tmp_path / "eval" / "score.png").exists()  # one model: nothing to plot against steps


@pytest.mark.slow
def test_a_run_stopped_before_its_first_save_evaluates_its_base_model(run_dir, tmp_path):
    """What such a run leaves: its config and provenance, no checkpoints/ yet."""
    stopped = tmp_path / "run"
    stopped.mkdir()
    for name in ("config.json", "provenance.json"):
        shutil.copy(run_dir / name, stopped / name)
    out = evaluate("--model", str(stopped), "--out", str(tmp_path / "eval"))
    assert out.returncode == 0, out.stderr[-3000:]
    base = json.loads((run_dir / "provenance.json").read_text())["model_dir"]
    assert (f"{stopped}: no checkpoint yet (the run stopped before its first save): evaluating its base model "
            f"{base} (step 0) alone") in out.stderr
    (model,) = json.loads((tmp_path / "eval" / "results.json").read_text())["models"]
    logged = {m["step"]: m for m in read_jsonl(str(run_dir / "metrics.jsonl"))}
    assert (model["label"], model["step"]) == ("base", 0)
    assert model["results"]["math_dapo"]["greedy_acc"] == logged[0]["val/acc/mean"]  # the run's own settings


# --- bad inputs ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_runs_reward_file_is_imported_only_when_trusted(run_dir, tmp_path, capsys):
    """A run directory's config can name a Python reward file; evaluating would run its code, so it
    takes --trust-reward-file, and without it nothing of the file runs."""
    other = tmp_path / "run"
    other.mkdir()
    shutil.copy(run_dir / "provenance.json", other / "provenance.json")
    reward = tmp_path / "reward.py"
    ran = tmp_path / "ran"
    reward.write_text(f"open({str(ran)!r}, 'w').close()\nraise RuntimeError('the reward file ran')\n")
    config = json.loads((run_dir / "config.json").read_text())
    config["custom_reward_function"] = {**config["custom_reward_function"], "path": str(reward)}
    (other / "config.json").write_text(json.dumps(config))
    _refused(evaluate_here(capsys, "--model", str(other), "--out", str(tmp_path / "eval")),
             f"scores with {reward} (custom_reward_function.path)", "--trust-reward-file")
    assert not ran.exists()
    out = evaluate("--model", str(other), "--out", str(tmp_path / "eval"), "--trust-reward-file")
    assert ran.exists() and out.returncode != 0  # imported: this file's own error ends it


def _refused(out: subprocess.CompletedProcess, *named: str) -> None:
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for name in named:
        assert name in lines[0], lines[0]


@pytest.fixture(scope="module")
def hf_dir() -> str:
    from megatron_bridge.tiny_model import TINY
    from recipe.data.tiny_task import cache_dir, prepare_builtin

    return prepare_builtin(cache_dir(), seed=0, model=TINY).model_dir


def test_missing_model_path(tmp_path, capsys):
    _refused(evaluate_here(capsys, "--model", str(tmp_path / "nowhere")), str(tmp_path / "nowhere"), "no such")


def test_a_directory_that_is_no_model(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    _refused(evaluate_here(capsys, "--model", str(tmp_path)), f"--model {tmp_path}", "checkpoint")


def test_a_model_without_data(hf_dir, tmp_path, capsys):
    _refused(evaluate_here(capsys, "--model", hf_dir, "--out", str(tmp_path)), "--data")


def test_unreadable_data(hf_dir, tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    _refused(evaluate_here(capsys, "--model", hf_dir, "--data", str(bad), "--out", str(tmp_path / "eval")), str(bad))


def test_out_dir_not_writable(hf_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "eval"
    _refused(evaluate_here(capsys, "--model", hf_dir, "--data", "builtin:tiny", "--out", str(out)), f"--out {out}")


@pytest.mark.slow
def test_a_damaged_checkpoint(run_dir, tmp_path, capsys):
    damaged = tmp_path / "global_step_50"
    shutil.copytree(run_dir / "checkpoints" / "global_step_50", damaged)
    (damaged / "actor" / "common.pt").unlink()
    _refused(evaluate_here(capsys, "--model", str(damaged), "--out", str(tmp_path / "eval")), str(damaged), "common.pt")

"""``python -m recipe.main`` refuses bad input before anything starts, in one line and without a
traceback: an unknown key, a layout the validator rejects, a bad parquet row, a resume path that is no
checkpoint, a run directory it cannot write."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recipe_runs import TINY, main_in_process

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


@pytest.mark.parametrize("make, what", [
    (lambda p: None, "does not exist: give a checkpoint directory"),
    (lambda p: p.write_text(""), "is a file, not a checkpoint directory: give a checkpoint directory"),
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

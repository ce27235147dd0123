import importlib.util
import json

import pytest
import torch

from recipe.tracking.loggers import LOGGERS, LoggerError, Tracking, ascii_curve, read_jsonl


def _tracking(run_dir, loggers=(), resume=False):
    config = {"lr": 1e-6}
    return Tracking(str(run_dir), list(loggers), project="moe-rl", experiment="test", config=config, resume=resume)


def test_jsonl_has_one_flushed_object_per_step(tmp_path):
    tracking = _tracking(tmp_path / "run", ["jsonl"])
    tracking.log({"critic/score/mean": 0.25, "perf/total_num_tokens": 640}, step=1)
    tracking.log({"critic/score/mean": torch.tensor(0.75), "actor/pg_loss": -0.5}, step=2)
    # Flushed per line: readable before close.
    assert read_jsonl(tracking.metrics_path) == [
        {"step": 1, "critic/score/mean": 0.25, "perf/total_num_tokens": 640},
        {"step": 2, "critic/score/mean": 0.75, "actor/pg_loss": -0.5},
    ]
    tracking.close()
    with open(tmp_path / "run" / "metrics.jsonl") as file:
        assert json.loads(file.readline()) == {"step": 1, "critic/score/mean": 0.25, "perf/total_num_tokens": 640}


def test_resume_truncates_steps_after_the_checkpoint_and_appends(tmp_path):
    with _tracking(tmp_path) as first_run:
        for step in range(1, 6):
            first_run.log({"critic/score/mean": step / 10}, step=step)
    with open(first_run.metrics_path, "a") as file:
        file.write('{"step": 6, "critic/sc')  # killed mid-write

    with _tracking(tmp_path, resume=True) as resumed:
        resumed.drop_from(4)  # last checkpoint was after step 3
        assert [record["step"] for record in read_jsonl(resumed.metrics_path)] == [1, 2, 3]
        for step in range(4, 7):
            resumed.log({"critic/score/mean": step}, step=step)
    records = read_jsonl(first_run.metrics_path)
    assert [record["step"] for record in records] == [1, 2, 3, 4, 5, 6]
    assert [record["critic/score/mean"] for record in records] == [0.1, 0.2, 0.3, 4, 5, 6]


def test_fresh_run_starts_a_new_file(tmp_path):
    with _tracking(tmp_path) as first_run:
        first_run.log({"a": 1.0}, step=1)
    with _tracking(tmp_path) as second_run:
        second_run.log({"a": 2.0}, step=1)
    assert read_jsonl(second_run.metrics_path) == [{"step": 1, "a": 2.0}]


def test_unknown_logger_lists_the_choices(tmp_path):
    with pytest.raises(LoggerError) as error:
        _tracking(tmp_path / "run", ["console", "mlflow"])
    message = str(error.value)
    assert "'mlflow'" in message and all(name in message for name in LOGGERS)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("logger", ["tensorboard", "swanlab", "wandb"])
def test_missing_logger_package_fails_at_start_and_keeps_the_old_file(tmp_path, logger):
    if importlib.util.find_spec(logger) is not None:
        pytest.skip(f"{logger} is installed here")
    with _tracking(tmp_path) as earlier_run:
        earlier_run.log({"a": 1.0}, step=1)
    with pytest.raises(LoggerError, match=rf"logger '{logger}' needs .*`pip install {logger}`"):
        _tracking(tmp_path, ["console", logger])
    assert read_jsonl(earlier_run.metrics_path) == [{"step": 1, "a": 1.0}]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_run_starts_logs_and_finishes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")  # no network, no files
    with _tracking(tmp_path, ["wandb"]) as tracking:
        tracking.log({"critic/score/mean": 0.5}, step=1)
    assert read_jsonl(tracking.metrics_path) == [{"step": 1, "critic/score/mean": 0.5}]


def test_console_prints_one_compact_line_per_step(tmp_path, capsys):
    with _tracking(tmp_path, ["console"]) as tracking:
        tracking.log({"critic/score/mean": 0.625, "timing_s/step": 12.5, "actor/entropy": 1.0}, step=7)
    assert capsys.readouterr().out == "step 7 | score 0.625 | step_s 12.5\n"


def test_log_rejects_non_numbers_and_a_step_key(tmp_path):
    with _tracking(tmp_path) as tracking:
        with pytest.raises(LoggerError, match="metric 'note' is 'hi' \\(str\\); log numbers only"):
            tracking.log({"note": "hi"}, step=1)
        with pytest.raises(LoggerError, match="must not contain the key 'step'"):
            tracking.log({"step": 3, "a": 1.0}, step=1)
    assert read_jsonl(tracking.metrics_path) == []


def test_read_jsonl_names_the_file_and_line_of_bad_input(tmp_path):
    with pytest.raises(LoggerError, match="does not exist"):
        read_jsonl(str(tmp_path / "missing.jsonl"))
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(LoggerError, match=rf"{path}:2: not a JSON object"):
        read_jsonl(str(path))
    path.write_text('{"step": 1}\n{"a": 2}\n')
    with pytest.raises(LoggerError, match=rf"{path}:2: expected an object with an integer 'step'"):
        read_jsonl(str(path))


def test_ascii_curve_has_height_rows_between_min_and_max_labels():
    values = [0.1, 0.3, 0.2, 0.9, 0.5]
    lines = ascii_curve(values, width=60, height=6, label="reward").split("\n")
    assert lines[0] == "reward"
    rows = lines[1:7]
    assert rows[0].startswith("0.9 |") and rows[-1].startswith("0.1 |")
    assert all(" |" in row for row in rows)
    assert lines[7] == "    +-----"
    assert lines[8].split() == ["step", "1", "step", "5"]
    assert len(lines) == 9
    # One point per value: the max on the top row, the min on the bottom row.
    assert rows[0] == "0.9 |   *" and rows[-1] == "0.1 |*"
    assert sum(row.count("*") for row in rows) == len(values)


def test_ascii_curve_averages_long_series_per_column_and_draws_constants_mid_height():
    long = ascii_curve([0.0, 1.0] * 50, width=10, height=4).split("\n")
    assert long[0] == "0.5 |" and long[1] == "    |" and long[2] == "    |**********" and long[3] == "0.5 |"
    flat = ascii_curve([2.0] * 8, height=5).split("\n")
    assert flat[:5] == ["2 |", "  |", "  |********", "  |", "2 |"]
    with pytest.raises(ValueError, match="height >= 2"):
        ascii_curve([1.0], height=1)
    assert ascii_curve([], label="reward") == "reward\n(no finite values among 0)"


def test_ascii_curve_leaves_non_finite_values_out():
    lines = ascii_curve([1.0, float("nan"), 3.0], height=3).split("\n")
    assert lines[:3] == ["3 |  *", "  |", "1 |*"]

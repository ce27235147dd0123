import json
import math
import os
import random
import re
import stat
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.collections import PathCollection

from recipe.compare import report
from recipe.compare.report import (PLOTS, ReportError, Rule, decline_step, group_runs, instability, instability_step, load_run,
                                   never_learned_step, write_report)
from recipe.tracking.figures import metric_figure

SCORE, VAL, GRAD = "critic/score/mean", "val/score/mean", "actor/grad_norm"
CLIP, DRIFT, DIFF, TIME = ("actor/pg_clipfrac", "moe/routing_drift/slot_frac", "training/rollout_probs_diff_mean",
                           "timing_s/step")
LAYERS = 3
COLLAPSE_STEP = 17  # grpo seed 0: the score falls to -1 from step 16, the grad norm spikes at 17

REPO = Path(__file__).resolve().parents[1]


def _write_run(path, records, variant=None, seed=None, config=None):
    os.makedirs(path)
    with open(path / "metrics.jsonl", "w") as file:
        file.writelines(json.dumps(record) + "\n" for record in records)
    if variant is not None:
        (path / "variant.json").write_text(json.dumps({"variant": variant, "seed": seed}))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _full_records(scores, grads, rng, drop=()):
    """Every metric the report reads but entropy (no run logs it) and those in ``drop``; validation
    at steps 0, 10, 20, 30; routing drift every second step."""
    records = [{"step": 0, VAL: 0.1}]
    for step, (score, grad) in enumerate(zip(scores, grads), start=1):
        record = {"step": step, SCORE: score, GRAD: grad, CLIP: rng.uniform(0, 0.2),
                  "actor/ppo_kl": rng.uniform(0, 1e-3), "response_length/mean": rng.uniform(100, 300),
                  DIFF: rng.uniform(0, 0.01), "moe/replay_override/slot_frac": rng.uniform(0, 0.05),
                  "moe/rollout_routing_mismatch/slot_frac": rng.uniform(0, 0.1),
                  "rollout_corr/k3_kl": rng.uniform(0, 1e-3), TIME: rng.uniform(10, 20)}
        if step % 2 == 0:
            layers = [rng.uniform(0, 0.2) for _ in range(LAYERS)]
            record.update({f"{DRIFT}/layer_{layer}": value for layer, value in enumerate(layers)})
            record[DRIFT] = statistics.mean(layers)
        if step % 10 == 0:
            record[VAL] = rng.uniform(0, 1)
        records.append({key: value for key, value in record.items() if key not in drop})
    return records


def _one_step_off(records):
    """A one_step_off run's staleness: its step 1 is made under the current weights, later ones a version behind."""
    for record in records[1:]:
        record["async/staleness_mean"] = record["async/staleness_max"] = float(record["step"] > 1)
    return records


def _collapsing():
    # s(15) = mean(0.55 .. 0.75) = 0.65 is the best; s(16) = 0.34 (drop 0.31), s(17) = 0.02 (drop 0.63 > 0.5).
    scores = [0.05 * step if step < 16 else -1.0 for step in range(1, 31)]
    grads = [1.0 + 0.1 * (step % 3 - 1) for step in range(1, 31)]
    grads[COLLAPSE_STEP - 1] = 20.0
    return scores, grads


def _noisy(rng, steps=30):
    scores = [0.05 * min(step, 15) + rng.uniform(-0.25, 0.25) for step in range(1, steps + 1)]
    grads = [1.0 + rng.uniform(-0.3, 0.8) for _ in range(steps)]
    return scores, grads


def _spike_without_drop(steps=25):
    scores = [min(0.04 * step, 0.6) for step in range(1, steps + 1)]
    grads = [1.0] * steps
    grads[11] = 10.0
    return scores, grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """grpo: seed 0 collapses, seed 1 is noisy but stable and lacks the probs diff; gspo: one seed;
    grpo_r2: no variant.json, a grad spike without a score drop, few metrics."""
    root = tmp_path_factory.mktemp("runs")
    rng = random.Random(0)
    records = {
        "grpo_s0": _full_records(*_collapsing(), rng),
        "grpo_s1": _full_records(*_noisy(rng), rng, drop=(DIFF,)),
        "gspo_s0": _one_step_off(_full_records(*_noisy(rng), rng)),
        "grpo_r2": [{"step": step, SCORE: score, GRAD: grad, CLIP: 0.1 * step, TIME: 5.0, "response_length/mean": 200}
                    for step, (score, grad) in enumerate(zip(*_spike_without_drop()), start=1)],
    }
    grpo, gspo = {"actor": {"loss_mode": "vanilla", "clip": 0.2}}, {"actor": {"loss_mode": "gspo", "clip": 4e-4}}
    dirs = [
        _write_run(root / "grpo_s0", records["grpo_s0"], "grpo", 0, {**grpo, "seed": 0}),
        _write_run(root / "grpo_s1", records["grpo_s1"], "grpo", 1, {**grpo, "seed": 1}),
        _write_run(root / "gspo_s0", records["gspo_s0"], "gspo", 0, {**gspo, "seed": 0}),
        _write_run(root / "grpo_r2", records["grpo_r2"]),
    ]
    variants = {"grpo": ["grpo_s0", "grpo_s1"], "gspo": ["gspo_s0"], "grpo_r2": ["grpo_r2"]}
    return root, dirs, {variant: [records[name] for name in names] for variant, names in variants.items()}


@pytest.fixture(scope="module")
def written(runs):
    root, dirs, _ = runs
    out = root / "report"
    summary = write_report(dirs, str(out))
    return out, summary, json.loads((out / "summary.json").read_text())


def _values(records, key):
    return [record[key] for record in sorted(records, key=lambda r: r["step"]) if key in record]


def _expected(variant_records, window=5):
    """The table's numbers straight from the records: per seed, then the mean over seeds having it."""
    per_seed = {  # the table's field: (metric, its value from that metric's logged values)
        "score_first_window": (SCORE, lambda values: statistics.mean(values[:window])),
        "score_last_window": (SCORE, lambda values: statistics.mean(values[-window:])),
        "val_first": (VAL, lambda values: values[0]),
        "val_last": (VAL, lambda values: values[-1]),
        "grad_norm_peak": (GRAD, max),
        "clipfrac_mean": (CLIP, statistics.mean),
        "routing_drift_mean": (DRIFT, statistics.mean),
        "probs_diff_mean": (DIFF, statistics.mean),
        "k3_kl_mean": ("rollout_corr/k3_kl", statistics.mean),
        "staleness_mean": ("async/staleness_mean", statistics.mean),
        "staleness_max": ("async/staleness_max", max),
        "wall_time_s": (TIME, sum),
    }
    out = {}
    for name, (key, of_values) in per_seed.items():
        values = [of_values(_values(records, key)) for records in variant_records if _values(records, key)]
        out[name] = statistics.mean(values) if values else None
    return out


def test_summary_json_numbers_equal_the_metrics_files(runs, written):
    _, dirs, records = runs
    _, summary, data = written
    assert [v["variant"] for v in data["variants"]] == ["grpo", "gspo", "grpo_r2"]
    assert data["rule"] == {"window": 5, "drop": 0.5, "spike_factor": 3.0, "learn": 0.2}
    for variant in data["variants"]:
        expected = _expected(records[variant["variant"]])
        for name, value in expected.items():
            assert variant["stats"][name] == (None if value is None else pytest.approx(value, rel=1e-12)), name
    grpo, gspo, r2 = data["variants"]
    assert [(r["run_dir"], r["seed"], r["steps"]) for r in grpo["runs"]] == [(dirs[0], 0, 30), (dirs[1], 1, 30)]
    assert (r2["runs"][0]["seed"], r2["runs"][0]["steps"]) == (None, 25)
    assert [(r["unstable_kind"], r["unstable_step"]) for r in grpo["runs"]] == [("collapse", COLLAPSE_STEP), (None, None)]
    assert gspo["runs"][0]["unstable_step"] is None and r2["runs"][0]["unstable_step"] is None
    assert (gspo["stats"]["staleness_mean"], gspo["stats"]["staleness_max"]) == (pytest.approx(29 / 30), 1.0)
    assert grpo["stats"]["staleness_mean"] is None  # synchronous runs do not log it
    assert all(r["rule_checked"] for v in data["variants"] for r in v["runs"])
    assert data == json.loads(json.dumps(report.asdict(summary)))  # the return value is what was written


def _markdown_table(text):
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| variant | runs |"))
    header = [cell.strip() for cell in lines[start].strip("|").split(" | ")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.strip("|").split(" | ")))))
    return rows


def test_report_directory_is_readable_by_others_as_the_umask_allows(written):
    """On shared storage others read the report: its directory gets the mode a plain mkdir would
    (0777 less the umask), not the 0700 of the temporary directory it was written in."""
    out, _, _ = written
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask


def test_report_md_table_equals_the_metrics_files(runs, written):
    _, _, records = runs
    out, _, _ = written
    text = (out / "report.md").read_text()
    columns = {f"{SCORE} first 5": "score_first_window", f"{SCORE} last 5": "score_last_window",
               f"{VAL} first": "val_first", f"{VAL} last": "val_last", f"peak {GRAD}": "grad_norm_peak",
               f"mean {CLIP}": "clipfrac_mean", f"mean {DRIFT}": "routing_drift_mean",
               f"mean {DIFF}": "probs_diff_mean", "mean async/staleness_mean": "staleness_mean",
               "wall time (s)": "wall_time_s"}
    rows = _markdown_table(text)
    assert [row["variant"] for row in rows] == ["grpo", "gspo", "grpo_r2"]
    for row in rows:
        expected = _expected(records[row["variant"]])
        for header, name in columns.items():
            if expected[name] is None:
                assert row[header] == "–", (row["variant"], header)
            else:  # 4 significant digits, the wall time to 0.1 s
                tolerance = {"abs": 0.051} if name == "wall_time_s" else {"rel": 1e-3}
                assert float(row[header]) == pytest.approx(expected[name], **tolerance), (row["variant"], header)
    assert [(row["runs"], row["steps"]) for row in rows] == [("2", "30"), ("1", "30"), ("1", "25")]
    assert [row["unstable"] for row in rows] == [f"seed 0: collapse at step {COLLAPSE_STEP}, seed 1: no", "no", "no"]
    assert "window 5 steps, drop 0.5, spike factor 3, learn 0.2" in text
    assert "`actor.loss_mode`" in text and "`seed`" in text and "`actor.clip`" in text  # config differences


def test_r3_shaped_table_has_final_scores_per_seed_and_flags_over_seeds(runs, written):
    _, _, records = runs
    out, _, _ = written
    lines = (out / "report.md").read_text().split("## In the R3 paper's shape")[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| variant |"))
    header = [cell.strip() for cell in lines[start].strip("|").split(" | ")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        row = dict(zip(header, (cell.strip() for cell in line.strip("|").split(" | "))))
        rows[row["variant"]] = row
    finals = [statistics.mean(_values(r, SCORE)[-5:]) for r in records["grpo"]]
    mean, low, high = (float(x) for x in re.findall(r"-?[\d.]+(?:e-?\d+)?", rows["grpo"]["final score (last 5): mean (min – max)"]))
    assert (mean, low, high) == pytest.approx((statistics.mean(finals), min(finals), max(finals)), rel=1e-3)
    assert rows["grpo"]["per seed"] == f"seed 0: {finals[0]:.3g}, seed 1: {finals[1]:.3g}"
    assert rows["grpo"]["flagged / seeds"] == "1 / 2 (1 collapse)" and rows["grpo"]["median flagged step"] == str(COLLAPSE_STEP)
    assert rows["gspo"]["flagged / seeds"] == "0 / 1" and rows["gspo"]["median flagged step"] == "–"
    k3 = statistics.mean(statistics.mean(_values(r, "rollout_corr/k3_kl")) for r in records["grpo"])
    assert float(rows["grpo"]["mean rollout_corr/k3_kl"]) == pytest.approx(k3, rel=1e-3)
    assert rows["grpo_r2"]["mean rollout_corr/k3_kl"] == "–"  # not logged


def test_plots_one_line_per_variant_that_has_the_metric(runs, written):
    _, _, records = runs
    out, _, data = written
    text = (out / "report.md").read_text()
    assert sorted(os.listdir(out)) == sorted([*data["plots"], "report.md", "summary.json"])
    for file, labels in data["plots"].items():
        assert (out / file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", file
        assert f"![{file}]({file})" in text
    for plot in PLOTS:
        having = [v for v, seeds in records.items() if any(_values(r, plot.key) for r in seeds)]
        if having:
            assert data["plots"][plot.file] == having, plot.file
        else:
            assert plot.file not in data["plots"] and plot.file not in text
    assert "entropy.png" not in data["plots"] and "score.png" in data["plots"]
    heat_maps = {file: labels for file, labels in data["plots"].items() if file.startswith("routing_drift_layers_")}
    assert heat_maps == {"routing_drift_layers_grpo.png": ["grpo"], "routing_drift_layers_gspo.png": ["gspo"]}


def test_figure_has_a_line_per_variant_and_a_band_for_several_seeds(runs):
    _, dirs, _ = runs
    groups = group_runs([load_run(d) for d in dirs])
    val_plot = next(plot for plot in PLOTS if plot.key == VAL)
    figure, labels = metric_figure(val_plot, groups)
    axes = figure.axes[0]
    assert labels == ["grpo", "gspo"]
    assert [line.get_label() for line in axes.get_lines()] == ["grpo", "gspo"]
    assert len(axes.collections) == 1  # the min-max band of grpo's two seeds
    grpo_line = axes.get_lines()[0]
    assert list(grpo_line.get_xdata()) == [0, 10, 20, 30]
    assert metric_figure(next(p for p in PLOTS if p.key == "actor/entropy"), groups) is None


def test_the_flag_sits_on_the_flagged_seeds_own_curve_and_heat_maps_share_a_scale(runs):
    _, dirs, records = runs
    groups = group_runs([load_run(d) for d in dirs])
    score_plot = next(plot for plot in PLOTS if plot.key == SCORE)
    collapsed = groups["grpo"][0]
    figure, _ = metric_figure(score_plot, groups, {"grpo": [(collapsed, COLLAPSE_STEP)]})
    axes = figure.axes[0]
    (x,) = [c for c in axes.collections if isinstance(c, PathCollection)]  # the scatter; bands are PolyCollections
    assert tuple(x.get_offsets()[0]) == (COLLAPSE_STEP, _values(records["grpo"][0], SCORE)[COLLAPSE_STEP - 1])
    thin = [line for line in axes.get_lines() if line.get_linewidth() == 0.8]
    assert len(thin) == 1 and list(thin[0].get_ydata()) == _values(records["grpo"][0], SCORE)
    styles = [line.get_linestyle() for line in axes.get_lines() if line.get_label() in groups]
    assert len(set(styles)) == len(styles) == 3  # coinciding variants stay apart
    top = max(v for d in dirs for r in read_jsonl_records(d) for k, v in r.items() if k.startswith(f"{DRIFT}/layer_"))
    for variant in ("grpo", "gspo"):
        mesh = report.drift_heatmap(variant, groups[variant], top).axes[0].collections[0]
        assert mesh.norm.vmin == 0.0 and mesh.norm.vmax == top


def read_jsonl_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as file:
        return [json.loads(line) for line in file]


def test_rule_fires_at_the_planted_step():
    assert instability_step(*_as_series(*_collapsing()), Rule()) == COLLAPSE_STEP
    # The same collapse with the spike 5 steps before the drop crosses 0.5: outside the look-back.
    scores, grads = _collapsing()
    grads[COLLAPSE_STEP - 1], grads[COLLAPSE_STEP - 6] = 1.0, 20.0
    assert instability_step(*_as_series(scores, grads), Rule()) is None
    # A non-finite grad norm counts as a spike.
    grads[COLLAPSE_STEP - 6], grads[COLLAPSE_STEP - 1] = 1.0, math.nan
    assert instability_step(*_as_series(scores, grads), Rule()) == COLLAPSE_STEP


def _as_series(scores, grads):
    """(score series, [the spike metrics' series]): the grad norm alone."""
    return list(enumerate(scores, start=1)), [list(enumerate(grads, start=1))]


def test_a_kl_burst_with_the_collapse_fires_when_the_gradient_vanishes():
    """The tiny preset's GRPO collapse: ppo_kl jumps, the gradient goes to ~0 (all rewards -1)."""
    scores, _ = _collapsing()
    vanishing = [1.0 if s < COLLAPSE_STEP else 0.002 for s in range(1, len(scores) + 1)]
    kl = [0.05] * len(scores)
    kl[COLLAPSE_STEP - 2] = 0.9
    series = list(enumerate(scores, start=1))
    assert instability_step(series, [list(enumerate(vanishing, 1)), list(enumerate(kl, 1))], Rule()) == COLLAPSE_STEP
    assert instability_step(series, [list(enumerate(vanishing, 1))], Rule()) is None


def test_rule_does_not_fire_on_noise_or_a_spike_alone():
    assert instability_step(*_as_series(*_noisy(random.Random(1), steps=200)), Rule()) is None
    assert instability_step(*_as_series(*_spike_without_drop()), Rule()) is None
    # A collapse without a spike is no collapse ...
    scores, _ = _collapsing()
    assert instability_step(*_as_series(scores, [1.0] * len(scores)), Rule()) is None
    # ... but once the score has stayed down for a window, a decline.
    assert instability(*_as_series(scores, [1.0] * len(scores)), Rule()) == ("decline", COLLAPSE_STEP + 4)


def _slow_decline(steps=40):
    """Learns to 0.7 by step 14, then loses 0.06 a step without any burst (a GSPO seed at lr 5e-3)."""
    scores = [min(0.05 * step, 0.7) if step <= 14 else 0.7 - 0.06 * (step - 14) for step in range(1, steps + 1)]
    return scores, [1.0] * steps


def test_a_slow_decline_without_a_burst_is_flagged_as_a_decline():
    scores, grads = _slow_decline()
    smoothed = [statistics.mean(scores[end - 5:end]) for end in range(5, len(scores) + 1)]
    best = [max(smoothed[:i + 1]) for i in range(len(smoothed))]
    below = [b - s > 0.5 for b, s in zip(best, smoothed)]
    first = next(i for i in range(len(below)) if all(below[i - 4:i + 1]) and i >= 4)
    assert instability_step(*_as_series(scores, grads), Rule()) is None  # no burst: the v1 rule misses it
    assert decline_step(list(enumerate(scores, 1)), Rule()) == first + 5  # smoothed index -> step
    assert instability(*_as_series(scores, grads), Rule()) == ("decline", first + 5)
    # A dip that recovers within the window is no decline.
    dip = [0.6] * 20 + [-0.6] * 4 + [0.6] * 16
    assert decline_step(list(enumerate(dip, 1)), Rule()) is None


def test_a_run_that_never_learns_is_flagged_at_its_last_step():
    rng = random.Random(3)
    flat = [-0.8 + rng.uniform(-0.15, 0.15) for _ in range(40)]
    assert instability(*_as_series(flat, [1.0] * 40), Rule()) == ("no learning", 40)
    # learning (the noisy planted curve rises 0.7) is not flagged, nor a run too short to judge
    assert instability(*_as_series(*_noisy(random.Random(1), steps=40)), Rule()) is None
    assert never_learned_step(list(enumerate(flat[:9], 1)), Rule()) is None  # 9 < 2 x window scores
    assert never_learned_step(list(enumerate(flat[:10], 1)), Rule()) == 10
    # a rise of 0.3 (smoothed: first s -0.77, last -0.53) learns at learn 0.2, not at 0.5
    slow = [-0.8 + 0.3 * step / 40 for step in range(1, 41)]
    assert never_learned_step(list(enumerate(slow, 1)), Rule()) is None
    assert never_learned_step(list(enumerate(slow, 1)), Rule(learn=0.5)) == 40


def test_rule_edge_cases():
    # A spike needs `window` earlier grad norms: a huge first few steps are no spike.
    scores = [0.8, 0.8, -1.0, -1.0, -1.0]
    assert instability_step(*_as_series(scores, [1, 100, 100, 100, 100]), Rule(window=2)) is None
    # With window 2, s(3) = -0.1, 0.9 below the best 0.8; a spike at step 3 after 2 earlier values fires.
    assert instability_step(*_as_series(scores, [1, 1, 100, 1, 1]), Rule(window=2)) == 3
    # No score or no grad norm: nothing to fire on.
    assert instability_step([], [list(enumerate([1.0] * 10))], Rule()) is None
    assert instability_step(list(enumerate(scores)), [], Rule()) is None
    for bad in ({"window": 0}, {"drop": 0}, {"spike_factor": -1.0}, {"window": 2.5}, {"learn": 0}):
        with pytest.raises(ReportError, match="--"):
            Rule(**bad)


def test_bad_run_dirs_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ReportError, match=str(missing)):
        write_report([str(missing)], str(tmp_path / "out"))
    empty_dir = tmp_path / "no_metrics"
    empty_dir.mkdir()
    with pytest.raises(ReportError, match=f"{empty_dir} has no metrics.jsonl"):
        write_report([str(empty_dir)], str(tmp_path / "out"))
    empty_file = _write_run(tmp_path / "empty", [])
    with pytest.raises(ReportError, match=f"{empty_file}/metrics.jsonl is empty"):
        write_report([empty_file], str(tmp_path / "out"))
    bad_variant = _write_run(tmp_path / "bad_variant", [{"step": 1, SCORE: 0.1}])
    (tmp_path / "bad_variant" / "variant.json").write_text('{"seed": 0}')
    with pytest.raises(ReportError, match="bad_variant/variant.json"):
        write_report([bad_variant], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _tiny_run(path, variant="tiny", seed=0):
    return _write_run(path, [{"step": step, SCORE: 0.1 * step} for step in range(1, 4)], variant, seed)


def test_report_only_command_exit_codes(tmp_path, capsys):
    """``python -m recipe.compare RUN_DIR ... --out DIR``: the report of finished runs."""
    from recipe.compare import runs as compare

    run = _tiny_run(tmp_path / "run")
    assert compare.main([run, "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.md").is_file()
    capsys.readouterr()
    assert compare.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "other")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(tmp_path / "nowhere") in error
    assert compare.main([run, "--out", str(tmp_path / "other"), "--window", "0"]) == 2
    assert "--window" in capsys.readouterr().err
    assert compare.main([run]) == 2 and "--out REPORT_DIR" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "recipe.compare", run, "--out", str(tmp_path / "cli")],
                          capture_output=True, text=True, cwd=REPO)  # the checkout, installed or not
    assert done.returncode == 0 and "report:" in done.stdout and (tmp_path / "cli" / "summary.json").is_file()


def _leftovers(directory):
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


def test_a_failed_write_leaves_no_partial_report(tmp_path, monkeypatch):
    run = _tiny_run(tmp_path / "run")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ReportError, match=str(blocker)):
        write_report([run], str(blocker / "report"))
    # A failure after the plots were written: no report, no staging directory, the old report kept.
    out = tmp_path / "report"
    write_report([run], str(out))
    before = (out / "summary.json").read_text()

    def fail(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report, "render_markdown", fail)
    with pytest.raises(RuntimeError):
        write_report([run], str(out), Rule(window=2))
    with pytest.raises(RuntimeError):
        write_report([run], str(tmp_path / "fresh"))
    assert (out / "summary.json").read_text() == before
    assert not (tmp_path / "fresh").exists() and _leftovers(tmp_path) == []


def test_an_existing_report_is_replaced_and_other_directories_refused(tmp_path):
    first = _tiny_run(tmp_path / "a", variant="first")
    out = tmp_path / "report"
    write_report([first], str(out))
    (out / "stale.png").write_bytes(b"old")
    second = _tiny_run(tmp_path / "b", variant="second")
    summary = write_report([second], str(out))
    assert [v.variant for v in summary.variants] == ["second"]
    assert not (out / "stale.png").exists() and "second" in (out / "report.md").read_text()
    assert _leftovers(tmp_path) == []
    with pytest.raises(ReportError, match="not a report"):
        write_report([second], str(tmp_path / "a"))  # a run directory is no report to replace
    with pytest.raises(ReportError, match="given twice"):
        write_report([first, first], str(out))


def _run(variant, seed, config, fingerprint=((1.0, 2.0),), hashes=(11.0, 12.0, 13.0)):
    series = {"data/prompt_hash": list(enumerate(hashes, start=1))}
    return report.Run(f"/runs/{variant}/seed_{seed}", variant, seed, series, len(hashes), config,
                      {"initial_weights_fingerprint": [list(f) for f in fingerprint]})


def _config(loss_mode, use_kl, seed, replay="disabled"):
    return {"algo": loss_mode, "trainer": {"seed": seed, "default_local_dir": f"/runs/{loss_mode}/{seed}"},
            "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": loss_mode}, "use_kl_loss": use_kl,
                                            "megatron": {"router_replay": {"mode": replay}}}}}


def test_differences_beyond_the_variant_names_are_named_as_confounds():
    aligned = {"grpo": [_run("grpo", s, _config("vanilla", False, s)) for s in (1, 2)],
               "grpo_r2": [_run("grpo_r2", s, _config("vanilla", False, s, "R2")) for s in (1, 2)],
               "gspo": [_run("gspo", s, _config("gspo", False, s)) for s in (1, 2)]}
    named = ("The variants differ only in what their names say (the algorithm and its loss, replay, rollout "
             "correction, asynchronous mode).")
    assert report.confounds(aligned) == [named]
    # async1's keys (the mode, its own pool and that pool's size) are its name, not a confound
    sync, off = _config("gspo", False, 1), _config("gspo", False, 1)
    sync |= {"async_training": {"mode": "sync"}}
    sync["actor_rollout_ref"] |= {"hybrid_engine": True, "rollout": {"nnodes": None, "n_gpus_per_node": None}}
    off |= {"async_training": {"mode": "one_step_off"}}
    off["actor_rollout_ref"] |= {"hybrid_engine": False, "rollout": {"nnodes": 1, "n_gpus_per_node": 2}}
    assert report.confounds({"gspo": [_run("gspo", 1, sync)], "gspo_async1": [_run("gspo_async1", 1, off)]}) == [named]
    # the IS correction async1 turns on by default is not in its name: a confound against gspo, not
    # against gspo_tis, whose name sets it
    sync["algorithm"], off["algorithm"] = {"rollout_correction": {"rollout_is": None}}, {"rollout_correction": {"rollout_is": "token"}}
    text = "\n".join(report.confounds({"gspo": [_run("gspo", 1, sync)], "gspo_async1": [_run("gspo_async1", 1, off)]}))
    assert "| `algorithm.rollout_correction.rollout_is` | null | \"token\" |" in text
    tis = {**sync, "algorithm": {"rollout_correction": {"rollout_is": "token"}}}
    assert report.confounds({"gspo_tis": [_run("gspo_tis", 1, tis)], "gspo_async1": [_run("gspo_async1", 1, off)]}) == [named]
    assert report.confounds({"gspo": [_run("gspo", 1, sync)], "gspo_tis": [_run("gspo_tis", 1, tis)]}) == [named]
    # grpo with a KL loss that gspo lacks: named, with each variant's value
    kl = {"grpo": [_run("grpo", 1, _config("vanilla", True, 1))], "gspo": [_run("gspo", 1, _config("gspo", False, 1))]}
    text = "\n".join(report.confounds(kl))
    assert "also differ in these settings" in text and "| `actor_rollout_ref.actor.use_kl_loss` | true | false |" in text
    assert "loss_mode" not in text and "seed" not in text  # named by the variant / the run's own


def test_same_start_says_whether_weights_and_prompts_matched():
    same = {"grpo": [_run("grpo", 1, {})], "gspo": [_run("gspo", 1, {})]}
    assert report.same_start(same) == ["Initial weights: the same fingerprint in all 2 runs.", "",
                                       "Prompts, seed 1: the same at all 3 common steps across grpo, gspo."]
    other = {"grpo": [_run("grpo", 1, {}, fingerprint=((1.0, 2.5),), hashes=(11.0, 99.0, 13.0))],
             "gspo": [_run("gspo", 1, {})]}
    assert report.same_start(other) == ["Initial weights: **2 different fingerprints** among the 2 runs.", "",
                                        "Prompts, seed 1: **differ from step 2** (1 of 3 steps)."]

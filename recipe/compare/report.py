"""The comparison report: finished runs of several variants (e.g. GRPO vs GSPO, several seeds
each) side by side, with an automatic flag for the reward collapse reported for GRPO on MoE.

    python -m recipe.compare RUN_DIR [RUN_DIR ...] --out REPORT_DIR [--window 5] [--drop 0.5] [--spike-factor 3.0]
        [--learn 0.2]

``recipe.compare`` calls ``write_report(run_dirs, out_dir, Rule(...))`` after its runs, or on
finished run directories as above.

What it reads, per run directory:

- ``metrics.jsonl`` (``recipe.tracking.loggers``): ``{"step": k, "<metric>": value, ...}`` a line; records
  of the same step are merged (the later value of a key wins). Step 0 may hold only ``val/``
  metrics; a run's *steps* are the steps that log any other metric.
- ``variant.json`` = ``{"variant": "<name>", "seed": <int or null>}`` when present; without it the
  variant is the directory's name and the seed null. Runs sharing a variant are its seeds.
- ``config.json`` when present: keys (dotted paths) whose values differ between runs are listed.

Any metric may be missing from a run: its table cell shows "–" and its plot has no line for that
variant (no file when no run has it). Non-finite values (NaN, inf: a diverged run logs them) are
left out of means, peaks and curves; the instability rule counts a non-finite grad norm as a spike.

What it writes into ``out_dir`` (built in a temporary directory beside it and renamed into place,
so a failure leaves no partial report; an existing report there is replaced, any other non-empty
directory is refused):

- ``report.md``: the settings in which variants differ beyond their names (``confounds``); whether
  the runs started from the same weights and saw the same prompts (``same_start``: the
  fingerprints of ``provenance.json``, ``data/prompt_hash`` per step and seed); the runs compared
  (variant, seed, directory, steps, ``async_training.mode`` from ``config.json``); a table, one row per variant,
  of the first and last ``window``-step mean of ``critic/score/mean`` (over the first/last
  min(window, n) logged values), the first and last logged ``val/score/mean``, the peak
  ``actor/grad_norm``, the mean ``actor/pg_clipfrac``, ``moe/routing_drift/slot_frac`` and
  ``training/rollout_probs_diff_mean``, the mean ``async/staleness_mean`` (policy versions the samples
  were behind: 1 from step 2 on one step off policy, not logged by synchronous runs; ``summary.json``
  also has the largest ``async/staleness_max``), the wall time (sum of ``timing_s/step``, s) and where the
  instability rule fired and which kind of flag it gave, per seed. Every number of a variant is the
  mean over its seeds of each seed's own value (seeds lacking the metric left out); steps are listed
  per seed. Then the table in the R3 paper's shape (``r3_table``), the rule with its parameters,
  the config differences and the plots.
- one PNG a metric (``PLOTS``): every variant's mean over its seeds at each step, with the min–max
  over seeds as a light band when it has several, each variant its own dash pattern; ``score.png``
  marks (x) where the rule fired on the flagged seed's own curve, drawn thin beside the mean.
  ``routing_drift_layers_<variant>.png``: a heat map (layers x steps) of the per-layer
  ``moe/routing_drift/slot_frac/layer_{l}`` (mean over seeds), for each variant that logs them, all
  on one colour scale (0 to the largest value of any variant's map).
- ``summary.json``: ``Summary`` as JSON: the rule, per variant the table's numbers (``stats``) and
  its runs (directory, seed, steps, ``unstable_step``, ``unstable_kind``, ``rule_checked``, their own
  ``stats``), and
  per plot file the labels of the lines drawn (the heat map's: its variant).

The instability rule (``instability``: a collapse, ``instability_step``, or a decline,
``decline_step``, whichever comes first, else no learning, ``never_learned_step``; ``Rule.describe``
says it in the report), per run, with w = ``window``. The collapse: s(t) is the mean of
``critic/score/mean`` over the last w logged values up to step t (defined once w values are
logged; non-finite scores are left out). A *spike* is a step whose ``actor/grad_norm`` or
``actor/ppo_kl`` (the KL to the old policy over the update) exceeds ``spike_factor`` times the
median of that metric's earlier finite values, or is non-finite; it needs at least w earlier
finite values. The rule fires at the first step t where (a) the best s so far (max of s(t') over
t' <= t) minus s(t) exceeds ``drop`` and (b) a spike lies in the last w steps: t - w < spike step
<= t. Reward collapse together with a burst of the gradient or of the policy's step away from the
old policy is the signature reported for GRPO collapse on MoE (gradient norm: R3, arXiv
2510.11370, and "When Speed Kills Stability", Liu, Li et al. 2025; importance-ratio bursts before
collapse: RSPO, arXiv 2510.23027); the tiny stability preset's GRPO collapses show the KL burst
with a vanishing gradient (docs/stability.md). As s averages w steps, the rule fires a step or
more after the score falls: a fall from 0.8 to -1 crosses a 0.5 drop on its second step with
w = 5. A run lacking the score, or both spike metrics, is not checked ("–" in the table). The
defaults (w 5, drop 0.5 = a quarter of DAPO's [-1, 1] score range, factor 3, learn 0.2) are
``Rule()``'s. The decline needs no burst: s stays more than ``drop`` below its best for w steps in
a row. No learning: over at least 2w logged scores, s never rises ``learn`` above s(w).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megatron_bridge.atomic import umask
from megatron_bridge.errors import ConfigError, UserError
from recipe.compare.variants import VARIANT_FILE, variant_keys
from recipe.run_dir import CONFIG_FILE, PROVENANCE_FILE
from recipe.tracking.figures import MISSING, Plot, across_runs, cell, markdown_table, metric_figure
from recipe.tracking.loggers import METRICS_FILE, read_jsonl

SCORE = "critic/score/mean"
VAL_SCORE = "val/score/mean"
GRAD_NORM = "actor/grad_norm"
PPO_KL = "actor/ppo_kl"
SPIKE_METRICS = (GRAD_NORM, PPO_KL)  # a burst of either, with the score falling, marks instability
DRIFT = "moe/routing_drift/slot_frac"
K3_KL = "rollout_corr/k3_kl"
STEP_TIME = "timing_s/step"
STALENESS = "async/staleness_mean"
STALENESS_MAX = "async/staleness_max"
PROMPT_HASH = "data/prompt_hash"
# Keys that differ between runs by construction: each run's own seed, directory and name.
RUN_IDENTITY = ("trainer.seed", "data.seed", "trainer.default_local_dir", "trainer.experiment_name",
                "trainer.resume_mode")
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"


class ReportError(UserError, ValueError):
    """A run directory, metrics file or report parameter that cannot be used; the message names it
    and the fix."""


@dataclass(frozen=True)
class Rule:
    """The instability rule's parameters (module docstring)."""

    window: int = 5
    drop: float = 0.5
    spike_factor: float = 3.0
    learn: float = 0.2

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ReportError(f"--window must be an integer >= 1 (steps), got {self.window!r}")
        if not self.drop > 0 or not math.isfinite(self.drop):
            raise ReportError(f"--drop must be a positive score difference, got {self.drop!r}")
        if not self.spike_factor > 0 or not math.isfinite(self.spike_factor):
            raise ReportError(f"--spike-factor must be a positive factor, got {self.spike_factor!r}")
        if not self.learn > 0 or not math.isfinite(self.learn):
            raise ReportError(f"--learn must be a positive score difference, got {self.learn!r}")

    def describe(self) -> str:
        w = self.window
        return (
            f"With s(t) = mean of `{SCORE}` over the last {w} logged values up to step t (defined once "
            f"{w} values are logged; non-finite scores left out), a run is flagged at the first step t of "
            f"one of: **collapse**: the best s so far minus s(t) exceeds {self.drop:g} and one of the last "
            f"{w} steps up to t is a spike: `{GRAD_NORM}` or `{PPO_KL}` above {self.spike_factor:g} x the "
            f"median of that metric's earlier finite values (at least {w} needed), or non-finite (reward "
            "collapse with a burst of the gradient or of the step away from the old policy: the signature "
            f"reported for GRPO collapse on MoE); **decline**: s has stayed more than {self.drop:g} below "
            f"its best for {w} steps in a row, with or without a burst (the slow decline); if neither, **no "
            f"learning**: with at least {2 * w} scores logged, s never rose {self.learn:g} above its first "
            f"value s({w}) (flagged at the last step). A collapse and a decline at the same step count as a "
            "collapse. \"–\": the run lacks the score or both spike metrics."
        )




PLOTS: tuple[Plot, ...] = (
    Plot("score.png", SCORE, "training reward"),
    Plot("val_score.png", VAL_SCORE, "validation score"),
    Plot("clipfrac.png", "actor/pg_clipfrac", "clipped fraction"),
    Plot("ppo_kl.png", "actor/ppo_kl", "KL old -> current policy"),
    Plot("entropy.png", "actor/entropy", "entropy"),
    Plot("grad_norm.png", GRAD_NORM, "grad norm", log_y=True),
    Plot("response_length.png", "response_length/mean", "mean response length (tokens)"),
    Plot("routing_drift.png", DRIFT, "changed expert slots, old -> updated policy"),
    Plot("replay_override.png", "moe/replay_override/slot_frac", "router choice overridden by replay"),
    Plot("rollout_routing_mismatch.png", "moe/rollout_routing_mismatch/slot_frac", "rollout vs training routing"),
    Plot("rollout_probs_diff.png", "training/rollout_probs_diff_mean", "mean |p_train - p_rollout|"),
    Plot("k3_kl.png", K3_KL, "k3 KL rollout -> training"),
    Plot("step_time.png", STEP_TIME, "step time (s)"),
)
LAYER_KEY = re.compile(re.escape(DRIFT) + r"/layer_(\d+)$")


@dataclass(frozen=True)
class Run:
    path: str
    variant: str
    seed: int | None
    series: dict[str, list[tuple[int, float]]]  # metric -> (step, value) in step order
    steps: int
    config: dict | None
    provenance: dict | None = None

    def label(self, among_seeds: bool) -> str:
        """How the report names this run among its variant's seeds (or across variants)."""
        own = f"seed {self.seed}" if self.seed is not None else os.path.basename(os.path.normpath(self.path))
        return own if among_seeds or own == self.variant else f"{self.variant} {own}"

    def finite(self, key: str) -> list[float]:
        return [value for _, value in self.series.get(key, []) if math.isfinite(value)]

    @property
    def mode(self) -> str | None:
        """``async_training.mode`` from config.json (``sync`` where the key predates the modes); None without one."""
        return None if self.config is None else self.config.get("async_training", {}).get("mode", "sync")


@dataclass(frozen=True)
class Stats:
    """The table's numbers, for one run or (means over seeds) one variant; None: not logged."""

    score_first_window: float | None
    score_last_window: float | None
    val_first: float | None
    val_last: float | None
    grad_norm_peak: float | None
    clipfrac_mean: float | None
    routing_drift_mean: float | None
    probs_diff_mean: float | None
    k3_kl_mean: float | None  # the train-rollout KL (rollout_corr/k3_kl)
    staleness_mean: float | None  # policy versions behind (one_step_off: 0 at step 1, then 1)
    staleness_max: float | None
    wall_time_s: float | None


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    seed: int | None
    steps: int
    unstable_step: int | None
    unstable_kind: str | None  # collapse | decline | no learning (Rule.describe)
    rule_checked: bool  # False: the run lacks the score or both spike metrics
    stats: Stats


@dataclass(frozen=True)
class VariantSummary:
    variant: str
    runs: list[RunSummary]
    stats: Stats


@dataclass(frozen=True)
class Summary:
    """What ``write_report`` returns and ``summary.json`` holds."""

    rule: Rule
    variants: list[VariantSummary]
    plots: dict[str, list[str]] = field(default_factory=dict)  # file -> labels of its lines


# ---- reading runs ----------------------------------------------------------------------------


def _read_json(path: str) -> object:
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except json.JSONDecodeError as err:
        raise ReportError(f"{path}: not valid JSON ({err}); fix or delete the file") from err
    except OSError as err:
        raise ReportError(f"cannot read {path}: {err.strerror}") from err


def _variant_and_seed(run_dir: str) -> tuple[str, int | None]:
    path = os.path.join(run_dir, VARIANT_FILE)
    if not os.path.isfile(path):
        return os.path.basename(os.path.normpath(run_dir)), None
    data = _read_json(path)
    variant = data.get("variant") if isinstance(data, dict) else None
    seed = data.get("seed") if isinstance(data, dict) else None
    if not isinstance(variant, str) or not variant or not (seed is None or type(seed) is int):
        raise ReportError(f'{path}: expected {{"variant": "<name>", "seed": <int>}}, got {data!r}; fix it, or '
                          "delete it to use the directory's name as the variant")
    return variant, seed


def load_run(run_dir: str) -> Run:
    """One run directory's metrics, variant, seed and config (module docstring)."""
    if not os.path.isdir(run_dir):
        raise ReportError(f"run directory {run_dir} does not exist; pass the directory of a finished run")
    metrics_path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(metrics_path):
        raise ReportError(f"run directory {run_dir} has no {METRICS_FILE}; "
                          "pass the directory of a run that logged metrics")
    try:
        records = read_jsonl(metrics_path)
    except OSError as err:
        raise ReportError(f"cannot read {metrics_path}: {err.strerror}") from err
    if not records:
        raise ReportError(f"{metrics_path} is empty: the run logged no step; pass a run that ran at least one step")
    merged: dict[int, dict[str, float]] = {}
    for record in records:
        step = record["step"]
        for key, value in record.items():
            if key == "step":
                continue
            if type(value) not in (int, float):
                raise ReportError(f"{metrics_path}: step {step}: {key!r} is {value!r}, not a number; "
                                  "metrics files hold numbers only, fix or delete that line")
            merged.setdefault(step, {})[key] = float(value)
    series: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(merged):
        for key, value in merged[step].items():
            series.setdefault(key, []).append((step, value))
    steps = sum(any(not key.startswith("val/") for key in values) for values in merged.values())
    config_path = os.path.join(run_dir, CONFIG_FILE)
    config = _read_json(config_path) if os.path.isfile(config_path) else None
    variant, seed = _variant_and_seed(run_dir)
    provenance_path = os.path.join(run_dir, PROVENANCE_FILE)
    provenance = _read_json(provenance_path) if os.path.isfile(provenance_path) else None
    return Run(run_dir, variant, seed, series, steps, config if isinstance(config, dict) else None,
               provenance if isinstance(provenance, dict) else None)


def group_runs(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """Runs by variant, variants and their seeds in the order given."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.variant, []).append(run)
    return groups


# ---- numbers ---------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _spike_steps(series: Sequence[tuple[int, float]], rule: Rule) -> list[int]:
    spikes: list[int] = []
    earlier: list[float] = []
    for step, value in series:
        if len(earlier) >= rule.window and (
                not math.isfinite(value) or value > rule.spike_factor * statistics.median(earlier)):
            spikes.append(step)
        if math.isfinite(value):
            earlier.append(value)
    return spikes


def _smoothed(score: Sequence[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """(t, s(t)) for every step once ``window`` finite scores are logged (module docstring)."""
    score = [(step, value) for step, value in score if math.isfinite(value)]
    return [(score[end - 1][0], statistics.fmean(value for _, value in score[end - window:end]))
            for end in range(window, len(score) + 1)]


def instability_step(score: Sequence[tuple[int, float]], signals: Sequence[Sequence[tuple[int, float]]],
                     rule: Rule) -> int | None:
    """The first step of a collapse (the score falls with a spike, module docstring), None where
    there is none. ``score`` and each of ``signals`` (the spike metrics) are (step, value) in step
    order; non-finite scores are left out."""
    spikes = [step for series in signals for step in _spike_steps(series, rule)]
    best = -math.inf
    for step, smoothed in _smoothed(score, rule.window):
        best = max(best, smoothed)
        if best - smoothed > rule.drop and any(step - rule.window < spike <= step for spike in spikes):
            return step
    return None


def decline_step(score: Sequence[tuple[int, float]], rule: Rule) -> int | None:
    """The step at which the smoothed score has stayed more than ``rule.drop`` below its best for
    ``rule.window`` steps in a row; None where it never has."""
    best, below = -math.inf, 0
    for step, smoothed in _smoothed(score, rule.window):
        best = max(best, smoothed)
        below = below + 1 if best - smoothed > rule.drop else 0
        if below >= rule.window:
            return step
    return None


def never_learned_step(score: Sequence[tuple[int, float]], rule: Rule) -> int | None:
    """The last step of a run whose smoothed score never rose ``rule.learn`` above its first value
    (judged with at least 2 x window finite scores); None otherwise."""
    smoothed = _smoothed(score, rule.window)
    if len(smoothed) < rule.window + 1:  # fewer than 2 x window scores
        return None
    first = smoothed[0][1]
    return smoothed[-1][0] if max(value for _, value in smoothed) - first < rule.learn else None


def instability(score: Sequence[tuple[int, float]], signals: Sequence[Sequence[tuple[int, float]]],
                rule: Rule) -> tuple[str, int] | None:
    """(kind, step) of the flag the rule gives a run (``Rule.describe``), None where it gives none."""
    found = [(step, kind) for kind, step in (("collapse", instability_step(score, signals, rule)),
                                             ("decline", decline_step(score, rule))) if step is not None]
    if found:
        step, kind = min(found)  # the earlier; at the same step "collapse" sorts first
        return kind, step
    step = never_learned_step(score, rule)
    return None if step is None else ("no learning", step)


def run_stats(run: Run, window: int) -> Stats:
    score, val, grad = run.finite(SCORE), run.finite(VAL_SCORE), run.finite(GRAD_NORM)
    return Stats(
        score_first_window=_mean(score[:window]),
        score_last_window=_mean(score[-window:]),
        val_first=val[0] if val else None,
        val_last=val[-1] if val else None,
        grad_norm_peak=max(grad) if grad else None,
        clipfrac_mean=_mean(run.finite("actor/pg_clipfrac")),
        routing_drift_mean=_mean(run.finite(DRIFT)),
        probs_diff_mean=_mean(run.finite("training/rollout_probs_diff_mean")),
        k3_kl_mean=_mean(run.finite(K3_KL)),
        staleness_mean=_mean(run.finite(STALENESS)),
        staleness_max=max(run.finite(STALENESS_MAX), default=None),
        wall_time_s=math.fsum(run.finite(STEP_TIME)) if STEP_TIME in run.series else None,
    )


def summarize(groups: dict[str, list[Run]], rule: Rule) -> Summary:
    """Per run and per variant (means over seeds) the table's numbers and where the rule fired."""
    variants = []
    for name, runs in groups.items():
        summaries = []
        for run in runs:
            kind, step = instability(run.series.get(SCORE, []), [run.series.get(m, []) for m in SPIKE_METRICS],
                                     rule) or (None, None)
            checked = SCORE in run.series and any(m in run.series for m in SPIKE_METRICS)
            stats = run_stats(run, rule.window)
            summaries.append(RunSummary(run.path, run.seed, run.steps, step, kind, checked, stats))
        means = {
            stat.name: _mean([value for s in summaries if (value := getattr(s.stats, stat.name)) is not None])
            for stat in fields(Stats)
        }
        variants.append(VariantSummary(name, summaries, Stats(**means)))
    return Summary(rule, variants)


# ---- plots -----------------------------------------------------------------------------------






def _edges(centres: Sequence[float]) -> list[float]:
    """Cell edges around sorted centres (steps or layers), halfway between neighbours."""
    if len(centres) == 1:
        return [centres[0] - 0.5, centres[0] + 0.5]
    middles = [(a + b) / 2 for a, b in zip(centres, centres[1:])]
    return [2 * centres[0] - middles[0], *middles, 2 * centres[-1] - middles[-1]]


def drift_heatmap(variant: str, runs: Sequence[Run], top: float | None = None) -> Figure | None:
    """Layers x steps of the per-layer routing drift (mean over seeds), coloured from 0 to ``top``
    (one scale for every variant's map; None: this map's own maximum); None without those metrics."""
    layers = sorted({int(m.group(1)) for run in runs for key in run.series if (m := LAYER_KEY.match(key))})
    rows = [across_runs(runs, f"{DRIFT}/layer_{layer}") for layer in layers]
    steps = sorted({step for row in rows for step in row[0]})
    if not steps:
        return None
    column = {step: index for index, step in enumerate(steps)}
    grid = [[math.nan] * len(steps) for _ in layers]
    for cells, (row_steps, mean, _, _) in zip(grid, rows):
        for step, value in zip(row_steps, mean):
            cells[column[step]] = value
    figure = Figure(figsize=(8, max(3.0, 0.25 * len(layers) + 1.5)), layout="constrained")
    axes = figure.add_subplot()
    mesh = axes.pcolormesh(_edges(steps), _edges(layers), grid, cmap="viridis", vmin=0.0, vmax=top)
    figure.colorbar(mesh, ax=axes, label="changed expert slots (fraction)")
    axes.set(title=f"{DRIFT} per layer: {variant}", xlabel="step", ylabel="layer")
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    return figure


def _file_stem(variant: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", variant)


def _write_plots(directory: str, groups: dict[str, list[Run]], summary: Summary) -> dict[str, list[str]]:
    marks = {v.variant: [(run, s.unstable_step) for run, s in zip(groups[v.variant], v.runs) if s.unstable_step is not None]
             for v in summary.variants}
    figures: dict[str, tuple[Figure, list[str]]] = {}
    for plot in PLOTS:
        drawn = metric_figure(plot, groups, marks if plot.key == SCORE else None)
        if drawn is not None:
            figures[plot.file] = drawn
    top = max((value for runs in groups.values() for run in runs for key in run.series if LAYER_KEY.match(key)
               for value in run.finite(key)), default=None)
    for variant, runs in groups.items():
        file = f"routing_drift_layers_{_file_stem(variant)}.png"
        heatmap = drift_heatmap(variant, runs, top)
        if heatmap is None:
            continue
        if file in figures:
            raise ReportError(f"variants {variant!r} and {figures[file][1][0]!r} both give the file name {file}; "
                              f"rename one in its {VARIANT_FILE}")
        figures[file] = (heatmap, [variant])
    for file, (figure, _) in figures.items():
        FigureCanvasAgg(figure)
        figure.savefig(os.path.join(directory, file), dpi=100)
    return {file: labels for file, (_, labels) in figures.items()}


# ---- report.md -------------------------------------------------------------------------------




def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys and their values in JSON."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value, default=str)
    return out


def _shorten(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _named_by(variant: str) -> set[str]:
    """The config keys variant ``variant``'s name sets (``recipe.compare.variants``): the algorithm and its
    loss mode, and each part's overrides (an async part's rollout pool too). A name that is not a
    variant of ``recipe.compare`` (a report on other run directories) is taken to set all of them."""
    try:
        keys = variant_keys(variant)
    except ConfigError:
        keys = variant_keys()
    return keys | {"actor_rollout_ref.actor.policy_loss.loss_mode"}


def _explained(values: dict[str, set[str]], named_keys: dict[str, set[str]], key: str) -> bool:
    """A key's differences are the variants' own when the variants whose names do not set it agree on it."""
    unnamed = {value for variant, held in values.items() if key not in named_keys[variant] for value in held}
    return len(unnamed) <= 1


def confounds(groups: dict[str, list[Run]]) -> list[str]:
    """The config keys on which variants differ beyond what their names say (and beyond each run's
    own seed, directory and name): differences a reader must weigh besides the variants' own. A
    key differs beyond the names when variants whose names do not set it hold different values of
    it (e.g. the IS correction an async variant turns on by default, which the synchronous one lacks)."""
    runs = [run for group in groups.values() for run in group]
    if any(run.config is None for run in runs) or len(groups) < 2:
        return [f"Not checked: {'a run has no ' + CONFIG_FILE if len(groups) > 1 else 'one variant only'}."]
    flat = {variant: [flatten(run.config) for run in group] for variant, group in groups.items()}
    named_keys = {variant: _named_by(variant) for variant in groups}
    keys = sorted({key for configs in flat.values() for values in configs for key in values} - set(RUN_IDENTITY))
    values = {key: {variant: {v.get(key, MISSING) for v in configs} for variant, configs in flat.items()} for key in keys}
    differing = [key for key in keys if len(set().union(*values[key].values())) > 1
                 and not _explained(values[key], named_keys, key)]
    if not differing:
        return ["The variants differ only in what their names say (the algorithm and its loss, replay, "
                "rollout correction, asynchronous mode)."]
    rows = [[f"`{key}`", *(cell(_shorten(" / ".join(sorted({str(v.get(key, MISSING)) for v in flat[variant]}))))
                           for variant in groups)] for key in differing]
    return ["**The variants also differ in these settings**: part of any difference between them may come "
            "from these, not from what their names say.", "", *markdown_table(["key", *groups], rows)]


def same_start(groups: dict[str, list[Run]]) -> list[str]:
    """Whether the runs started from the same weights (``provenance.json``'s fingerprint) and, seed
    by seed, saw the same prompts at every step (``data/prompt_hash``)."""
    runs = [run for group in groups.values() for run in group]
    prints = {json.dumps(run.provenance.get("initial_weights_fingerprint")) for run in runs if run.provenance}
    with_print = sum(1 for run in runs if run.provenance and "initial_weights_fingerprint" in run.provenance)
    if with_print < len(runs):
        missing = len(runs) - with_print
        weights = f"Initial weights: {missing} of {len(runs)} runs have no fingerprint ({PROVENANCE_FILE})."
    elif len(prints) == 1:
        weights = f"Initial weights: the same fingerprint in all {len(runs)} runs."
    else:
        weights = f"Initial weights: **{len(prints)} different fingerprints** among the {len(runs)} runs."
    lines = [weights]
    by_seed: dict[int | None, list[Run]] = {}
    for run in runs:
        by_seed.setdefault(run.seed, []).append(run)
    for seed, seeds_runs in by_seed.items():
        hashes = [dict(run.series.get(PROMPT_HASH, [])) for run in seeds_runs]
        if len(seeds_runs) < 2:
            continue
        if not all(hashes):
            lines.append(f"Prompts, seed {seed}: not checked (a run does not log `{PROMPT_HASH}`).")
            continue
        shared = sorted(set.intersection(*(set(h) for h in hashes)))
        differ = [step for step in shared if len({h[step] for h in hashes}) > 1]
        lines.append(f"Prompts, seed {seed}: " + (f"the same at all {len(shared)} common steps across "
                     f"{', '.join(run.variant for run in seeds_runs)}." if not differ else
                     f"**differ from step {differ[0]}** ({len(differ)} of {len(shared)} steps)."))
    return [line for text in lines for line in (text, "")][:-1]


def _config_differences(runs: Sequence[Run]) -> list[str]:
    if all(run.config is None for run in runs):
        return [f"No run directory has a {CONFIG_FILE}."]
    flat = [flatten(run.config) if run.config is not None else {} for run in runs]
    keys = sorted({key for values in flat for key in values if len({v.get(key) for v in flat}) > 1})
    if not keys:
        return [f"The runs' {CONFIG_FILE} files agree on every key."]
    rows = [[f"`{key}`", *(cell(_shorten(values[key]) if key in values else None) for values in flat)] for key in keys]
    return markdown_table(["key", *(run.label(among_seeds=False) for run in runs)], rows)


COLUMNS: tuple[tuple[str, str, str], ...] = (  # header ({w}: the window), Stats field, number format
    (f"{SCORE} first {{w}}", "score_first_window", ".4g"),
    (f"{SCORE} last {{w}}", "score_last_window", ".4g"),
    (f"{VAL_SCORE} first", "val_first", ".4g"),
    (f"{VAL_SCORE} last", "val_last", ".4g"),
    (f"peak {GRAD_NORM}", "grad_norm_peak", ".4g"),
    ("mean actor/pg_clipfrac", "clipfrac_mean", ".4g"),
    (f"mean {DRIFT}", "routing_drift_mean", ".4g"),
    ("mean training/rollout_probs_diff_mean", "probs_diff_mean", ".4g"),
    (f"mean {STALENESS}", "staleness_mean", ".4g"),
    ("wall time (s)", "wall_time_s", ".1f"),
)


def _unstable_cell(variant: VariantSummary, runs: Sequence[Run]) -> str:
    def verdict(run: RunSummary) -> str:
        if run.unstable_step is not None:
            return f"{run.unstable_kind} at step {run.unstable_step}"
        return "no" if run.rule_checked else MISSING

    if len(runs) == 1:
        return verdict(variant.runs[0])
    return ", ".join(f"{run.label(among_seeds=True)}: {verdict(s)}" for run, s in zip(runs, variant.runs))


def _spread(values: Sequence[float]) -> str:
    """mean (min – max) of the seeds' values; the one value for one seed."""
    if not values:
        return MISSING
    if len(values) == 1:
        return cell(values[0])
    return f"{cell(statistics.fmean(values))} ({cell(min(values))} – {cell(max(values))})"


def r3_table(summary: Summary, groups: dict[str, list[Run]]) -> list[str]:
    """Per variant, in the shape of the R3 paper's results table (arXiv 2510.11370): the final score
    over seeds and per seed, flagged runs of each kind over seeds, the median step they were flagged
    at, the mean routing drift and train-rollout KL."""
    rows = []
    for variant in summary.variants:
        finals = [r.stats.score_last_window for r in variant.runs if r.stats.score_last_window is not None]
        per_seed = ", ".join(f"{run.label(among_seeds=True)}: {cell(s.stats.score_last_window, '.3g')}"
                             for run, s in zip(groups[variant.variant], variant.runs))
        flagged = [r for r in variant.runs if r.unstable_step is not None]
        counts = {kind: sum(r.unstable_kind == kind for r in flagged) for kind in ("collapse", "decline", "no learning")}
        kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
        checked = sum(r.rule_checked for r in variant.runs)
        rows.append([cell(variant.variant), _spread(finals), per_seed,
                     f"{len(flagged)} / {checked}" + (f" ({kinds})" if kinds else ""),
                     cell(statistics.median(r.unstable_step for r in flagged) if flagged else None, "g"),
                     cell(variant.stats.routing_drift_mean), cell(variant.stats.k3_kl_mean)])
    w = summary.rule.window
    return markdown_table(["variant", f"final score (last {w}): mean (min – max)", "per seed", "flagged / seeds",
                   "median flagged step", f"mean {DRIFT}", f"mean {K3_KL}"], rows)


def render_markdown(summary: Summary, groups: dict[str, list[Run]]) -> str:
    window = summary.rule.window
    runs = [run for group in groups.values() for run in group]
    compared = markdown_table(["variant", "seed", "run directory", "steps", "mode"],
                      [[cell(r.variant), cell(r.seed), f"`{r.path}`", str(r.steps), cell(r.mode)] for r in runs])
    rows = []
    for variant in summary.variants:
        steps = sorted({r.steps for r in variant.runs})
        rows.append([cell(variant.variant), str(len(variant.runs)), " / ".join(map(str, steps)),
                     *(cell(getattr(variant.stats, name), spec) for _, name, spec in COLUMNS),
                     _unstable_cell(variant, groups[variant.variant])])
    table = markdown_table(["variant", "runs", "steps", *(h.format(w=window) for h, _, _ in COLUMNS), "unstable"], rows)
    titles = {plot.file: f"{plot.key}: {plot.label}" for plot in PLOTS}
    plots = [line for file, labels in summary.plots.items()
             for line in (f"### {titles.get(file, f'{DRIFT} per layer: {labels[0]}')}", "", f"![{file}]({file})", "")]
    lines = [
        f"# Run comparison: {', '.join(groups)}", "",
        "## Differences beyond the variant names", "", *confounds(groups), "",
        "## Same start, same prompts", "", *same_start(groups), "",
        "## Runs compared", "", *compared, "",
        "## Summary", "",
        f"Per variant, the mean over its seeds of each seed's own value (\"{MISSING}\": not logged). "
        f"`{SCORE}` first/last {window}: the mean of the first/last {window} logged values; "
        f"`{VAL_SCORE}` first/last: the first/last logged value; `{STALENESS}`: policy versions the samples "
        f"were behind (asynchronous modes only); wall time: the sum of `{STEP_TIME}`. "
        "\"unstable\": the step where the instability rule fired, per seed.", "",
        *table, "",
        "## In the R3 paper's shape", "",
        "Per variant over its seeds (the R3 paper, arXiv 2510.11370, reports its runs this way): the final "
        f"score as the mean of the last {window} logged values, every seed's beside it; runs the instability "
        "rule flagged, by kind, over the seeds it could check; the median step of those flags; the mean routing "
        "drift and train-rollout KL over the steps.", "",
        *r3_table(summary, groups), "",
        "## Instability rule", "",
        summary.rule.describe(), "",
        f"Parameters: window {window} steps, drop {summary.rule.drop:g}, spike factor {summary.rule.spike_factor:g}, "
        f"learn {summary.rule.learn:g}.", "",
        "## Config differences", "", *_config_differences(runs), "",
        "## Plots", "",
        "One line per variant: the mean over its seeds at each step, the min–max over seeds as a band; "
        "x on score.png: where the rule fired, on the flagged seed's own (thin) curve; the per-layer heat maps "
        "share one colour scale.", "",
        *plots,
    ]
    return "\n".join(lines).rstrip() + "\n"


# ---- writing ---------------------------------------------------------------------------------


def _check_out(out_dir: str) -> None:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ReportError(f"--out {out_dir} exists and is not a directory; choose another --out")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, SUMMARY_FILE)):
        raise ReportError(f"--out {out_dir} is a non-empty directory without {SUMMARY_FILE}, not a report this "
                          "replaces; choose another --out or empty it")


def _move_into_place(staging: str, out_dir: str) -> None:
    if not os.path.isdir(out_dir):
        os.rename(staging, out_dir)
        return
    old = staging + ".old"  # the old report moves aside, the new one in, then the old goes
    os.rename(out_dir, old)
    try:
        os.rename(staging, out_dir)
    except OSError:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old)


def write_report(run_dirs: Sequence[str], out_dir: str, rule: Rule = Rule()) -> Summary:
    """Read ``run_dirs``, write the report into ``out_dir`` (module docstring) and return its summary.
    Raises ``ReportError`` (a ValueError) naming the unusable input; nothing is left half-written."""
    if not run_dirs:
        raise ReportError("no run directories given; pass at least one")
    if len(set(map(os.path.realpath, run_dirs))) < len(run_dirs):
        raise ReportError(f"a run directory is given twice in {list(run_dirs)}; pass each once")
    groups = group_runs([load_run(run_dir) for run_dir in run_dirs])
    summary = summarize(groups, rule)
    _check_out(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.", dir=parent)
        os.chmod(staging, 0o777 & ~umask())  # mkdtemp's 0700 would hide the report from others on shared storage
    except OSError as err:
        raise ReportError(f"cannot create the report directory {out_dir}: {err}; choose another --out") from err
    try:
        summary = Summary(summary.rule, summary.variants, _write_plots(staging, groups, summary))
        with open(os.path.join(staging, SUMMARY_FILE), "w", encoding="utf-8") as file:
            json.dump(asdict(summary), file, indent=2, allow_nan=False)
        with open(os.path.join(staging, REPORT_FILE), "w", encoding="utf-8") as file:
            file.write(render_markdown(summary, groups))
        _move_into_place(staging, out_dir)
    except OSError as err:
        raise ReportError(f"cannot write the report to {out_dir}: {err}; choose another --out") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


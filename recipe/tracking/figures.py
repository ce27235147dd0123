"""Tables and figures of metric series, as the comparison's report (``recipe.compare.report``) and
``evaluate`` write them: markdown cells and tables, and one metric's curves, one line per group of
runs (their mean, with the band from their minimum to their maximum)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from matplotlib.figure import Figure

MISSING = "–"  # a table's cell without a value

Series = dict[str, list[tuple[int, float]]]  # metric -> (step, value) in step order


class Curves(Protocol):
    """A run as a figure reads it: its metrics' series."""

    series: Series


@dataclass(frozen=True)
class Logged:
    """Series with nothing else to them (``evaluate``'s scores per step)."""

    series: Series


@dataclass(frozen=True)
class Plot:
    file: str
    key: str
    label: str  # the y axis
    log_y: bool = False  # when every value is positive: a spike must not flatten the rest


def across_runs(runs: Sequence[Curves], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, and at each the mean, min and max over the runs that logged a finite value there."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for step, value in run.series.get(key, []):
            if math.isfinite(value):
                by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return (steps, [statistics.fmean(by_step[s]) for s in steps],
            [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps])


# Lines that coincide (variants that behave alike) stay visible: each group its own dash pattern,
# the later ones thinner, so one drawn over another leaves the other showing at its sides.
LINE_STYLES = ("-", "--", ":", "-.")


def metric_figure(plot: Plot, groups: dict[str, Sequence[Curves]],
                  marks: dict[str, list[tuple[Curves, int]]] | None = None) -> tuple[Figure, list[str]] | None:
    """The figure of one metric, one line a group that logs it, and its line labels; None when no
    group logs it. ``marks``: per group, (run, step) to flag with an x on that run's own curve,
    drawn thin beside the group's mean."""
    figure = Figure(figsize=(7, 4), layout="constrained")
    axes = figure.add_subplot()
    labels, lowest, marks = [], math.inf, marks or {}
    for index, (group, runs) in enumerate(groups.items()):
        steps, mean, low, high = across_runs(runs, plot.key)
        if not steps:
            continue
        (line,) = axes.plot(steps, mean, label=group, marker="o" if len(steps) <= 12 else None, markersize=3,
                            linestyle=LINE_STYLES[index % len(LINE_STYLES)], linewidth=max(2.6 - 0.4 * index, 1.0))
        if sum(plot.key in run.series for run in runs) > 1:
            axes.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        for run, step in marks.get(group, []):
            own = dict(run.series.get(plot.key, []))
            if step in own:
                axes.plot(*zip(*run.series[plot.key]), color=line.get_color(), linewidth=0.8, alpha=0.6)
                axes.scatter([step], [own[step]], marker="x", s=80, color=line.get_color(), zorder=3)
        labels.append(group)
        lowest = min(lowest, *low)
    if not labels:
        return None
    if plot.log_y and lowest > 0:
        axes.set_yscale("log")
    axes.set(title=plot.key, xlabel="step", ylabel=plot.label)
    axes.grid(alpha=0.3)
    axes.legend()
    return figure, labels


def cell(value: object, spec: str = ".4g") -> str:
    """A markdown table's cell: floats formatted by ``spec``, None as MISSING, pipes escaped."""
    if value is None:
        return MISSING
    text = format(value, spec) if isinstance(value, float) else str(value)
    return text.replace("|", "\\|")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]

"""Where per-step metrics go: a JSONL file in the run directory (always), plus optional console,
TensorBoard, SwanLab and Weights & Biases backends; and a plain-text chart of a metric.

The JSONL file is the run's own record (``<run_dir>/metrics.jsonl``, one ``{"step": k, ...}``
object per line, flushed per line) that resume, tests and ``ascii_curve`` read back. Optional
backends are imported only when named, so a missing package fails at start, not mid-run.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any, Protocol

from tqdm import tqdm

from megatron_bridge.atomic import write_text
from megatron_bridge.errors import UserError

LOGGERS: tuple[str, ...] = ("console", "jsonl", "tensorboard", "swanlab", "wandb")
METRICS_FILE = "metrics.jsonl"

# Metrics the console line shows (those present), with short labels to keep it on one line.
CONSOLE_METRICS: tuple[tuple[str, str], ...] = (
    ("critic/score/mean", "score"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/grad_norm", "grad_norm"),
    ("response_length/mean", "resp_len"),
    ("timing_s/step", "step_s"),
    ("val/score/mean", "val_score"),
)


def on_terminal() -> bool:
    """Progress bars are drawn only on a terminal: into CI, ``ray job submit`` or a redirected log
    every redraw would land as a line of its own."""
    return sys.stderr.isatty()


def progress_bar(iterable: Any = None, **kwargs: Any) -> tqdm:
    """tqdm on a terminal, a silent pass-through elsewhere (``on_terminal``)."""
    kwargs["disable"] = kwargs.get("disable", False) or not on_terminal()
    return tqdm(iterable, **kwargs)


class LoggerError(UserError, ValueError):
    """Bad logger configuration, metric value or metrics file; the message names it and the fix."""


class _Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _import_backend(logger: str, pip_package: str, importer: Callable[[], Any]) -> Any:
    try:
        return importer()
    except ImportError as err:
        raise LoggerError(
            f"logger {logger!r} needs the {pip_package!r} package, which is not installed: "
            f"`pip install {pip_package}`, or drop {logger!r} from the loggers"
        ) from err


class _Console:
    def log(self, metrics: dict[str, float], step: int) -> None:
        fields = [f"{label} {metrics[key]:.4g}" for key, label in CONSOLE_METRICS if key in metrics]
        tqdm.write(" | ".join([f"step {step}", *fields]))

    def close(self) -> None:
        pass


class _Tensorboard:
    def __init__(self, run_dir: str):
        def load():
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter

        summary_writer = _import_backend("tensorboard", "tensorboard", load)
        self._writer = summary_writer(os.path.join(run_dir, "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    def __init__(self, run_dir: str, project: str, experiment: str, config: dict):
        def load():
            import wandb

            return wandb

        wandb = _import_backend("wandb", "wandb", load)
        # Mode (online/offline/disabled) comes from wandb's own settings, e.g. WANDB_MODE.
        self._run = wandb.init(project=project, name=experiment, config=config, dir=run_dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class _Swanlab:
    def __init__(self, run_dir: str, project: str, experiment: str, config: dict):
        def load():
            import swanlab

            return swanlab

        self._swanlab = _import_backend("swanlab", "swanlab", load)
        logdir = os.path.join(run_dir, "swanlog")
        os.makedirs(logdir, exist_ok=True)  # swanlab wants an existing logdir
        # Mode (cloud/local/offline/disabled) comes from swanlab's own settings, e.g. SWANLAB_MODE.
        self._swanlab.init(project=project, experiment_name=experiment, config=config, logdir=logdir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._swanlab.log(metrics, step=step)

    def close(self) -> None:
        self._swanlab.finish()


def _to_number(key: str, value: Any) -> int | float:
    # Accepts Python numbers, numpy scalars and one-element tensors; JSON and the backends want
    # plain numbers. Ints (token counts) stay ints; strings are refused, not parsed.
    if isinstance(value, (bool, int)):
        return int(value)
    not_a_number = f"metric {key!r} is {value!r} ({type(value).__name__}); log numbers only"
    if isinstance(value, str):
        raise LoggerError(not_a_number)
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise LoggerError(not_a_number) from err


def _parse_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        lines = file.readlines()
    # Lines are written whole and flushed one by one, so only an unterminated last line can be
    # incomplete: the process was killed mid-write. That record is lost, not corrupt data.
    if lines and not lines[-1].endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise LoggerError(f"{path}:{number}: not a JSON object ({err}); fix or delete that line") from err
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise LoggerError(f"{path}:{number}: expected an object with an integer 'step'; fix or delete that line")
        records.append(record)
    return records


def read_jsonl(path: str) -> list[dict]:
    """The records of a metrics file, in file order (a line torn by a kill at the end is ignored)."""
    if not os.path.isfile(path):
        raise LoggerError(f"metrics file {path} does not exist; pass the metrics.jsonl of a run directory")
    return _parse_jsonl(path)


class Tracking:
    """Logs each step's metrics to ``<run_dir>/metrics.jsonl`` and to the named ``loggers``.

    ``resume=False`` starts the JSONL file afresh; ``resume=True`` appends to it, and the trainer
    calls ``drop_from(step)`` with the first step it will run, so steps logged after the last
    checkpoint by the killed run are dropped and every step appears once.
    """

    def __init__(
        self, run_dir: str, loggers: list[str], project: str, experiment: str, config: dict, resume: bool = False
    ):
        unknown = [name for name in loggers if name not in LOGGERS]
        if unknown:
            raise LoggerError(f"unknown logger(s) {unknown}; choose from {list(LOGGERS)}")
        os.makedirs(run_dir, exist_ok=True)
        self.metrics_path = os.path.join(run_dir, METRICS_FILE)
        self._backends: list[_Backend] = []
        try:
            # Backends first: a missing package must fail before a fresh run empties metrics.jsonl.
            for name in dict.fromkeys(loggers):  # a name given twice logs once
                backend = self._make_backend(name, run_dir, project, experiment, config)
                if backend is not None:
                    self._backends.append(backend)
            self._jsonl = open(self.metrics_path, "a" if resume else "w", encoding="utf-8")
        except BaseException:
            self._close_backends()  # finish any wandb/swanlab run already started
            raise

    @staticmethod
    def _make_backend(name: str, run_dir: str, project: str, experiment: str, config: dict) -> _Backend | None:
        if name == "jsonl":
            return None  # always written
        if name == "console":
            return _Console()
        if name == "tensorboard":
            return _Tensorboard(run_dir)
        if name == "wandb":
            return _Wandb(run_dir, project, experiment, config)
        return _Swanlab(run_dir, project, experiment, config)

    def drop_from(self, step: int) -> None:
        """Drop the JSONL records with ``step >= step`` (logged by a killed run after its last
        checkpoint), so the resumed run logs each of those steps once."""
        self._jsonl.close()
        kept = [record for record in _parse_jsonl(self.metrics_path) if record["step"] < step]
        write_text(self.metrics_path, "".join(json.dumps(record) + "\n" for record in kept))  # a kill: old or new
        self._jsonl = open(self.metrics_path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record one step: a JSONL line (flushed), then each backend."""
        if "step" in metrics:
            raise LoggerError("metrics must not contain the key 'step': the step is the log() argument")
        numbers = {key: _to_number(key, value) for key, value in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **numbers}) + "\n")
        self._jsonl.flush()
        for backend in self._backends:
            backend.log(numbers, step)

    def close(self) -> None:
        """Flush and close the file and every backend (finishes wandb/swanlab runs)."""
        self._jsonl.close()
        self._close_backends()

    def _close_backends(self) -> None:
        for backend in self._backends:
            backend.close()
        self._backends = []

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _column_means(values: list[float], columns: int) -> list[float | None]:
    # Column j averages its share of the series; a column with no finite value stays empty.
    means: list[float | None] = []
    for column in range(columns):
        bucket = values[column * len(values) // columns : (column + 1) * len(values) // columns]
        finite = [value for value in bucket if math.isfinite(value)]
        means.append(sum(finite) / len(finite) if finite else None)
    return means


def ascii_curve(values: list[float], width: int = 60, height: int = 10, label: str = "") -> str:
    """A plain-text chart of ``values`` (one per step, steps 1..N): ``height`` rows between the
    min (bottom) and max (top) labels, at most ``width`` columns, then an x axis with the step
    range. A longer series is averaged per column and the y axis spans those averages, which
    smooths step-to-step noise. Non-finite values are left out."""
    if width < 1 or height < 2:
        raise ValueError(f"ascii_curve needs width >= 1 and height >= 2, got width={width}, height={height}")
    header = [label] if label else []
    columns = min(width, len(values))
    means = _column_means(values, columns)
    plotted = [mean for mean in means if mean is not None]
    if not plotted:
        return "\n".join([*header, f"(no finite values among {len(values)})"])
    low, high = min(plotted), max(plotted)
    span = high - low

    def row_of(value: float) -> int:
        # A constant series sits in the middle row.
        return (height - 1) // 2 if span == 0 else round((value - low) / span * (height - 1))

    grid = [[" "] * columns for _ in range(height)]
    for column, mean in enumerate(means):
        if mean is not None:
            grid[height - 1 - row_of(mean)][column] = "*"
    top, bottom = f"{high:.4g}", f"{low:.4g}"
    margin = max(len(top), len(bottom))
    y_labels = [top] + [""] * (height - 2) + [bottom]
    rows = [f"{y_label:>{margin}} |{''.join(cells)}".rstrip() for y_label, cells in zip(y_labels, grid)]
    first, last = "step 1", f"step {len(values)}"
    x_labels = first if len(values) == 1 else first + " " * max(1, columns - len(first) - len(last)) + last
    return "\n".join([*header, *rows, " " * margin + " +" + "-" * columns, " " * (margin + 2) + x_labels])

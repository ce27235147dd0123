"""Synchronous against asynchronous training at the same number of samples: wall time, tokens/s,
how long each pool waited, and the score against wall time (docs/async.md, "Benchmark").

    python bench/async_modes.py [--config configs/recipe/tiny_gspo.yaml] [--variants gspo,gspo_async1,gspo_async2]
        [--steps 20] [--out docs/async.md [--block NAME]] [--plot docs/images/async_score_vs_time.png]
        [key=value ...]

Each variant is a ``recipe.compare`` variant name (its overrides come from there: ``async1`` is
``one_step_off``, ``asyncK`` for K >= 2 is ``fully_async`` with samples at most K versions old),
optionally followed by overrides of its own joined with ``+`` (``grpo_async2+async_training.require_batches=2``),
run as its own ``python -m recipe.main`` process for ``--steps`` steps (no validation, no checkpoints),
with the same seeds, so every variant trains on the same prompts and number of samples. Times
come from the run's own ``metrics.jsonl``; the whole process's wall clock (start-up included) is
measured around it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import check_out, machine_facts, write_doc  # noqa: E402

SCRIPT = "bench/async_modes.py"
FIXED = ("trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.resume_mode=disable")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/recipe/tiny_gspo.yaml")
    p.add_argument("--variants", default="gspo,gspo_async1,gspo_async2",
                   help="recipe.compare variant names, comma-separated, each optionally with +key=value "
                        "overrides of its own (default %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="training steps per variant (default %(default)s)")
    p.add_argument("--out", type=Path, help="write the results block of this markdown file")
    p.add_argument("--block", default="", help="with --out: write the block of this name (a file may hold several)")
    p.add_argument("--plot", type=Path, help="write the score against wall time as this PNG")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="recipe overrides for every variant")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2")
    args.variants = args.variants.split(",")
    if not all(args.variants):
        p.error(f"--variants {','.join(args.variants)!r}: empty name; give names separated by single commas")
    if args.block and not args.block.replace("_", "").isalnum():
        p.error(f"--block {args.block!r}: use letters, digits and _ only")
    check_out(p, args.out, block_name(args))
    return args


def block_name(args: argparse.Namespace) -> str:
    """What the --out file's block markers name: this script, and the block if not the default one."""
    return SCRIPT + (f" --block {args.block}" if args.block else "")


def variant_command(args: argparse.Namespace, variant: str, run_dir: Path) -> list[str]:
    from recipe.compare.runs import read_training_pool
    from recipe.compare.variants import variant_overrides

    name, *own = variant.split("+")
    overrides = variant_overrides(name, read_training_pool(args.config, args.overrides))
    return [sys.executable, "-m", "recipe.main", "--config", args.config, *args.overrides, *overrides, *own, *FIXED,
            f"trainer.total_training_steps={args.steps}", f"trainer.default_local_dir={run_dir}",
            f"trainer.experiment_name={run_dir.name}"]


def run_variant(args: argparse.Namespace, variant: str, root: Path) -> tuple[list[dict], float]:
    """The variant's per-step metrics and the process's wall clock."""
    run_dir = root / re.sub(r"[^A-Za-z0-9_.-]", "_", variant)
    command = variant_command(args, variant, run_dir)
    print(f"[{variant}] {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"error: variant {variant} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()], wall


def summarize(history: list[dict], wall: float) -> dict[str, float]:
    steps = [m for m in history if "timing_s/step" in m]
    step_s = sum(m["timing_s/step"] for m in steps)
    mean = lambda key: statistics.fmean(m.get(key, 0.0) for m in steps)  # noqa: E731
    pushed = [m for m in steps if "timing_s/reshard" in m]  # fully_async pushes every T steps only
    return {
        "wall_s": wall, "steps_s": step_s, "step_median_s": statistics.median(m["timing_s/step"] for m in steps),
        "tokens_per_s": sum(m["perf/total_num_tokens"] for m in steps) / step_s,
        "gen_s": mean("timing_s/gen"), "wait_rollout_s": mean("timing_s/wait_rollout"),
        # the synchronous run has no pools that wait for each other: not measured there
        "idle_trainer": mean("async/idle_ratio_trainer") if "async/idle_ratio_trainer" in steps[0] else None,
        "idle_rollout": mean("async/idle_ratio_rollout") if "async/idle_ratio_rollout" in steps[0] else None,
        "reshard_s": statistics.fmean(m["timing_s/reshard"] for m in pushed),
        "broadcast_gb_per_s": (statistics.fmean(m["reshard/broadcast_gb_per_s"] for m in pushed)
                               if "reshard/broadcast_gb_per_s" in pushed[0] else None),  # None: in-process
        "staleness_max": max(m.get("async/staleness_max", 0.0) for m in steps),
        "response_length": mean("response_length/mean"),
        "score_last5": statistics.fmean(m["critic/score/mean"] for m in steps[-5:]),
    }


def report(results: dict[str, dict[str, float]], args: argparse.Namespace, load_before: float) -> str:
    command = (f"python {SCRIPT} --config {args.config} --variants {','.join(args.variants)} --steps {args.steps}"
               + "".join(f" {o}" for o in args.overrides) + (f" --plot {args.plot}" if args.plot else ""))
    lines = [
        f"Command: `{command}`", "",
        *machine_facts("one torch thread per worker; a rollout pool of its own adds its ranks on the same cores", load_before),
        "", "| variant | whole run s | sum of steps s | median step s | tokens/s | mean `gen` s | mean `wait_rollout` s "
        "| trainer idle | rollout idle | weight sync s | broadcast GB/s | max staleness | mean response tokens "
        "| score, last 5 steps |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    notes = ["", "Weight sync s: the mean `timing_s/reshard` of the steps that pushed weights (colocated: the "
             "export loaded into the engines in the same processes; a pool of its own: the export broadcast "
             "over gloo from training rank 0 and loaded there, at the broadcast GB/s shown)."]
    for variant, r in results.items():
        broadcast = "in-process" if r["broadcast_gb_per_s"] is None else f"{r['broadcast_gb_per_s']:.2f}"
        lines.append(f"| {variant} | {r['wall_s']:.1f} | {r['steps_s']:.1f} | {r['step_median_s']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {r['gen_s']:.2f} | {r['wait_rollout_s']:.2f} | "
                     f"{percent(r['idle_trainer'])} | {percent(r['idle_rollout'])} | {r['reshard_s']:.3f} | "
                     f"{broadcast} | "
                     f"{r['staleness_max']:.0f} | "
                     f"{r['response_length']:.1f} | {r['score_last5']:.3f} |")
    return "\n".join(lines + notes)


def percent(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def plot(histories: dict[str, list[dict]], path: Path) -> None:
    """Each variant's score against the time its steps took (start-up left out)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for variant, history in histories.items():
        clock, xs, ys = 0.0, [], []
        for m in history:
            clock += m["timing_s/step"]
            xs.append(clock)
            ys.append(m["critic/score/mean"])
        ax.plot(xs, ys, marker=".", label=variant)
    ax.set_xlabel("wall time of the steps (s)")
    ax.set_ylabel("critic/score/mean")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    histories, results = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_async_") as root:
        for variant in args.variants:
            histories[variant], wall = run_variant(args, variant, Path(root))
            results[variant] = summarize(histories[variant], wall)
    body = report(results, args, load_before)
    print(body)
    if args.plot:
        plot(histories, args.plot)
    if args.out:
        write_doc(args.out, body, block_name(args), "Asynchronous training")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-phase time, tokens/s and peak memory of the tiny CPU recipe (the README's main job).

    python bench/recipe_phases.py [--config configs/recipe/tiny_gspo.yaml] [--steps 20] [--out docs/bench_recipe.md] [key=value ...]

Runs the recipe for ``--steps`` steps (no validation, no checkpoints) through the real trainer
(Ray workers, megatron-core on gloo ranks, transformers rollout) and reports the median over the
steps after the first of each ``timing_s/*`` phase, tokens/s and the busiest worker's peak memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_facts, publish  # noqa: E402

SCRIPT = "bench/recipe_phases.py"
PHASES = ("gen", "old_log_prob", "ref", "update_actor", "reshard", "step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/recipe/tiny_gspo.yaml")
    p.add_argument("--steps", type=int, default=20, help="steps to run; the first is left out of the medians")
    p.add_argument("--out", type=Path, default=None, help="write the results block of this markdown file")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is left out)")
    return args


def run(args: argparse.Namespace) -> tuple[list[dict], object]:
    from recipe.config import load_config
    from recipe.driver.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(args.config, [*args.overrides, f"trainer.default_local_dir={run_dir}",
                                        "trainer.resume_mode=disable", "trainer.save_freq=-1", "trainer.test_freq=-1",
                                        "trainer.val_before_train=false", f"trainer.total_training_steps={args.steps}"])
        trainer = Trainer(cfg)
        try:
            trainer.start()
            return [trainer.train_step(step) for step in range(1, args.steps + 1)], cfg
        finally:
            trainer.close()


def report(history: list[dict], cfg, args: argparse.Namespace, load_before: float) -> str:
    steady = history[1:]
    med = lambda key: statistics.median(m[key] for m in steady)  # noqa: E731
    step_s = med("timing_s/step")
    lines = [
        f"Command: `python {SCRIPT} --config {args.config} --steps {args.steps}"
        + "".join(f" {o}" for o in args.overrides) + "`",
        "",
        *machine_facts(f"one torch thread per worker ({cfg.layout.cluster.world_size} Ray workers)", load_before),
        f"- recipe: {cfg.trainer.experiment_name}, layout {cfg.parallel}, {cfg.data.train_batch_size} prompts x "
        f"{cfg.actor_rollout_ref.rollout.n} responses per step, medians over steps 2-{args.steps}",
        "",
        "| phase | median s | share of step |",
        "|---|---|---|",
    ]
    for phase in PHASES:
        key = f"timing_s/{phase}"
        if key in steady[0]:
            lines.append(f"| {phase} | {med(key):.3f} | {100 * med(key) / step_s:.0f}% |")
    tokens = med("perf/total_num_tokens")
    lines += [
        "",
        f"- tokens per step (prompt + response): {tokens:.0f}; {tokens / step_s:.0f} tokens/s in all, "
        f"{med('perf/throughput'):.0f} tokens/s per worker (`perf/throughput`)",
        f"- generated tokens per second of `gen`: "
        f"{statistics.median(m['response_length/mean'] * len_rows(cfg) / m['timing_s/gen'] for m in steady):.0f}",
        f"- peak memory of the busiest worker (resident set): {max(m['perf/max_memory_allocated_gb'] for m in history):.2f} GB",
    ]
    return "\n".join(lines)


def len_rows(cfg) -> int:
    return cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    history, cfg = run(args)
    publish(report(history, cfg, args, load_before), args.out, SCRIPT, "The tiny CPU recipe, phase by phase")
    return 0


if __name__ == "__main__":
    sys.exit(main())

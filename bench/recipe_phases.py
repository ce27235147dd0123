"""Per-phase time, tokens/s and peak memory of a recipe (default: the README's main job).

    python bench/recipe_phases.py [--config configs/recipe/tiny_gspo.yaml] [--steps 20] [--out docs/bench_recipe.md]
        [--block NAME] [--profile FILE] [key=value ...]

Runs the recipe for ``--steps`` steps (no validation, no checkpoints) through the real trainer
(Ray workers, megatron-core, the configured rollout engine) and reports the median over the steps
after the first of each ``timing_s/*`` phase, the part of it the busiest worker spent in the
phase's method (the rest: Ray's transfers and scheduling, and waiting), tokens/s and the busiest
worker's peak memory. ``--profile FILE``: torch.profiler over the workers' second step, its
operator and kernel tables written to FILE. On one GPU:

    python bench/recipe_phases.py --steps 8 trainer.device=cuda trainer.n_gpus_per_node=1 \
        actor_rollout_ref.actor.megatron.expert_model_parallel_size=1
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
# the worker method each phase runs (recipe.workers.rank.Rank, counted by its ``busy``)
METHODS = {"gen": "run", "old_log_prob": "compute_log_probs", "update_actor": "update", "reshard": "sync_weights"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/recipe/tiny_gspo.yaml")
    p.add_argument("--steps", type=int, default=20, help="steps to run; the first is left out of the medians")
    p.add_argument("--out", type=Path, default=None, help="write the results block of this markdown file")
    p.add_argument("--block", default=None, help="the named generated block of --out to write (default: the first)")
    p.add_argument("--profile", type=Path, default=None, help="write torch.profiler's tables of the second step here")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is left out)")
    return args


def run(args: argparse.Namespace) -> tuple[list[dict], object]:
    from recipe.config import load_config
    from recipe.driver.trainer import Trainer
    from recipe.workers.rank import Rank

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(args.config, [*args.overrides, f"trainer.default_local_dir={run_dir}",
                                        "trainer.resume_mode=disable", "trainer.save_freq=-1", "trainer.test_freq=-1",
                                        "trainer.val_before_train=false", f"trainer.total_training_steps={args.steps}"])
        trainer = Trainer(cfg)
        try:
            trainer.start()
            history = []
            for step in range(1, args.steps + 1):
                if step == 2 and args.profile:  # one step: the profiler's tables of more take minutes to build
                    trainer.workers.call(Rank.profile, [(True,)] * trainer.workers.world_size)
                metrics = trainer.train_step(step)
                busy = trainer.workers.call(Rank.take_busy)
                for method in set(METHODS.values()):  # the busiest worker's seconds in each method
                    metrics[f"worker_s/{method}"] = max(b.get(method, 0.0) for b in busy)
                history.append(metrics)
                print(f"step {step}: " + ", ".join(f"{k.split('/')[1]} {v:.3f}s" for k, v in metrics.items()
                                                    if k.startswith(("timing_s/", "worker_s/"))), file=sys.stderr)
                if step == 2 and args.profile:
                    tables = trainer.workers.call(Rank.profile, [(False,)] * trainer.workers.world_size)
                    args.profile.write_text("\n\n".join(tables) + "\n")
                    print(f"wrote {args.profile}", file=sys.stderr)
            return history, cfg
        finally:
            trainer.close()


def report(history: list[dict], cfg, args: argparse.Namespace, load_before: float) -> str:
    steady = history[1:]
    device = cfg.layout.cluster.device
    med = lambda key: statistics.median(m[key] for m in steady)  # noqa: E731
    step_s = med("timing_s/step")
    lines = [
        f"Command: `python {SCRIPT} --config {args.config} --steps {args.steps}"
        + "".join(f" {o}" for o in args.overrides) + "`",
        "",
        *machine_facts(f"one torch thread per worker ({cfg.layout.cluster.world_size} Ray workers)", load_before, device),
        f"- recipe: {cfg.trainer.experiment_name}, layout {cfg.parallel}, {cfg.data.train_batch_size} prompts x "
        f"{cfg.actor_rollout_ref.rollout.n} responses per step, medians over steps 2-{args.steps}",
        "",
        "| phase | median s | share of step | in the worker's method, s |",
        "|---|---|---|---|",
    ]
    for phase in PHASES:
        key = f"timing_s/{phase}"
        if key in steady[0]:
            method = METHODS.get(phase)
            # the old-log-prob and reference passes share a method: its seconds go to the first
            inside = f"{med('worker_s/' + method):.3f} (`{method}`)" if method and not (
                phase == "ref" or (phase == "old_log_prob" and "timing_s/ref" in steady[0])) else "—"
            lines.append(f"| {phase} | {med(key):.3f} | {100 * med(key) / step_s:.0f}% | {inside} |")
    tokens = med("perf/total_num_tokens")
    lines += [
        "",
        f"- tokens per step (prompt + response): {tokens:.0f}; {tokens / step_s:.0f} tokens/s in all, "
        f"{med('perf/throughput'):.0f} tokens/s per worker (`perf/throughput`)",
        f"- generated tokens per second of `gen`: "
        f"{statistics.median(m['response_length/mean'] * len_rows(cfg) / m['timing_s/gen'] for m in steady):.0f}",
        f"- peak memory of the busiest worker ({'resident set' if device == 'cpu' else 'device memory allocated'}): "
        f"{max(m['perf/max_memory_allocated_gb'] for m in history):.2f} GB",
        f"- rollout engine {cfg.actor_rollout_ref.rollout.name}, "
        f"{'gives its device memory back while training' if cfg.actor_rollout_ref.rollout.free_cache_engine else 'keeps its weights on the device'} "
        f"(free_cache_engine={str(cfg.actor_rollout_ref.rollout.free_cache_engine).lower()}); "
        f"dtype {cfg.actor_rollout_ref.model.dtype}; {micro_batches(cfg.actor_rollout_ref.actor)}",
    ]
    return "\n".join(lines)


def micro_batches(actor) -> str:
    """How the actor's train pass is cut: rows, or dynamic batch size's token budget."""
    if actor.use_dynamic_bsz:
        return f"micro-batches by token budget (use_dynamic_bsz, {actor.ppo_max_token_len_per_gpu:,} tokens)"
    return f"micro-batches of {actor.ppo_micro_batch_size_per_gpu} rows"


def len_rows(cfg) -> int:
    return cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    history, cfg = run(args)
    publish(report(history, cfg, args, load_before), args.out, SCRIPT, "The tiny recipe, phase by phase", args.block)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compare GRPO, GRPO with routing replay and GSPO on the same prompts, seeds and initial weights,
synchronous or with samples K policy versions behind.

    python -m recipe.compare --config configs/recipe/tiny_stability.yaml --variants grpo,grpo_r2,gspo \\
        [--seeds 1,2,3] [--out runs/compare/NAME] [key.sub=value ...]
    python -m recipe.compare RUN_DIR [RUN_DIR ...] --out REPORT_DIR      # report on finished runs

A variant's name is an algorithm and optional parts joined by ``_`` (``recipe.compare.variants``):
``r2`` / ``r3`` (routing replay), ``tis`` (token-level truncated IS rollout correction), ``asyncK``
(samples up to K policy versions behind the update). Every variant of one seed runs with that seed as
``trainer.seed`` (sampling) and ``data.seed`` (prompt order), from the recipe's checkpoint, so the
first step of every variant sees the same prompts and samples the same responses; each run logs
``data/prompt_hash`` per step and writes ``provenance.json`` (initial weights) to show it.

Runs go one after another into ``OUT/<variant>/seed_<s>`` with ``variant.json``; a finished run
(its last step logged) is not run again and an interrupted one resumes from its last checkpoint,
so re-running the same command completes a comparison. Then ``OUT/report`` is written
(``recipe.compare.report``: report.md, plots, summary.json). Overrides apply to every variant; the
variant's own keys come last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_bridge.errors import ConfigError
from recipe.compare.report import ReportError, Rule, flatten, write_report
from recipe.compare.variants import ALGOS, VARIANT_FILE, VARIANT_PARTS, variant_overrides
from recipe.config import RecipeConfig, config_to_dict, load_config, seed_rule
from recipe.main import run_reporting
from recipe.run_dir import CHECKPOINTS_DIR, PROVENANCE_FILE, check_free, hold, to_resume, trainer_state
from recipe.tracking.loggers import METRICS_FILE, read_jsonl

DEFAULT_VARIANTS = "grpo,grpo_r2,gspo"
REPORT_DIR = "report"


@dataclass(frozen=True)
class Run:
    variant: str
    seed: int
    directory: str
    overrides: tuple[str, ...]  # the user's, then the variant's


def read_training_pool(config: str, overrides: list[str]) -> tuple[int, int]:
    """(``trainer.nnodes``, ``trainer.n_gpus_per_node``) of the recipe with the user's overrides."""
    cluster = load_config(config, overrides).layout.cluster
    return cluster.nnodes, cluster.devices_per_node


def plan_runs(out: str, variants: list[str], seeds: list[int], overrides: list[str],
              training_pool: tuple[int, int]) -> list[Run]:
    runs = []
    for seed in seeds:
        for variant in variants:
            directory = os.path.join(out, variant, f"seed_{seed}")
            own = (f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.default_local_dir={directory}",
                   f"trainer.experiment_name={variant}_seed{seed}", "trainer.resume_mode=auto")
            runs.append(Run(variant, seed, directory,
                            tuple(overrides) + own + variant_overrides(variant, training_pool)))
    return runs


def effective_config(cfg: RecipeConfig) -> dict:
    """The run's whole config as JSON holds it (what ``VARIANT_FILE`` records)."""
    return json.loads(json.dumps(config_to_dict(cfg), default=str))


def finished(run: Run, cfg: RecipeConfig) -> bool:
    """The run logged its last step (its length is in provenance.json from its start). A run dir
    made with other settings is refused: other overrides, or another effective config ``cfg`` (the
    recipe file, its defaults, the seeds)."""
    marker = os.path.join(run.directory, VARIANT_FILE)
    if not os.path.isfile(marker):
        return False
    with open(marker) as f:
        recorded = json.load(f)
    held, asked = recorded.get("overrides") or [], list(run.overrides)
    fix = f"({VARIANT_FILE}); pass another --out or delete that directory"
    if held != asked:
        only_held = [o for o in held if o not in asked] or ["(nothing)"]
        only_asked = [o for o in asked if o not in held] or ["(nothing)"]
        raise ConfigError(f"{run.directory} holds a run with other settings: it has {' '.join(only_held)} where this "
                          f"comparison asks for {' '.join(only_asked)} {fix}")
    if "effective_config" in recorded:  # older runs recorded the overrides only
        was, now = flatten(recorded["effective_config"]), flatten(effective_config(cfg))
        differ = sorted(key for key in was.keys() | now.keys() if was.get(key) != now.get(key))
        if differ:
            shown = "; ".join(f"{key} {was.get(key, '(none)')} there, {now.get(key, '(none)')} here" for key in differ[:3])
            more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
            raise ConfigError(f"{run.directory} holds a run of another config (from {recorded.get('config')}): "
                              f"{shown}{more} {fix}")
    metrics, provenance = os.path.join(run.directory, METRICS_FILE), os.path.join(run.directory, PROVENANCE_FILE)
    if not (os.path.isfile(metrics) and os.path.isfile(provenance)):
        return False
    with open(provenance) as f:
        total = json.load(f)["total_steps"]
    steps = [m["step"] for m in read_jsonl(metrics)]
    return bool(steps) and max(steps) >= total


def _start_state(run: Run, cfg) -> str:
    """How an unfinished run starts: fresh, or resuming from its latest checkpoint's step."""
    resume = to_resume(cfg.trainer, Path(run.directory) / CHECKPOINTS_DIR)
    if resume is None:
        return "to run"
    return f"resuming from step {trainer_state(resume)['step']}"


def _load(config: str, run: Run):
    """The run's config; an error names the variant (a combination the config refuses, e.g. async1 with DAPO's group filter)."""
    try:
        return load_config(config, list(run.overrides))
    except ConfigError as e:
        raise ConfigError(f"variant {run.variant!r}: {e}") from None


def run_comparison(config: str, variants: list[str], seeds: list[int], out: str, overrides: list[str]) -> list[Run]:
    """Check every run's config first, then train the runs that are not finished."""
    from recipe.driver.trainer import train  # Ray and megatron-core: only when runs are trained

    runs = plan_runs(out, variants, seeds, overrides, read_training_pool(config, overrides))
    configs = [_load(config, run) for run in runs]  # every error before anything runs
    todo = [(run, cfg) for run, cfg in zip(runs, configs) if not finished(run, cfg)]
    for run, _ in todo:
        check_free(Path(run.directory))  # another process runs it: refused before any run starts
    for run, cfg in zip(runs, configs):
        state = "finished" if not any(run is r for r, _ in todo) else _start_state(run, cfg)
        print(f"{run.variant} seed {run.seed}: {run.directory} ({state})")
    for i, (run, cfg) in enumerate(todo, 1):
        print(f"== [{i}/{len(todo)}] {run.variant}, seed {run.seed} ==", flush=True)
        with hold(Path(run.directory)):  # the trainer's own hold is this one
            with open(os.path.join(run.directory, VARIANT_FILE), "w") as f:
                json.dump({"variant": run.variant, "seed": run.seed, "config": config, "overrides": list(run.overrides),
                           "effective_config": effective_config(cfg)}, f, indent=2)
            train(cfg)
    return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m recipe.compare",
        description="Run GRPO / GSPO variants on the same prompts, seeds and weights, then write the comparison "
        "report; or, given finished run directories, only the report.",
        epilog=f"variants: an algorithm ({', '.join(ALGOS)}) and parts {', '.join(VARIANT_PARTS)}, asyncK joined by "
        "_, e.g. grpo,grpo_r2,gspo,gspo_async1 (asyncK: samples up to K policy versions behind, on a "
        "rollout pool as large as the training pool). Exit status: 0 done, 1 a run failed, 2 bad input.",
    )
    p.add_argument("--config", help="recipe YAML or shipped name: run the variants (else: report on RUN_DIRs)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated variants (default: %(default)s)")
    p.add_argument("--seeds", default="1", help="comma-separated seeds; each runs every variant (default: %(default)s)")
    p.add_argument("--out", help="output directory (runs and report/; with RUN_DIRs: the report directory). "
                   "Default with --config: runs/compare/<recipe name>")
    p.add_argument("--window", type=int, default=5, help="report: steps in the first/last window and the smoothing")
    p.add_argument("--drop", type=float, default=0.5, help="report: score drop from its best that the instability rule needs")
    p.add_argument("--spike-factor", type=float, default=3.0,
                   help="report: grad norm or ppo_kl above this x its earlier median is a spike (instability rule)")
    p.add_argument("--learn", type=float, default=0.2,
                   help="report: a run whose smoothed score never rises this much above its start is flagged as not learning")
    p.add_argument("args", nargs="*", metavar="key.sub=value | RUN_DIR",
                   help="with --config: recipe overrides for every variant; without: finished run directories")
    return p.parse_args(argv)


def _seeds(text: str) -> list[int]:
    """The seeds of ``--seeds``, checked before anything runs: every item a whole number (no empty
    item, no trailing comma), in the recipe's seed range, none twice."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() for item in items):
        bad = next(item for item in items if not item.isdigit())
        what = "an empty item (a doubled or trailing comma?)" if not bad else f"{bad!r} is not a whole number >= 0"
        raise ConfigError(f"--seeds {text!r}: {what}; expected comma-separated seeds, e.g. 1,2,3")
    seeds = [int(item) for item in items]
    problem = next((f"seed {seed} {seed_rule(seed)}" for seed in seeds if seed_rule(seed)), None)
    if problem or len(set(seeds)) < len(seeds):
        raise ConfigError(f"--seeds {text!r}: {problem or 'a seed is given twice'}; expected distinct seeds, e.g. 1,2,3")
    return seeds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    written = []

    def body() -> None:
        rule = Rule(window=args.window, drop=args.drop, spike_factor=args.spike_factor, learn=args.learn)
        if args.config is None:
            if not args.args or args.out is None:
                raise ConfigError("give --config to run variants, or finished RUN_DIRs and --out REPORT_DIR for a report")
            written.append((write_report(args.args, args.out, rule), args.out))
            return
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        if not variants or len(set(variants)) < len(variants):
            raise ConfigError(f"--variants {args.variants!r}: expected distinct variant names, e.g. {DEFAULT_VARIANTS}")
        bad = [a for a in args.args if "=" not in a]
        if bad:
            raise ConfigError(f"{bad[0]!r}: with --config every argument is a key.sub=value override")
        name = os.path.basename(args.config).removesuffix(".yaml")
        out = args.out or os.path.join("runs", "compare", name)
        runs = run_comparison(args.config, variants, _seeds(args.seeds), out, args.args)
        report_dir = os.path.join(out, REPORT_DIR)
        written.append((write_report([r.directory for r in runs], report_dir, rule), report_dir))

    status = run_reporting(body, usage_errors=(ReportError,))  # a signal's line says where a re-run resumes
    if status:
        return status
    summary, report_dir = written[0]
    unstable = [f"{v.variant} seed {r.seed}: {r.unstable_kind} at step {r.unstable_step}" for v in summary.variants
                for r in v.runs if r.unstable_step is not None]
    print(f"report: {os.path.join(report_dir, 'report.md')}" + (f"; unstable: {', '.join(unstable)}" if unstable else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

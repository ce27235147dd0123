"""Train: ``python -m recipe.main --config configs/recipe/<name>.yaml [key.sub=value ...]``.

Local mode starts Ray on this machine; under ``ray job submit`` (RAY_ADDRESS set) it joins the
cluster. ``recipe.main_gspo`` / ``recipe.main_grpo`` are this entry with the algorithm fixed.
Errors in the inputs (config, data, rewards, loggers, checkpoints, files) print one message, no
traceback. SIGTERM and SIGINT stop the run with exit status 143 / 130 and one line saying where a
re-run resumes (``recipe.driver.signals``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

DEFAULT_CONFIG = "configs/recipe/tiny_{algo}.yaml"


def parse_args(argv: list[str] | None, algo: str | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m recipe.main{'_' + algo if algo else ''}",
        description="GSPO / GRPO training of a Qwen3-MoE model (Megatron actor, colocated rollout, Ray).",
    )
    parser.add_argument("--config", default=DEFAULT_CONFIG.format(algo=algo or "gspo"),
                        help="recipe YAML (default: %(default)s, the tiny CPU recipe)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides, e.g. trainer.total_training_steps=5 parallel=tiny_cpu")
    return parser.parse_args(argv)


def run_reporting(body: Callable[[], object], usage_errors: tuple[type[Exception], ...] = ()) -> int:
    """Run a command's ``body`` as the commands of this package end: an error in the inputs (a
    ``megatron_bridge.errors.UserError``, or the OS refusing a file) is one line, no traceback (exit 2
    for a config error or one of ``usage_errors``, else 1); a signal
    (``recipe.driver.signals``) is one line saying where a re-run resumes, exit 128 + its number."""
    from megatron_bridge.errors import ConfigError, UserError
    from recipe.driver.signals import Stopped

    usage = (ConfigError, *usage_errors)
    try:
        body()
    except (UserError, *usage, OSError) as e:
        notes = "".join(f"\n  ({n})" for n in getattr(e, "__notes__", []))
        print(f"error: {e}{notes}", file=sys.stderr)
        return 2 if isinstance(e, usage) else 1
    except Stopped as e:
        print(e, file=sys.stderr)
        if e.exit_now:  # Ray's client, its local processes gone, would hold the exit for 60 s
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.exit_code)
        return e.exit_code
    return 0


def main(argv: list[str] | None = None, algo: str | None = None) -> int:
    args = parse_args(argv, algo)

    def body() -> None:
        from recipe.config import load_config
        from recipe.driver.trainer import train

        cfg = load_config(args.config, list(args.overrides) + ([f"algo={algo}"] if algo else []))
        for note in cfg.notes:
            print(note, file=sys.stderr)
        if cfg.ignored:
            print("verl keys with no effect here: " + "; ".join(cfg.ignored), file=sys.stderr)
        train(cfg)

    return run_reporting(body)


if __name__ == "__main__":
    sys.exit(main())

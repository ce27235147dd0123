"""What the recipe's end-to-end tests share: running ``python -m recipe.main`` (in a new interpreter,
or in this process for runs that end before Ray starts), an in-process trainer, a run's metrics, and
the tolerances of one step computed over other workers. The README's main job, run once for the
whole session, is the ``main_job`` fixture (tests/conftest.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from recipe.tracking.loggers import read_jsonl

REPO = Path(__file__).resolve().parents[1]

TINY = {"gspo": "configs/recipe/tiny_gspo.yaml", "grpo": "configs/recipe/tiny_grpo.yaml"}
# metrics that measure the machine, not the computation; on the CPU the train-rollout gap is fp32
# rounding between two kernels (1e-7..1e-6), which changes with the rows each rank's passes hold
VOLATILE = ("timing_s/", "perf/", "reshard/export_s", "training/rollout_", "rollout_corr/")
# One training rank instead of the recipe's two (EP2): for runs whose subject is not the training pool
# (the rollout pool's faults, a signal's stop, a comparison's report); a rank fewer is about 5 s of CPU
# (its imports and set-up) per run. The two-rank pool runs in the main job and the other end-to-end tests.
EP1 = "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1"  # the recipe's EP2 needs two ranks
ONE_TRAIN_RANK = ["trainer.n_gpus_per_node=1", EP1]


def run_main(args: list[str], timeout: int = 900, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipe.main", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, **popen)


def main_in_process(args: list[str], capsys, command: str = "recipe.main") -> subprocess.CompletedProcess:
    """``python -m recipe.main`` (or the module of another of the package's commands) in this process, for
    runs that end before Ray starts or a model loads: the command's own error handling, without a
    new interpreter's imports."""
    code = importlib.import_module(command).main(args)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def metrics(run_dir: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_jsonl(str(run_dir / "metrics.jsonl"))}


def stable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(VOLATILE)}


def start_trainer(tmp_path: Path, name: str, overrides: list[str], config: str = TINY["gspo"]):
    """The trainer of ``config`` (by default the tiny GSPO recipe) with ``overrides``, started (its
    workers up) in this process under ``tmp_path / name``: no validation, no checkpoints unless the
    overrides ask."""
    from recipe.config import load_config
    from recipe.driver.trainer import Trainer

    cfg = load_config(str(REPO / config), [f"trainer.default_local_dir={tmp_path / name}",
                                                  "trainer.val_before_train=false", "trainer.save_freq=-1",
                                                  "trainer.test_freq=-1", *overrides])
    trainer = Trainer(cfg)
    trainer.start()
    return trainer


# A sampled token is never as unlikely as e^-30: per token the chance is below vocabulary x e^-30 = 5e-11.
SAMPLED_LOG_PROB_BOUND = 30.0


def assert_same_step(one: dict, two: dict, cfg) -> None:
    """One step's metrics from two runs of the same samples over other workers or hosts: the same
    samples (per-request seeds), and the update equal up to the rounding of split_tolerances."""
    for key in ("critic/score/mean", "response_length/mean", "critic/advantages/max"):
        assert one[key] == two[key], key
    for key, tolerance in split_tolerances(one, cfg).items():
        assert one[key] == pytest.approx(two[key], rel=0, abs=tolerance), key


def split_tolerances(metrics: dict, cfg) -> dict[str, float]:
    """The same samples through another number of workers: metrics that differ by the rounding of
    the model's log-probs of sampled tokens (tests.numerics), times each metric's slope in them:
    |advantage| x ratio (at most 1 + clip_ratio_high on policy) for the loss; the gradient carries
    that rounding relative to the log-probs' size, through the backward pass."""
    from megatron_bridge.plan.model_spec import load_model_spec
    from tests.numerics import forward_terms, rounding

    data, actor = cfg.data, cfg.actor_rollout_ref.actor
    terms = forward_terms(load_model_spec("tiny_qwen3_moe"), data.max_prompt_length + data.max_response_length)
    log_prob = rounding(SAMPLED_LOG_PROB_BOUND, terms)
    return {"actor/entropy": log_prob, "actor/ppo_kl": log_prob,
            "actor/pg_loss": max(abs(metrics["critic/advantages/max"]), abs(metrics["critic/advantages/min"]))
                             * (1 + actor.clip_ratio_high) * log_prob,
            "actor/grad_norm": metrics["actor/grad_norm"] * rounding(1.0, 2 * terms)}


def train_in_process(tmp_path: Path, name: str, overrides: list[str], config: str = TINY["gspo"]) -> dict[int, dict]:
    """A whole run by ``start_trainer``'s trainer, its metrics by step: for tests of what a run
    computes rather than what the command prints (with ``local_ray``, the module's runs share one
    Ray and this process's imports)."""
    trainer = start_trainer(tmp_path, name, overrides, config)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return metrics(tmp_path / name)

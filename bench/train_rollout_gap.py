#!/usr/bin/env python
"""The train-rollout gap: how far the rollout engine's log-probs and routing are from the
trainer's on the same sampled tokens, per precision pair.

    python bench/train_rollout_gap.py                                    # CPU, tiny model, three pairs
    python bench/train_rollout_gap.py --platform cuda --model mid --out docs/bench_gap_gpu.md

For each ``TRAINER/ROLLOUT`` dtype pair (``--pairs``, default ``fp32/fp32 fp32/bf16 bf16/bf16``) the
rollout engine (transformers' Qwen3-MoE, ``recipe.rollout.hf_engine``, in the rollout dtype)
samples ``--prompts`` responses of up to ``--response`` tokens at temperature 1 from random-token
prompts, reporting its per-token log-probs and routed experts; the megatron actor (in the trainer
dtype, one rank) then scores the same tokens as the old-log-prob pass does. The gap is reported
with the recipe's own metrics (``loss.rollout_correction.rollout_mismatch_metrics``: the
probability gap, k3 KL, chi-square, share of tokens one side finds twice as likely) and the
routing mismatch (``megatron_bridge.moe.table.routing_change``: expert slots that differ between
the engine's choice while generating and the trainer's).

``fp32/bf16`` is what the CPU test bed uses to make a gap (``rollout.dtype=bfloat16`` beside the
fp32 trainer, docs/stability.md); ``bf16/bf16`` is what a cluster runs: both engines in bf16 with
their own kernels. The weights are random (``bench/common.py save_model``), not a trained model's.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on sys.path, the packages are not
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    MODELS, check_out, command_line, cpu_cores, machine_facts, publish, run_ranks, save_model,
)

from megatron_bridge.verify import DTYPES  # noqa: E402

SCRIPT = "bench/train_rollout_gap.py"
PAIRS = ("fp32/fp32", "fp32/bf16", "bf16/bf16")
COLUMNS = {  # metric -> column heading
    "training/rollout_probs_diff_mean": "mean abs prob gap",
    "training/rollout_probs_diff_max": "max abs prob gap",
    "rollout_corr/k3_kl": "k3 KL",
    "rollout_corr/chi2_token": "chi2 token",
    "rollout_corr/extreme_token_frac": "tokens > 2x",
    "moe/rollout_routing_mismatch/slot_frac": "routing slots differ",
    "moe/rollout_routing_mismatch/token_any_frac": "tokens rerouted in some layer",
}


def measure(rank: int, checkpoint: str, pairs: list[str], prompts: int, prompt_len: int, response: int,
            seed: int) -> list[dict[str, Any]]:
    """Every pair's gap on this rank (torch.distributed and the platform are up; world size 1)."""
    from megatron_bridge.moe.table import merge_records, routing_change
    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.batch import RESPONSE_MASK, make_batch, right_padded, token_mask
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.runtime.platform import active
    from megatron_bridge.verify import sharded_log_probs
    from loss.rollout_correction import rollout_mismatch_metrics
    from recipe.driver.routing import rollout_routing
    from recipe.rollout.base import SamplingParams
    from recipe.rollout.hf_engine import HFEngine

    platform = active()
    device = "cpu" if platform.name == "cpu" else f"{platform.name}:{torch.cuda.current_device()}"
    initialize_parallel(TrainParallel(), seed=seed)
    spec = load_model_spec(checkpoint)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_len // 2, prompt_len + 1, (prompts,), generator=g)
    prompt_ids = [torch.randint(3, spec.vocab_size, (int(n),), generator=g).tolist() for n in lengths]
    actors: dict[str, MegatronActor] = {}
    results = []
    for pair in pairs:
        trainer_dtype, rollout_dtype = pair.split("/")
        engine = HFEngine(checkpoint, dtype=DTYPES[rollout_dtype], device=device, load_from_checkpoint=True,
                          return_routed_experts=True)
        start = time.perf_counter()
        out = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_tokens=response, seed=seed))
        gen_s = time.perf_counter() - start
        del engine
        if trainer_dtype not in actors:
            actors[trainer_dtype] = MegatronActor(spec, TrainParallel(), BuildOptions(params_dtype=DTYPES[trainer_dtype]),
                                                  None, platform.name)
            actors[trainer_dtype].load_hf(checkpoint)
        batch = make_batch(prompt_ids, out.token_ids, 0)
        rows, width = batch["input_ids"].shape
        log_probs, record = sharded_log_probs(actors[trainer_dtype], batch, math.gcd(rows, 8))  # micro-batches of up to 8 rows
        trainer_routing = merge_records([record], [torch.arange(rows)], [True], width, spec.num_layers,
                                        spec.moe_topk).routing
        engine_log_probs = right_padded(out.log_probs, batch[RESPONSE_MASK].shape[1])
        metrics = rollout_mismatch_metrics(log_probs, engine_log_probs, batch[RESPONSE_MASK])
        metrics |= routing_change(trainer_routing, rollout_routing(out.routed_experts, width), token_mask(batch),
                                  "moe/rollout_routing_mismatch")
        tokens = int(batch[RESPONSE_MASK].sum())
        results.append({"pair": pair, "metrics": metrics, "response_tokens": tokens, "gen_tok_s": tokens / gen_s})
        print(f"[{pair}] k3 KL {metrics['rollout_corr/k3_kl']:.3g}, routing slots differ "
              f"{metrics['moe/rollout_routing_mismatch/slot_frac']:.2%} ({tokens} response tokens)", file=sys.stderr,
              flush=True)
    return results


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| trainer / rollout | response tokens | " + " | ".join(COLUMNS.values()) + " |",
             "|---|--:|" + "--:|" * len(COLUMNS)]
    for r in results:
        m = r["metrics"]
        cells = [f"{m[k]:.2%}" if k.endswith("frac") else f"{m[k]:.3g}" for k in COLUMNS]
        lines.append(f"| {r['pair']} | {r['response_tokens']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(results: list[dict[str, Any]], command: str, args: argparse.Namespace, load_before: float) -> str:
    return "\n".join([
        f"Command: `{command}`",
        "",
        *machine_facts(f"{torch.get_num_threads()} intra-op threads, one rank", load_before, args.platform),
        f"- model: {MODELS[args.model]}, random weights (seed {args.seed}); {args.prompts} random-token prompts of "
        f"{args.prompt_len // 2}-{args.prompt_len} tokens, responses sampled at temperature 1 up to {args.response} tokens",
        "- engine: transformers (recipe.rollout.hf_engine) in the rollout dtype; trainer: megatron-core's local spec "
        "in the trainer dtype, scoring the engine's tokens as the old-log-prob pass does",
        "",
        table(results),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python bench/train_rollout_gap.py",
        description="The gap between the rollout engine's and the trainer's log-probs and routing on the same "
        "sampled tokens, per trainer/rollout precision pair.",
    )
    p.add_argument("--pairs", nargs="+", default=list(PAIRS), metavar="TRAINER/ROLLOUT",
                   help=f"dtype pairs, each of {' '.join(DTYPES)} (default: {' '.join(PAIRS)})")
    p.add_argument("--platform", choices=("cpu", "cuda"), default="cpu", help="cpu (default) or cuda (one GPU)")
    p.add_argument("--model", choices=tuple(MODELS), default="tiny", help="tiny (default) or mid (bench/common.py MID_SIZE)")
    p.add_argument("--prompts", type=int, default=32, help="prompts, one response each (default 32)")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt; drawn from [N/2, N] (default 32)")
    p.add_argument("--response", type=int, default=128, help="most response tokens (default 128)")
    p.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling (default 0)")
    p.add_argument("--out", type=Path, default=None, help="markdown file whose generated block to (re)write")
    args = p.parse_args(argv)
    for pair in args.pairs:
        sides = pair.split("/")
        if len(sides) != 2 or not set(sides) <= set(DTYPES):
            p.error(f"--pairs {pair}: expected TRAINER/ROLLOUT with each side one of {', '.join(DTYPES)}, e.g. bf16/bf16")
    if args.prompts < 1 or args.prompt_len < 2 or args.response < 1:
        p.error("--prompts and --response must be >= 1, --prompt-len >= 2")
    if args.platform == "cuda" and not torch.cuda.is_available():
        p.error("--platform cuda: torch.cuda.is_available() is False on this machine")
    check_out(p, args.out, SCRIPT)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="gap_model_") as tmp:
        checkpoint = save_model(tmp, args.model, args.seed)
        (results,) = run_ranks(measure, 1, cpu_cores(), checkpoint, args.pairs, args.prompts, args.prompt_len,
                               args.response, args.seed, platform=args.platform)
    publish(report(results, command_line(SCRIPT, argv), args, load_before), args.out, SCRIPT, "The train-rollout gap")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Why one CPU rank on 2 threads trains slower than on 1: the model's speed before and after
megatron's parameter all-gather.

    python bench/cpu_threads.py --out docs/bench_plan.md

One gloo rank builds the actor of bench/actor_throughput.py's ``single`` layout (the tiny
Qwen3-MoE, its default batch: micro-batches of 4 rows padded to the longest) and times the bare
model (forward, the log-probs, backward; no optimizer) on those micro-batches, then runs
``start_param_sync()`` on each model chunk (megatron's ``DistributedOptimizer`` calls it at the end of
every optimizer step: a gloo ``all_gather_into_tensor`` of the parameter buffer, even at DP 1), and
times the same passes again; per intra-op thread count, and with ``OMP_WAIT_POLICY=PASSIVE``
(OpenMP workers that sleep between parallel regions) for comparison. The voluntary context
switches of the timed passes (``getrusage``) show whether the OpenMP workers sleep.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on sys.path, the packages are not
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    check_out, command_line, load_before_run, machine_facts, median_seconds, publish, run_ranks, save_model,
)

SCRIPT = "bench/cpu_threads.py"
WAIT_POLICIES = ("default", "PASSIVE")
WARMUP = 2  # untimed passes before the timed ones


def _passes(model, micro_batches: list[dict], vocab_size: int, repeats: int) -> dict[str, float]:
    """Median seconds of forward + log-probs + backward over the micro-batches, and the voluntary
    context switches per pass (warm-ups included)."""
    from loss.vocab_parallel import vocab_parallel_log_probs_and_entropy

    def once():
        for mb in micro_batches:
            ids = mb["input_ids"]
            logits = model(input_ids=ids, position_ids=mb["position_ids"], attention_mask=None)
            rows, s = ids.shape
            scored = (torch.arange(rows)[:, None] * s + torch.arange(s // 2, s)).flatten()
            log_probs, _ = vocab_parallel_log_probs_and_entropy(logits.reshape(-1, vocab_size), scored,
                                                                ids.flatten()[scored], 1.0, True, reuse_logits=True)
            log_probs.mean().backward()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    seconds = median_seconds(once, repeats, WARMUP)
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    return {"s": seconds, "switches": switches / (WARMUP + repeats)}


def measure(rank: int, checkpoint: str, repeats: int) -> dict:
    from bench.actor_throughput import LAYOUTS, BatchShape, build_actor, make_batch
    from megatron_bridge.runtime.actor import initialize_parallel

    train = LAYOUTS["single"].train
    initialize_parallel(train)
    actor = build_actor(train, checkpoint)
    shape = BatchShape()
    micro_batches = actor.micro_batches(make_batch(shape, actor.spec.vocab_size), shape.micro_batch, None)
    model = actor.chunks[0]
    out = {"before": _passes(model, micro_batches, actor.spec.vocab_size, repeats)}
    for chunk in actor.chunks:
        chunk.start_param_sync()
    out["after"] = _passes(model, micro_batches, actor.spec.vocab_size, repeats)
    out["threads"] = torch.get_num_threads()
    out["shape"] = [list(mb["input_ids"].shape) for mb in micro_batches]
    return out


def run(checkpoint: str, threads: int, policy: str, repeats: int) -> dict:
    """One rank in a fresh process; the wait policy is set before the process loads OpenMP."""
    saved = os.environ.pop("OMP_WAIT_POLICY", None)  # "default": libgomp's own, whatever the caller set
    if policy != "default":
        os.environ["OMP_WAIT_POLICY"] = policy
    try:
        return run_ranks(measure, 1, threads, checkpoint, repeats)[0]
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)
        if saved is not None:
            os.environ["OMP_WAIT_POLICY"] = saved


def table(rows: list[dict]) -> str:
    lines = ["| threads | OMP_WAIT_POLICY | before the gather s | after s | after / before | "
             "voluntary switches a pass, before | after |",
             "|--:|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        b, a = r["before"], r["after"]
        lines.append(f"| {r['threads']} | {r['policy']} | {b['s']:.3f} | {a['s']:.3f} | {a['s'] / b['s']:.2f} | "
                     f"{b['switches']:,.0f} | {a['switches']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python {SCRIPT}", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="intra-op threads (default 1 2)")
    p.add_argument("--repeats", type=int, default=9, help=f"timed passes after {WARMUP} warm-ups (default 9)")
    p.add_argument("--out", type=Path, default=None, help="markdown file whose generated block to (re)write")
    args = p.parse_args(argv)
    if args.repeats < 1 or min(args.threads) < 1:
        p.error("--threads and --repeats must be >= 1")
    check_out(p, args.out, SCRIPT)
    load_before = load_before_run()
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpu_threads_") as tmp:
        checkpoint = save_model(tmp, "tiny")
        for threads in args.threads:
            for policy in WAIT_POLICIES:
                print(f"[{threads} thread(s), OMP_WAIT_POLICY {policy}] ...", file=sys.stderr, flush=True)
                rows.append({"threads": threads, "policy": policy, **run(checkpoint, threads, policy, args.repeats)})
    body = "\n".join([
        f"Command: `{command_line(SCRIPT, argv)}`",
        "",
        *machine_facts("per row: one gloo rank with torch.set_num_threads(THREADS)", load_before),
        f"- the tiny Qwen3-MoE as bench/actor_throughput.py's `single` layout builds it; its default batch's "
        f"{len(rows[0]['shape'])} micro-batches of {rows[0]['shape'][0]} (rows, tokens); forward, log-probs and "
        f"backward, no optimizer; median of {args.repeats} passes after {WARMUP} warm-ups",
        "- the gather: `start_param_sync()` on the model chunk (what megatron's DistributedOptimizer runs after "
        "each optimizer step)",
        "",
        table(rows),
    ])
    publish(body, args.out, SCRIPT, "The planner's step time against the CPU actor")
    return 0


if __name__ == "__main__":
    sys.exit(main())

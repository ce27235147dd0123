#!/usr/bin/env python
"""Throughput of the megatron actor per parallel layout, on CPU gloo ranks or on accelerators.

    python bench/actor_throughput.py                                  # every layout, print tables
    python bench/actor_throughput.py --layouts single ep2 --steps 3
    python bench/actor_throughput.py --out docs/bench_actor.md        # also write the doc
    python bench/actor_throughput.py --lengths long-tail --max-tokens 512 --layouts single dp2 \
        --out docs/bench_dynamic_batch.md                             # micro-batches by rows vs by tokens
    python bench/actor_throughput.py --platform cuda --dtype bf16 --model mid --layouts single   # one GPU

For the tiny Qwen3-MoE (``configs/model/tiny_qwen3_moe.yaml``) or the mid-size one (``--model mid``,
``bench/common.py MID_SIZE``), saved with transformers into a temporary directory, and each layout,
this measures on one synthetic RL batch:

- the log-prob pass (``MegatronActor.forward_only`` with ``log_prob_func``), which also supplies
  the batch's ``old_log_probs``, and
- one GSPO ``train_step`` (forward, backward, gradient sync, optimizer step),

as valid tokens (prompt + response, padding excluded) of the whole job per second, the median over
``--steps`` steps after one warm-up step; the share of the tokens the model computes that are padding; peak resident memory per rank; and where the train step's
time goes, from megatron's own schedule timers (``config.timers``) plus timers around the
torch.distributed collectives.

With ``--max-tokens N`` every layout runs twice: micro-batches of ``--micro-batch`` rows, all padded
to the longest sequence, and micro-batches by a token budget of N (dynamic batch size: rows of
similar length together, each micro-batch padded to its own longest; rows dealt to DP ranks by
length, as the trainer does). ``--lengths long-tail`` draws most responses short and a few long,
as RL responses are.

Every layout runs in fresh processes (megatron's parallel state is global), started with
``torch.multiprocessing.spawn``, one gloo rank each. Each rank gets ``cores // ranks`` intra-op
threads (at least 1; ``single-1t`` pins one), so 4-rank layouts on a 2-core machine are 2x
oversubscribed. CPU numbers are for comparing layouts and catching regressions, not for predicting
NPU/GPU throughput. With ``--platform cuda`` each rank has a GPU of its own (nccl); the timers then
wait for the device's queued work at every phase boundary and around every collective, which
costs a little throughput and makes the phase shares mean what they say; the peak device memory
(``torch.cuda.max_memory_allocated``) is reported beside the host's.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on sys.path, the packages are not
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    MODELS, check_out, command_line, cpu_cores, machine_facts, publish, run_ranks, save_model, synchronize,
)
from megatron_bridge.plan.layout import TrainParallel  # noqa: E402
from megatron_bridge.verify import DTYPES  # noqa: E402

SCRIPT = "bench/actor_throughput.py"


@dataclass(frozen=True)
class BenchLayout:
    ranks: int
    train: TrainParallel
    threads: int | None = None  # intra-op threads per rank; None: usable cores // ranks, at least 1

    @property
    def dp(self) -> int:
        return self.ranks // (self.train.tp * self.train.pp * self.train.cp)


LAYOUTS: dict[str, BenchLayout] = {
    "single": BenchLayout(1, TrainParallel()),
    "single-1t": BenchLayout(1, TrainParallel(), threads=1),
    "tp2sp": BenchLayout(2, TrainParallel(tp=2, sequence_parallel=True)),
    "pp2": BenchLayout(2, TrainParallel(pp=2)),
    "ep2": BenchLayout(2, TrainParallel(ep=2, etp=1)),
    "dp2": BenchLayout(2, TrainParallel()),
    "tp2ep2": BenchLayout(4, TrainParallel(tp=2, sequence_parallel=True, ep=2, etp=1)),
    "pp2ep2": BenchLayout(4, TrainParallel(pp=2, ep=2, etp=1)),
}

# torch.distributed functions timed as communication. Point-to-point sends and receives are
# asynchronous; megatron's own p2p timers cover them.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "broadcast_object_list",
    "all_gather_object", "all_to_all", "all_to_all_single", "gather", "scatter",
)
# Megatron timer names (schedules, p2p_communication, finalize_model_grads).
FORWARD, BACKWARD = "forward-compute", "backward-compute"
GRAD_SYNC = ("all-grads-sync", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
             "conditional-embedder-grads-all-reduce")
OUTSIDE = "outside megatron timers"
CALLS = "collective calls"


@dataclass(frozen=True)
class BatchShape:
    """The global batch: rows of prompt + response tokens with lengths drawn per row."""

    rows: int = 16
    prompt: int = 32  # longest prompt; prompts are drawn from [prompt / 2, prompt]
    response: int = 96  # response width R; uniform: drawn from [R / 3, R]; long-tail: R u^3, u ~ U(0, 1]
    micro_batch: int = 4
    seed: int = 0
    lengths: str = "uniform"

    def describe(self) -> str:
        responses = (f"{max(1, self.response // 3)}-{self.response}" if self.lengths == "uniform"
                     else f"long-tailed up to {self.response} (R u^3, u uniform)")
        return f"{self.rows} rows, prompts {self.prompt // 2}-{self.prompt} and responses {responses} tokens (seed {self.seed})"


LENGTHS = ("uniform", "long-tail")


# --- the batch -----------------------------------------------------------------------------------


def make_batch(shape: BatchShape, vocab_size: int) -> dict[str, torch.Tensor]:
    """A right-padded RL batch in the actor's convention, without ``old_log_probs`` (the log-prob
    pass fills them in). Advantages are per sequence, as GRPO/GSPO produce them."""
    g = torch.Generator().manual_seed(shape.seed)
    prompt = torch.randint(shape.prompt // 2, shape.prompt + 1, (shape.rows,), generator=g)
    if shape.lengths == "uniform":
        response = torch.randint(max(1, shape.response // 3), shape.response + 1, (shape.rows,), generator=g)
    else:  # most responses short, a few near the limit
        u = 1 - torch.rand(shape.rows, generator=g)
        response = (shape.response * u**3).ceil().long().clamp(1, shape.response)
    width = shape.prompt + shape.response
    ids = torch.randint(3, vocab_size, (shape.rows, width), generator=g)
    ids = torch.where(torch.arange(width) < (prompt + response)[:, None], ids, 0)
    return {
        "input_ids": ids,
        "prompt_lengths": prompt,
        "response_mask": (torch.arange(shape.response) < response[:, None]).float(),
        "advantages": torch.randn(shape.rows, 1, generator=g).expand(-1, shape.response).clone(),
    }


def valid_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["prompt_lengths"].sum() + batch["response_mask"].sum())


# --- timing inside a rank ------------------------------------------------------------------------


class PhaseTimers:
    """Stands in for megatron's ``Timers`` (``config.timers``): wall seconds per named phase, and
    seconds inside torch.distributed collectives, charged to the innermost open phase."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.comm: dict[str, float] = defaultdict(float)
        self.calls = 0  # collectives timed since the last reset
        self._started: dict[str, float] = {}
        self._open: list[str] = []

    def __call__(self, name: str, log_level: int = 0) -> "_Phase":
        return _Phase(self, name)

    def reset(self) -> None:
        self.wall.clear()
        self.comm.clear()
        self.calls = 0

    def start(self, name: str) -> None:
        synchronize()
        self._started[name] = time.perf_counter()
        self._open.append(name)

    def stop(self, name: str) -> None:
        synchronize()
        self.wall[name] += time.perf_counter() - self._started.pop(name)
        self._open.remove(name)  # phases nest, so a name is open at most once

    def add_comm(self, seconds: float) -> None:
        self.comm[self._open[-1] if self._open else OUTSIDE] += seconds
        self.calls += 1


class _Phase:
    def __init__(self, timers: PhaseTimers, name: str) -> None:
        self.timers, self.name = timers, name

    def start(self, barrier: bool = False) -> None:
        self.timers.start(self.name)

    def stop(self, barrier: bool = False) -> None:
        self.timers.stop(self.name)


def time_collectives(timers: PhaseTimers) -> None:
    """Route every collective that megatron, the actor and the loss call through a timer.

    Replaces the functions in the ``torch.distributed`` namespace and every alias of them that a
    loaded megatron / project module holds (megatron binds some at import, e.g.
    ``dist_reduce_scatter_func``). torch's own internal calls stay untimed, so nothing counts twice.
    """
    import torch.distributed as dist

    def timed(fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                synchronize()
                timers.add_comm(time.perf_counter() - start)

        return wrapper

    originals = {id(getattr(dist, n)): getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
    wrappers = {key: timed(fn) for key, fn in originals.items()}
    prefixes = ("megatron.", "megatron_bridge.", "loss.")
    modules = [dist] + [m for name, m in list(sys.modules.items()) if m is not None and name.startswith(prefixes)]
    for module in modules:
        for attr, value in list(vars(module).items()):
            if id(value) in wrappers and value is originals[id(value)]:
                setattr(module, attr, wrappers[id(value)])


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed_call(fn: Callable[[], Any], timers: PhaseTimers) -> tuple[float, Any, dict[str, float]]:
    """Wall seconds of ``fn`` between two barriers, its result, and where the time went."""
    torch.distributed.barrier()
    timers.reset()
    start = time.perf_counter()
    result = fn()
    synchronize()
    elapsed = time.perf_counter() - start
    phases = breakdown(elapsed, timers.wall, timers.comm) | {CALLS: float(timers.calls)}
    torch.distributed.barrier()
    return elapsed, result, phases


def breakdown(step_s: float, wall: dict[str, float], comm: dict[str, float]) -> dict[str, float]:
    """Seconds of one pass split into compute, communication and the rest (sums to ``step_s``)."""
    in_compute = comm.get(FORWARD, 0.0) + comm.get(BACKWARD, 0.0)
    p2p = sum(v for k, v in wall.items() if "send" in k or "recv" in k)
    grad_sync = sum(wall.get(k, 0.0) for k in GRAD_SYNC)
    fwd = wall.get(FORWARD, 0.0) - comm.get(FORWARD, 0.0)
    bwd = wall.get(BACKWARD, 0.0) - comm.get(BACKWARD, 0.0)
    outside_comm = comm.get(OUTSIDE, 0.0)
    return {
        "forward": fwd,
        "backward": bwd,
        "collectives in fwd/bwd": in_compute,
        "pipeline p2p": p2p,
        "grad sync": grad_sync,
        "other collectives": outside_comm,
        "rest": step_s - fwd - bwd - in_compute - p2p - grad_sync - outside_comm,
    }


def _add(total: dict[str, float], part: dict[str, float]) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + value


def _torch_profile(fn: Callable[[], Any], path: Path, rows: int = 15) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    path.write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def build_actor(train: TrainParallel, checkpoint: str, dtype: str = "fp32", platform_name: str = "cpu"):
    """This rank's actor with the checkpoint loaded (parallel state must be initialised)."""
    from megatron_bridge.runtime.actor import MegatronActor
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.plan.model_spec import load_model_spec

    actor = MegatronActor(load_model_spec(checkpoint), train, BuildOptions(params_dtype=DTYPES[dtype]), OptimConfig(),
                          platform_name)
    actor.load_hf(checkpoint)
    return actor


def dp_share(batch: dict[str, torch.Tensor], by_length: bool) -> dict[str, torch.Tensor]:
    """This data-parallel rank's rows (every rank of one replica gets the same), dealt as the
    trainer deals one mini-batch: in order, or by length for dynamic batch size."""
    from megatron.core import parallel_state as ps

    from megatron_bridge.runtime.batch import dp_shares, response_ends

    rows = len(batch["input_ids"])
    shares = dp_shares(rows, rows, ps.get_data_parallel_world_size(), response_ends(batch) if by_length else None)
    mine = shares[ps.get_data_parallel_rank()]
    return {k: v[mine] for k, v in batch.items()}


def measure(rank: int, layout: str, checkpoint: str, shape: BatchShape, max_tokens: int | None, steps: int,
            profile_dir: str | None, dtype: str) -> dict[str, Any]:
    """This rank's numbers for one layout (torch.distributed and the platform are up): per
    measured step the log-prob pass, whose log-probs become ``old_log_probs``, then a train step;
    micro-batches by rows, or by the token budget ``max_tokens``."""
    from loss.gspo import PAPER_SETTINGS
    from loss.megatron_hook import ActorLossConfig, log_prob_func, policy_loss_func
    from megatron_bridge.runtime.actor import initialize_parallel
    from megatron_bridge.runtime.platform import active

    initialize_parallel(LAYOUTS[layout].train)
    actor = build_actor(LAYOUTS[layout].train, checkpoint, dtype, active().name)
    loaded = peak_rss_mib()  # model, grad buffers and optimizer built; Adam's moments come with step 1
    timers = PhaseTimers()
    actor.config.timers = timers
    time_collectives(timers)

    batch = make_batch(shape, actor.spec.vocab_size)
    mine = dp_share(batch, by_length=max_tokens is not None)
    loss_cfg = ActorLossConfig(loss_mode="gspo", policy=PAPER_SETTINGS)
    log_probs = partial(actor.forward_only, mine, shape.micro_batch, partial(log_prob_func, loss_cfg.temperature, False),
                        max_tokens)
    update = partial(actor.train_step, mine, shape.micro_batch, partial(policy_loss_func, loss_cfg), max_tokens)

    from megatron.core import parallel_state as ps

    micro_batches = [mb["input_ids"].shape for mb in actor.micro_batches(mine, shape.micro_batch, max_tokens)]
    out: dict[str, Any] = {"tokens": valid_tokens(batch), "dp_rank": ps.get_data_parallel_rank(),
                           "computed_tokens": sum(rows * length for rows, length in micro_batches),
                           "micro_batches": len(micro_batches),
                           "train_s": [], "log_prob_s": [], "skipped": 0, "train_phases": {}, "log_prob_phases": {}}
    for step in range(steps + 1):  # step 0 warms up
        lp_s, lp_out, lp_phases = _timed_call(log_probs, timers)
        mine["old_log_probs"] = lp_out["log_probs"]
        tr_s, metrics, tr_phases = _timed_call(update, timers)
        if step == 0:
            continue
        out["log_prob_s"].append(lp_s)
        out["train_s"].append(tr_s)
        out["skipped"] += int(metrics["actor/skipped"])
        _add(out["log_prob_phases"], lp_phases)
        _add(out["train_phases"], tr_phases)
    out.update(loaded_rss_mib=loaded, peak_rss_mib=peak_rss_mib(), threads=torch.get_num_threads(),
               peak_device_mib=torch.cuda.max_memory_allocated() / 2**20 if actor.device.type == "cuda" else None)
    if profile_dir:  # after the memory reading: the profiler's own records would count in it
        _torch_profile(update, Path(profile_dir, f"{layout}{'_tokens' if max_tokens else ''}_rank{rank}.txt"))
    return out


def run_layout(layout: str, checkpoint: str, shape: BatchShape, max_tokens: int | None, steps: int,
               threads: int | None, profile_dir: str | None, platform: str, dtype: str) -> dict[str, Any]:
    """Spawn the layout's ranks and summarise what they measured."""
    world = LAYOUTS[layout].ranks
    per_rank = threads or LAYOUTS[layout].threads or max(1, cpu_cores() // world)
    start = time.perf_counter()
    ranks = run_ranks(measure, world, per_rank, layout, checkpoint, shape, max_tokens, steps, profile_dir, dtype,
                      platform=platform)
    return summarise(layout, max_tokens, ranks, time.perf_counter() - start)


def summarise(layout: str, max_tokens: int | None, ranks: list[dict], wall_s: float) -> dict[str, Any]:
    """Per-step time = the slowest rank's; phases are averaged over ranks, as shares of a step."""
    train_s = statistics.median(max(steps) for steps in zip(*(r["train_s"] for r in ranks)))
    log_prob_s = statistics.median(max(steps) for steps in zip(*(r["log_prob_s"] for r in ranks)))

    def shares(key: str) -> dict[str, float]:
        """Phase seconds as shares of the pass, plus collective calls per step and rank."""
        total: dict[str, float] = {}
        for r in ranks:
            _add(total, r[key])
        calls = total.pop(CALLS, 0.0) / (len(ranks) * len(ranks[0]["train_s"]))
        whole = sum(total.values()) or 1.0
        return {k: v / whole for k, v in total.items()} | {CALLS: calls}

    return {
        "layout": layout,
        "ranks": len(ranks),
        "threads": ranks[0]["threads"],
        "tokens": ranks[0]["tokens"],
        "max_tokens": max_tokens,
        # what each model replica (DP rank) computes, padding included
        "computed_tokens": sum({r["dp_rank"]: r["computed_tokens"] for r in ranks}.values()),
        "micro_batches": max(r["micro_batches"] for r in ranks),
        "train_s": train_s,
        "log_prob_s": log_prob_s,
        "train_tok_s": ranks[0]["tokens"] / train_s,
        "log_prob_tok_s": ranks[0]["tokens"] / log_prob_s,
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "rss_growth_mib": max(r["peak_rss_mib"] - r["loaded_rss_mib"] for r in ranks),
        "peak_device_mib": max(r["peak_device_mib"] for r in ranks) if ranks[0]["peak_device_mib"] else None,
        "skipped": sum(r["skipped"] for r in ranks),
        "train_phases": shares("train_phases"),
        "log_prob_phases": shares("log_prob_phases"),
        "job_wall_s": wall_s,
    }


def describe_layout(layout: str) -> str:
    t, dp = LAYOUTS[layout].train, LAYOUTS[layout].dp
    parts = [f"TP{t.tp}" + ("+SP" if t.sequence_parallel else "")] if t.tp > 1 else []
    parts += [f"PP{t.pp}"] if t.pp > 1 else []
    parts += [f"EP{t.ep} (ETP{t.expert_tp})"] if t.ep > 1 else []
    parts += [f"DP{dp}"] if dp > 1 else []
    return " x ".join(parts) or "single rank"


# --- reporting -----------------------------------------------------------------------------------

PHASES = ("forward", "backward", "collectives in fwd/bwd", "pipeline p2p", "grad sync", "other collectives", "rest")


def label(result: dict) -> str:
    return result["layout"] + (f", {result['max_tokens']} tokens" if result["max_tokens"] else "")


def micro_batching(result: dict, micro_batch: int) -> str:
    budget = f"<= {result['max_tokens']} tokens" if result["max_tokens"] else f"{micro_batch} rows"
    return f"{budget} ({result['micro_batches']} / rank)"


def throughput_table(results: list[dict], micro_batch: int) -> str:
    device = results[0]["peak_device_mib"] is not None
    lines = [
        "| layout | parallelism | ranks x threads | micro-batches | padding | train step tok/s | log-prob pass tok/s "
        "| train step s | log-prob s | peak RSS / rank (MiB) | growth in steps / rank (MiB) |"
        + (" peak device memory / rank (MiB) |" if device else ""),
        "|---|---|---|---|--:|--:|--:|--:|--:|--:|--:|" + ("--:|" if device else ""),
    ]
    for r in results:
        lines.append(
            f"| {label(r)} | {describe_layout(r['layout'])} | {r['ranks']} x {r['threads']} "
            f"| {micro_batching(r, micro_batch)} | {1 - r['tokens'] / r['computed_tokens']:.0%} "
            f"| {r['train_tok_s']:,.0f} | {r['log_prob_tok_s']:,.0f} | {r['train_s']:.3f} | {r['log_prob_s']:.3f} "
            f"| {r['peak_rss_mib']:,.0f} | {r['rss_growth_mib']:,.0f} |"
            + (f" {r['peak_device_mib']:,.0f} |" if device else "")
        )
    return "\n".join(lines)


def phase_table(results: list[dict], key: str) -> str:
    lines = ["| layout | " + " | ".join(PHASES) + " | collective calls / rank |", "|---|" + "--:|" * (len(PHASES) + 1)]
    for r in results:
        cells = " | ".join(f"{100 * r[key].get(p, 0.0):.0f}%" for p in PHASES)
        lines.append(f"| {label(r)} | {cells} | {r[key][CALLS]:.0f} |")
    return "\n".join(lines)


def threads_policy(threads: int | None, layouts: list[BenchLayout]) -> str:
    cores = cpu_cores()
    if threads:
        note = f"torch.set_num_threads({threads}) on every rank (--threads)"
    else:
        note = (f"torch.set_num_threads(max(1, {cores} cores // ranks)) per rank "
                "(single-1t: 1 thread, to show the effect of intra-op threads)")
    busiest = max(layout.ranks * (threads or layout.threads or max(1, cores // layout.ranks)) for layout in layouts)
    if busiest > cores:
        note += f"; the busiest layout runs {busiest} threads on {cores} cores ({busiest / cores:g}x oversubscribed)"
    return note


def report(results: list[dict], command: str, shape: BatchShape, steps: int, threads_note: str,
           load_before: float, args: argparse.Namespace) -> str:
    return "\n".join([
        f"Command: `{command}`",
        "",
        *machine_facts(threads_note, load_before, args.platform),
        f"- model: {MODELS[args.model]}, {args.dtype} parameters (megatron's local layer spec, no fused kernels)",
        f"- batch: {shape.describe()}, {results[0]['tokens']:,} valid tokens per step; "
        f"GSPO loss defaults; median of {steps} steps after 1 warm-up",
        "- padding: the share of the tokens the model replicas compute (micro-batch rows x padded length, "
        "summed over DP ranks) that are padding",
        "",
        throughput_table(results, shape.micro_batch),
        "",
        "Share of the train step's wall time (averaged over ranks):",
        "",
        phase_table(results, "train_phases"),
        "",
        "Share of the log-prob pass's wall time:",
        "",
        phase_table(results, "log_prob_phases"),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python bench/actor_throughput.py",
        description="Tokens/s of the megatron actor's GSPO train step and log-prob pass, peak memory and a "
        "phase profile, for the tiny (or mid-size) Qwen3-MoE on CPU gloo ranks or accelerators under several "
        "parallel layouts.",
        epilog="layouts: " + "; ".join(f"{name} = {describe_layout(name)} on {LAYOUTS[name].ranks} rank(s)" for name in LAYOUTS),
    )
    p.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS), metavar="LAYOUT",
                   help=f"layouts to run (default: all; choices: {', '.join(LAYOUTS)})")
    p.add_argument("--steps", type=int, default=5, help="measured steps per layout, after one warm-up (default 5)")
    p.add_argument("--rows", type=int, default=BatchShape.rows, help="rows in the global batch (default 16)")
    p.add_argument("--prompt", type=int, default=BatchShape.prompt, help="longest prompt (default 32)")
    p.add_argument("--response", type=int, default=BatchShape.response, help="response width (default 96)")
    p.add_argument("--micro-batch", type=int, default=BatchShape.micro_batch, help="micro-batch size (default 4)")
    p.add_argument("--lengths", choices=LENGTHS, default=BatchShape.lengths,
                   help="response lengths: uniform in [R/3, R] (default) or long-tail (most short, a few long)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="also run every layout with micro-batches by a token budget of N per micro-batch "
                        "(dynamic batch size)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per rank (default: usable cores // ranks, at least 1)")
    p.add_argument("--platform", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo ranks (default); cuda: one GPU per rank, nccl")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="parameter dtype (default fp32)")
    p.add_argument("--model", choices=tuple(MODELS), default="tiny",
                   help="tiny (default) or mid (0.70 B parameters, bench/common.py MID_SIZE)")
    p.add_argument("--checkpoint", default=None,
                   help="HF directory of the model (default: write --model's random weights to a temp dir)")
    p.add_argument("--torch-profile", metavar="DIR", default=None,
                   help="also run one extra train step under torch.profiler and write each rank's top ops to DIR")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown file whose generated block to (re)write, e.g. docs/bench_actor.md")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    if args.max_tokens is not None and args.max_tokens < args.prompt + args.response:
        p.error(f"--max-tokens {args.max_tokens} must hold the longest sequence, --prompt + --response = "
                f"{args.prompt + args.response}")
    check_out(p, args.out, SCRIPT)
    if args.platform == "cuda":
        devices = torch.cuda.device_count()
        too_wide = [name for name in args.layouts if LAYOUTS[name].ranks > devices]
        if too_wide:
            p.error(f"--platform cuda: layouts {', '.join(too_wide)} need more ranks than the {devices} visible GPU(s); "
                    "choose layouts that fit, e.g. --layouts single")
    if args.checkpoint and not Path(args.checkpoint, "config.json").is_file():
        p.error(f"--checkpoint {args.checkpoint}: no config.json there (expected a HF model directory)")
    for name in args.layouts:
        if args.max_tokens and LAYOUTS[name].train.pp > 1:
            p.error(f"--max-tokens with layout {name}: micro-batches of different lengths need megatron's variable "
                    "sequence lengths in the pipeline, which the CPU path's allgather MoE dispatcher turns off; "
                    "choose layouts without PP")
        dp = LAYOUTS[name].dp
        if args.rows % (dp * args.micro_batch):
            p.error(f"--rows {args.rows} must split into DP{dp} x --micro-batch {args.micro_batch} for layout {name}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = BatchShape(rows=args.rows, prompt=args.prompt, response=args.response, micro_batch=args.micro_batch,
                       lengths=args.lengths)
    if args.torch_profile:
        Path(args.torch_profile).mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    if load_before > cpu_cores() / 2:
        print(f"warning: 1-minute load average is {load_before:.2f} on {cpu_cores()} cores; other processes will skew "
              "the numbers", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory(prefix="tiny_qwen3_moe_") as tmp:
        checkpoint = args.checkpoint or save_model(tmp, args.model)
        for layout in args.layouts:
            for max_tokens in [None] + ([args.max_tokens] if args.max_tokens else []):
                name = label({"layout": layout, "max_tokens": max_tokens})
                print(f"[{name}] {describe_layout(layout)} on {LAYOUTS[layout].ranks} rank(s) ...", file=sys.stderr,
                      flush=True)
                result = run_layout(layout, checkpoint, shape, max_tokens, args.steps, args.threads, args.torch_profile,
                                    args.platform, args.dtype)
                print(f"[{name}] {result['train_tok_s']:,.0f} train tok/s, {result['log_prob_tok_s']:,.0f} log-prob "
                      f"tok/s ({result['job_wall_s']:.0f} s with start-up)", file=sys.stderr, flush=True)
                if result["skipped"]:
                    print(f"[{name}] warning: {result['skipped']} rank-steps were skipped (non-finite)", file=sys.stderr)
                results.append(result)
    threads_note = threads_policy(args.threads, [LAYOUTS[name] for name in args.layouts])
    body = report(results, command_line(SCRIPT, argv), shape, args.steps, threads_note, load_before, args)
    publish(body, args.out, SCRIPT, "Actor throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())

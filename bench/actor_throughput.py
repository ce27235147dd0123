#!/usr/bin/env python
"""Throughput of the megatron actor per parallel layout, on CPU gloo ranks or on accelerators.

    python bench/actor_throughput.py                                  # every layout but cp2/cp4, print tables
    python bench/actor_throughput.py --layouts single ep2 --steps 3
    python bench/actor_throughput.py --out docs/bench_actor.md        # also write the doc
    python bench/actor_throughput.py --lengths long-tail --max-tokens 512 --layouts single dp2 \
        --out docs/bench_dynamic_batch.md                             # micro-batches by rows vs by tokens
    python bench/actor_throughput.py --platform cuda --dtype bf16 --model mid --layouts single   # one GPU
    python bench/actor_throughput.py --seq-lens 256 512 1024 2048 --steps 3 \
        --out docs/bench_actor.md                                     # fast paths on/off against length
    python bench/actor_throughput.py --platform cuda --dtype bf16 --model qwen3_30b_a3b --layers 2 \
        --seq-lens 2048 8192 16384 32768 --steps 3                    # the Qwen3-30B-A3B slice on one GPU
    python bench/actor_throughput.py --seq-lens 1024 2048 4096 8192 --layouts single cp2 cp4 \
        --variants all-on --steps 3 --out docs/bench_cp.md            # context parallel against length

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

With ``--seq-lens S ...`` it runs the sequence-length sweep instead (``sweep_main``): on one rank
(layout ``single``) or on each of ``--layouts`` (e.g. ``single cp2 cp4``: context parallel over 1, 2
and 4 ranks), micro-batches of one row of S tokens (prompt ``--prompt-share`` of it, response the
rest, no padding), each "fast path" variant (``VARIANTS``: flash attention, grouped-GEMM experts,
chunked log-probs, packing, each off alone, all off) in fresh processes that run the lengths in
ascending order. It reports tok/s and MFU (``train_flops``) of the train step and the log-prob
pass, peak memory per rank (the device's; on the CPU the host's RSS and the peak of tensor storage
alive at once in one log-prob pass and one train step, ``bench.log_prob_memory.LiveBytes``), on
CUDA how often one train step and one log-prob pass made the host wait for the device
(``host_syncs``, with the lines that asked), and
the planner's predicted training peak (``megatron_bridge.plan.memory.estimate``) beside the
measured one. An out-of-memory error is caught in the rank and reported as OOM; that variant then
skips the longer lengths.
``--model qwen3_30b_a3b --layers N`` is a slice of Qwen3-30B-A3B with the real layer shapes and N
layers (``--experts E`` / ``--vocab V`` cut it further, for the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on sys.path, the packages are not
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    MID_SIZE, MODELS, check_out, command_line, cpu_cores, load_before_run, machine_facts, publish, run_ranks, save_model,
    save_shipped_model, synchronize,
)
from megatron_bridge.plan.layout import Cluster, Layout, TrainParallel  # noqa: E402
from megatron_bridge.plan.model_spec import ModelSpec, load_hf_config, load_model_spec  # noqa: E402
from megatron_bridge.verify import DTYPES  # noqa: E402

SCRIPT = "bench/actor_throughput.py"
SWEEP_BLOCK = "sequence lengths"  # the sweep's generated block (bench/common.py markers)
# --model: its description; qwen3_30b_a3b is a slice (--layers) with the real layer shapes
ACTOR_MODELS = {**MODELS, "qwen3_30b_a3b": "Qwen3-30B-A3B slice (configs/model/qwen3_30b_a3b.yaml)"}
SLICE_LAYERS = 2  # --model qwen3_30b_a3b's default --layers


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
    "cp2": BenchLayout(2, TrainParallel(cp=2)),
    "cp4": BenchLayout(4, TrainParallel(cp=4)),
}
# The layout tables' default: every layout but the context-parallel ones, which split sequences and
# are measured against sequence length (--seq-lens --layouts single cp2 cp4, docs/bench_cp.md).
TABLE_LAYOUTS = tuple(name for name, layout in LAYOUTS.items() if layout.train.cp == 1)


def rank_threads(layout: str, threads: int | None) -> int:
    """Intra-op threads of each of ``layout``'s ranks: --threads, the layout's own, else the usable
    cores // ranks (at least 1)."""
    bench = LAYOUTS[layout]
    return threads or bench.threads or max(1, cpu_cores() // bench.ranks)

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
    prompt: int = 32  # longest prompt; prompts are drawn from [prompt / 2, prompt] (fixed: all this long)
    response: int = 96  # response width R; uniform: drawn from [R / 3, R]; long-tail: R u^3, u ~ U(0, 1]; fixed: R
    micro_batch: int = 4
    seed: int = 0
    lengths: str = "uniform"

    def describe(self) -> str:
        if self.lengths == "fixed":
            return (f"{self.rows} rows, each a {self.prompt}-token prompt and a {self.response}-token response "
                    f"(seed {self.seed})")
        responses = (f"{max(1, self.response // 3)}-{self.response}" if self.lengths == "uniform"
                     else f"long-tailed up to {self.response} (R u^3, u uniform)")
        return f"{self.rows} rows, prompts {self.prompt // 2}-{self.prompt} and responses {responses} tokens (seed {self.seed})"


LENGTHS = ("uniform", "long-tail", "fixed")


# --- the batch -----------------------------------------------------------------------------------


def make_batch(shape: BatchShape, vocab_size: int) -> dict[str, torch.Tensor]:
    """A right-padded RL batch in the actor's convention, without ``old_log_probs`` (the log-prob
    pass fills them in). Advantages are per sequence, as GRPO/GSPO produce them."""
    g = torch.Generator().manual_seed(shape.seed)
    prompt = torch.randint(shape.prompt // 2, shape.prompt + 1, (shape.rows,), generator=g)
    if shape.lengths == "fixed":  # every row exactly prompt + response tokens
        prompt, response = torch.full((shape.rows,), shape.prompt), torch.full((shape.rows,), shape.response)
    elif shape.lengths == "uniform":
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


def build_actor(train: TrainParallel, checkpoint: str, dtype: str = "fp32", platform_name: str = "cpu",
                pack: bool = False):
    """This rank's actor with the checkpoint loaded (parallel state must be initialised); ``pack``:
    packed micro-batches where the attention takes them (``MegatronActor.packs``)."""
    from megatron_bridge.runtime.actor import MegatronActor
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.runtime.model import BuildOptions

    actor = MegatronActor(load_model_spec(checkpoint), train, BuildOptions(params_dtype=DTYPES[dtype]), OptimConfig(),
                          platform_name, pack)
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
               kernels=what_ran(actor),
               peak_device_mib=torch.cuda.max_memory_allocated() / 2**20 if actor.device.type == "cuda" else None)
    if profile_dir:  # after the memory reading: the profiler's own records would count in it
        _torch_profile(update, Path(profile_dir, f"{layout}{'_tokens' if max_tokens else ''}_rank{rank}.txt"))
    return out


def run_layout(layout: str, checkpoint: str, shape: BatchShape, max_tokens: int | None, steps: int,
               threads: int | None, profile_dir: str | None, platform: str, dtype: str) -> dict[str, Any]:
    """Spawn the layout's ranks and summarise what they measured."""
    start = time.perf_counter()
    ranks = run_ranks(measure, LAYOUTS[layout].ranks, rank_threads(layout, threads), layout, checkpoint, shape,
                      max_tokens, steps, profile_dir, dtype, platform=platform)
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
        "kernels": ranks[0]["kernels"],
    }


def describe_layout(layout: str) -> str:
    t, dp = LAYOUTS[layout].train, LAYOUTS[layout].dp
    parts = [f"TP{t.tp}" + ("+SP" if t.sequence_parallel else "")] if t.tp > 1 else []
    parts += [f"PP{t.pp}"] if t.pp > 1 else []
    parts += [f"CP{t.cp}"] if t.cp > 1 else []
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


def threads_policy(threads: int | None, layouts: list[str]) -> str:
    cores = cpu_cores()
    if threads:
        note = f"torch.set_num_threads({threads}) on every rank (--threads)"
    else:
        note = f"torch.set_num_threads(max(1, {cores} cores // ranks)) per rank"
        if "single-1t" in layouts:
            note += " (single-1t: 1 thread, to show the effect of intra-op threads)"
    busiest = max(LAYOUTS[name].ranks * rank_threads(name, threads) for name in layouts)
    if busiest > cores:
        note += f"; the busiest layout runs {busiest} threads on {cores} cores ({busiest / cores:g}x oversubscribed)"
    return note


def report(results: list[dict], command: str, shape: BatchShape, steps: int, threads_note: str,
           load_before: float, args: argparse.Namespace, model: str) -> str:
    return "\n".join([
        f"Command: `{command}`",
        "",
        *machine_facts(threads_note, load_before, args.platform),
        f"- model: {model}; {args.dtype} parameters; {results[0]['kernels']}",
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


# --- the model ------------------------------------------------------------------------------------


def base_config(model: str) -> dict[str, Any]:
    """--model's HF config before --layers / --experts / --vocab."""
    return {**load_hf_config("tiny_qwen3_moe"), **MID_SIZE} if model == "mid" else load_hf_config(
        "tiny_qwen3_moe" if model == "tiny" else model)


def model_overrides(args: argparse.Namespace) -> dict[str, int]:
    """HF config keys that --layers / --experts / --vocab change (the slice's layers by default)."""
    layers = args.layers or (SLICE_LAYERS if args.model == "qwen3_30b_a3b" else None)
    keys = {"num_hidden_layers": layers, "num_experts": args.experts, "vocab_size": args.vocab}
    return {k: v for k, v in keys.items() if v}


def write_model(directory: str, args: argparse.Namespace) -> str:
    """--model's random weights as a HF checkpoint in ``directory``: tiny and mid through
    transformers (``save_model``), the Qwen3-30B-A3B slice tensor by tensor in bf16
    (``save_shipped_model``; drawn on the GPU with --platform cuda)."""
    overrides = model_overrides(args)
    if args.model != "qwen3_30b_a3b":
        return save_model(directory, args.model, **overrides)
    print(f"writing the Qwen3-30B-A3B slice ({overrides}) ...", file=sys.stderr, flush=True)
    if args.platform == "cuda":  # in a process of its own: this one must hold no GPU memory while the ranks run
        import torch.multiprocessing as mp

        mp.spawn(_write_slice, args=(directory, args.model, overrides), nprocs=1, join=True)
        return directory
    return save_shipped_model(directory, args.model, dtype=torch.bfloat16, **overrides)


def _write_slice(rank: int, directory: str, model: str, overrides: dict[str, int]) -> None:
    save_shipped_model(directory, model, dtype=torch.bfloat16, device="cuda", **overrides)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.0f} k"


def describe_model(spec: ModelSpec, args: argparse.Namespace) -> str:
    """The model in words: its shape, and what was cut from the shipped one."""
    words = (f"{ACTOR_MODELS[args.model]}: {spec.num_layers} layer{'s' if spec.num_layers > 1 else ''}, "
             f"hidden {spec.hidden_size}, "
             f"{spec.num_attention_heads} q / {spec.num_query_groups} kv heads of {spec.head_dim}, "
             f"{spec.num_experts} experts top-{spec.moe_topk} (intermediate {spec.moe_ffn_hidden_size}), "
             f"vocabulary {spec.vocab_size:,}; {_count(spec.total_params)} parameters, "
             f"{_count(matmul_params(spec))} active in matmuls")
    if args.model == "qwen3_30b_a3b" and not args.checkpoint:
        full = load_hf_config(args.model)
        cuts = [f"{spec.num_layers} of its {full['num_hidden_layers']} layers"]
        if spec.num_experts != full["num_experts"]:
            share = full["num_experts"] // spec.num_experts if full["num_experts"] % spec.num_experts == 0 else None
            cuts.append(f"{spec.num_experts} of {full['num_experts']} experts"
                        + (f" (one EP{share} rank's share)" if share else ""))
        if spec.vocab_size != full["vocab_size"]:
            cuts.append(f"vocabulary cut to {spec.vocab_size:,} of {full['vocab_size']:,}")
        words += "; cut: " + ", ".join(cuts)
    return words


# --- the sequence-length sweep -------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One combination of the actor's fast paths (verl's switches in brackets)."""

    words: str
    flash_attn: bool = True  # fused attention (use_flash_attn); false: megatron's DotProductAttention
    grouped_gemm: bool = True  # grouped-GEMM experts (moe_grouped_gemm); false: megatron's SequentialMLP
    chunked: bool = True  # log-probs and entropy over chunks of tokens; false: log_prob_chunk_size=0
    pack: bool = True  # packed micro-batches (use_remove_padding)
    fused: bool = False  # the log-prob chunks' kernels fused by torch.compile (use_fused_kernels)

    def train(self, layout: str = "single") -> TrainParallel:
        """Bench layout ``layout``'s parallelism with this variant's kernel switches."""
        return replace(LAYOUTS[layout].train, flash_attn=self.flash_attn, grouped_gemm=self.grouped_gemm)

    def loss_config(self):
        from loss.gspo import PAPER_SETTINGS
        from loss.megatron_hook import ActorLossConfig

        chunk = {} if self.chunked else {"log_prob_chunk_size": 0}  # chunked: the loss package's default size
        return ActorLossConfig(loss_mode="gspo", policy=PAPER_SETTINGS, fused_kernels=self.fused, **chunk)


VARIANTS: dict[str, Variant] = {
    "all-on": Variant("every fast path on (the defaults)"),
    "attention-off": Variant("flash_attn=false: megatron's DotProductAttention", flash_attn=False),
    "experts-off": Variant("grouped_gemm=false: megatron's SequentialMLP", grouped_gemm=False),
    "unchunked": Variant("log-probs and entropy in one chunk (log_prob_chunk_size=0)", chunked=False),
    "unpacked": Variant("packing off (use_remove_padding=false)", pack=False),
    "all-off": Variant("all four off: megatron's modules, one chunk, padded", False, False, False, False),
    "fused": Variant("all-on with the log-prob chunks' kernels fused by torch.compile (use_fused_kernels=true)",
                     fused=True),
}
# The sweep's default: the fast paths each off in turn ("fused" is asked for by name: not the actor's default)
DEFAULT_VARIANTS = [name for name in VARIANTS if name != "fused"]

# Dense bf16 tensor-core peak per device (sparsity excluded), keyed by a part of
# torch.cuda.get_device_name(), most specific first; the vendor's data sheet quotes twice these
# figures "with sparsity".
PEAK_BF16_TFLOPS: tuple[tuple[str, float, str], ...] = (
    ("H100 PCIe", 756.0, "NVIDIA H100 data sheet, H100 PCIe: 1,513 TFLOPS bf16 with sparsity"),
    ("H100 NVL", 835.0, "NVIDIA H100 data sheet, H100 NVL: 1,671 TFLOPS bf16 with sparsity"),
    ("H100", 989.0, "NVIDIA H100 data sheet, H100 SXM: 1,979 TFLOPS bf16 with sparsity"),
    ("GH200", 989.0, "NVIDIA GH200 data sheet: 1,979 TFLOPS bf16 with sparsity"),
    ("H200", 989.0, "NVIDIA H200 data sheet, H200 SXM: 1,979 TFLOPS bf16 with sparsity"),
    ("A100", 312.0, "NVIDIA A100 data sheet: 312 TFLOPS bf16 dense"),
)


def device_peak(name: str) -> tuple[float, str] | None:
    """(dense bf16 TFLOPS, source) of a device by its name, None where the table has no entry."""
    for key, tflops, source in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops, source
    return None


def matmul_params(spec: ModelSpec) -> int:
    """Parameters one token meets in matrix products: q/k/v/o projections, router and the top-k
    experts' three matrices per layer, and the LM head (the embedding is a lookup, norms are not
    matmuls)."""
    attention = spec.hidden_size * (2 * spec.q_dim + 2 * spec.kv_dim)
    router = spec.num_experts * spec.hidden_size
    head = spec.vocab_size * spec.hidden_size
    return spec.num_layers * (attention + router + spec.moe_topk * spec.expert_params) + head


def train_flops(spec: ModelSpec, lengths: list[int]) -> float:
    """FLOPs of a training step (forward + backward) over sequences of ``lengths`` tokens:
    6 x active matmul parameters x tokens, plus causal attention 6 x layers x heads x head_dim x s^2
    per sequence (QK^T and PV, 2 x 2 s^2 d each head forward, halved by the causal mask, x 3 with
    backward). The log-prob pass is a third of it."""
    return sum(6 * matmul_params(spec) * s + 6 * spec.num_layers * spec.num_attention_heads * spec.head_dim * s**2
               for s in lengths)


def prompt_tokens(seq_len: int, share: float) -> int:
    return min(seq_len - 1, max(1, round(seq_len * share)))


def current_rss_mib() -> float:
    """This process's resident set now (Linux /proc; elsewhere its peak so far)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return peak_rss_mib()


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count (VmHWM) of this process; False where Linux won't."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def window_peak_rss_mib() -> float:
    """Peak RSS since the last ``reset_peak_rss`` (VmHWM), else since the process started."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return peak_rss_mib()


def _append(path: str, record: dict) -> None:
    """One JSON line of a rank's progress: what a rank killed later has measured is kept."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _wall(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of ``fn`` and its result, started on every rank together (a barrier)."""
    torch.distributed.barrier()
    synchronize()
    start = time.perf_counter()
    result = fn()
    synchronize()
    return time.perf_counter() - start, result


def is_oom(error: BaseException) -> bool:
    """An allocation that failed: torch's OutOfMemoryError, or cuBLAS / cuDNN / NCCL saying so."""
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text.lower() or "ALLOC_FAILED" in text


def oom_words(error: BaseException) -> str:
    """What an out-of-memory error tried, in short (torch: "Tried to allocate 28.50 GiB")."""
    text = str(error)
    found = re.search(r"Tried to allocate ([\d.]+ [KMGT]i?B)", text)
    return f"allocating {found.group(1)}" if found else text.splitlines()[0][:120] if text else "out of memory"


def host_syncs(fn: Callable[[], Any]) -> tuple[int, dict[str, int]]:
    """How often ``fn`` made the host wait for the CUDA device (torch's synchronizing operations:
    a value or size read back, a blocking copy, a stream's synchronize), counted by torch's sync
    debug mode, and the Python lines that asked for them, most first."""
    sites: Counter = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchronizing CUDA operation" in str(w.message):
            name = w.filename  # this repository's files and the installed packages' by their own paths
            for root in (f"{REPO}{os.sep}", f"site-packages{os.sep}"):
                name = name.split(root, 1)[-1]
            sites[f"{name}:{w.lineno}"] += 1
    return sum(sites.values()), dict(sites.most_common())


def measure_length(actor, variant: Variant, seq_len: int, rows: int, prompt_share: float, steps: int,
                   count_tensors: bool) -> dict[str, Any]:
    """Log-prob pass then train step, ``steps`` times after a warm-up, on ``rows`` rows of exactly
    ``seq_len`` tokens in micro-batches of one row; the peak RSS of the timed steps (since the last
    ``reset_peak_rss``); with ``count_tensors``, then one more of each, untimed, under ``LiveBytes``:
    the most bytes of tensor storage created in the pass alive at once (activations, logits,
    gradients in flight, collectives' buffers, the optimizer step's temporaries; not the weights,
    gradient buffers and Adam moments, which exist before it). On CUDA, then one more of each,
    untimed, under ``host_syncs``."""
    from bench.log_prob_memory import LiveBytes
    from loss.megatron_hook import log_prob_func, policy_loss_func

    prompt = prompt_tokens(seq_len, prompt_share)
    whole = make_batch(BatchShape(rows=rows, prompt=prompt, response=seq_len - prompt, micro_batch=1, lengths="fixed"),
                       actor.spec.vocab_size)
    batch = dp_share(whole, by_length=False)  # this DP rank's rows (all of them without DP)
    cfg = variant.loss_config()
    log_probs = partial(actor.forward_only, batch, 1,
                        partial(log_prob_func, cfg.temperature, False, log_prob_chunk_size=cfg.log_prob_chunk_size,
                                fused_kernels=cfg.fused_kernels))
    update = partial(actor.train_step, batch, 1, partial(policy_loss_func, cfg))
    out: dict[str, Any] = {"seq_len": seq_len, "prompt": prompt, "tokens": valid_tokens(whole), "train_s": [],
                           "log_prob_s": [], "skipped": 0}
    for step in range(steps + 1):  # step 0 warms up
        lp_s, lp_out = _wall(log_probs)
        batch["old_log_probs"] = lp_out["log_probs"]
        tr_s, metrics = _wall(update)
        if step:
            out["log_prob_s"].append(lp_s)
            out["train_s"].append(tr_s)
            out["skipped"] += int(metrics["actor/skipped"])
    out["peak_rss_mib"] = window_peak_rss_mib()  # before the counted passes: the counter costs memory of its own
    if count_tensors:
        for key, fn in (("log_prob_tensor_peak_mib", log_probs), ("train_tensor_peak_mib", update)):
            torch.distributed.barrier()
            with LiveBytes() as counter:
                fn()
            out[key] = counter.peak / 2**20
    if actor.device.type == "cuda":
        for key, fn in (("log_prob", log_probs), ("train", update)):
            torch.distributed.barrier()
            out[f"{key}_syncs"], out[f"{key}_sync_sites"] = host_syncs(fn)
    return out


def measure_lengths(rank: int, layout: str, variant: str, checkpoint: str, seq_lens: list[int], rows: int,
                    prompt_share: float, steps: int, dtype: str, progress: str) -> dict[str, Any]:
    """One variant of a layout in this (fresh) process, one of the layout's ranks: the actor built
    once, then each length in turn, written to ``progress``.rank<r>.jsonl as it is measured. An
    out-of-memory error ends the variant (the other ranks then wait in a collective until
    --run-timeout stops them)."""
    from megatron_bridge.runtime.actor import initialize_parallel
    from megatron_bridge.runtime.platform import active

    v, train = VARIANTS[variant], VARIANTS[variant].train(layout)
    initialize_parallel(train)
    actor = build_actor(train, checkpoint, dtype, active().name, v.pack)
    on_device = actor.device.type == "cuda"
    counts = not on_device
    loaded = current_rss_mib()
    path = f"{progress}.rank{rank}.jsonl"
    _append(path, {"kernels": what_ran(actor), "packs": actor.packs, "threads": torch.get_num_threads(),
                   "log_prob_chunk_size": v.loss_config().log_prob_chunk_size, "loaded_rss_mib": loaded,
                   "loaded_device_mib": torch.cuda.memory_allocated(actor.device) / 2**20 if on_device else None})
    for seq_len in seq_lens:
        if on_device:
            torch.cuda.reset_peak_memory_stats(actor.device)
        before = torch.cuda.memory_allocated(actor.device) / 2**20 if on_device else None
        windowed = reset_peak_rss()
        try:
            row = measure_length(actor, v, seq_len, rows, prompt_share, steps, count_tensors=counts)
        except RuntimeError as error:  # torch.OutOfMemoryError, or a library's failed allocation
            if not is_oom(error):
                raise
            row = {"seq_len": seq_len, "oom": oom_words(error), "peak_rss_mib": window_peak_rss_mib()}
        row.update(rss_growth_mib=row["peak_rss_mib"] - loaded if windowed else None, device_before_mib=before,
                   peak_device_mib=torch.cuda.max_memory_allocated(actor.device) / 2**20 if on_device else None)
        _append(path, row)
        if "oom" in row:
            break
    return {}


# what a layout's ranks measured at one length: the slowest rank's time per step, the largest memory
PER_RANK_MAX = ("peak_rss_mib", "rss_growth_mib", "device_before_mib", "peak_device_mib", "log_prob_tensor_peak_mib",
                "train_tensor_peak_mib")


# on CUDA, rank 0's count of host synchronisations in one log-prob pass and one train step, and their lines
SYNCS = ("log_prob_syncs", "train_syncs", "log_prob_sync_sites", "train_sync_sites")


def merge_ranks(ranks: list[dict]) -> dict[str, Any]:
    """One length's record of every rank of a layout as one: per step the slowest rank's seconds,
    the largest memory of any rank, an OOM if any rank had one."""
    merged = dict(ranks[0])
    for key in ("train_s", "log_prob_s"):
        if all(key in r for r in ranks):
            merged[key] = [max(steps) for steps in zip(*(r[key] for r in ranks))]
    for key in PER_RANK_MAX:
        values = [r[key] for r in ranks if r.get(key) is not None]
        merged[key] = max(values) if values else None
    oom = [r["oom"] for r in ranks if "oom" in r]
    if oom:
        merged = {k: v for k, v in merged.items() if k not in ("train_s", "log_prob_s")} | {"oom": oom[0]}
    return merged


def run_variant(layout: str, name: str, checkpoint: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Spawn the layout's ranks for one variant; what they measured, per length, with OOM / timeout /
    failure and the lengths not tried marked. Ranks that die or hang cost their variant, not the sweep."""
    progress = tmp / f"{layout}_{name}"
    world = LAYOUTS[layout].ranks
    failure = None
    start = time.perf_counter()
    try:
        run_ranks(measure_lengths, world, rank_threads(layout, args.threads), layout, name, checkpoint, args.seq_lens,
                  args.rows, args.prompt_share, args.steps, args.dtype, str(progress), platform=args.platform,
                  timeout=args.run_timeout)
    except TimeoutError:
        failure = f"timeout ({args.run_timeout:g} s)"
        print(f"[{layout} {name}] stopped after --run-timeout {args.run_timeout:g} s", file=sys.stderr)
    except Exception:  # noqa: BLE001 - the rank's traceback is printed; the sweep goes on
        traceback.print_exc()
        failure = "failed (traceback in the log)"
    per_rank = []
    for rank in range(world):
        path = Path(f"{progress}.rank{rank}.jsonl")
        per_rank.append([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])
    info = per_rank[0][0] if per_rank[0] else {}
    # a length counts as measured once every rank has written it
    measured = [{r["seq_len"]: r for r in lines[1:]} for lines in per_rank]
    lengths = []
    for seq_len in args.seq_lens:
        if all(seq_len in m for m in measured):
            lengths.append(merge_ranks([m[seq_len] for m in measured]))
        elif failure:  # the length it was on when it died
            lengths.append({"seq_len": seq_len, "failed": failure})
            failure = None
        else:  # after an OOM or a failure at a shorter length
            lengths.append({"seq_len": seq_len, "not_run": True})
    return {"layout": layout, "variant": name, "info": info, "lengths": lengths, "wall_s": time.perf_counter() - start}


def what_ran(actor) -> str:
    """The actor's compute paths and its optimizer, in words."""
    return f"{actor.kernels.describe()}; optimizer: {actor.optimizer_path}"


def predicted_peak_gib(spec: ModelSpec, layout: str, variant: Variant, seq_len: int, platform: str) -> float:
    """The planner's training peak per device for bench layout ``layout`` with the variant's switches,
    micro-batch 1 (``megatron_bridge.plan.memory.estimate``)."""
    from megatron_bridge.plan import memory

    plan = Layout("bench", train=variant.train(layout),
                  cluster=Cluster(devices_per_node=LAYOUTS[layout].ranks, device=platform))
    return memory.estimate(spec, plan, seq_len, 1, packed=variant.pack,
                           log_prob_chunk_size=variant.loss_config().log_prob_chunk_size).train_peak / 2**30


def peak_flops(args: argparse.Namespace) -> tuple[float, str] | None:
    """(FLOP/s, where the figure comes from) for MFU: --peak-tflops, else the device table on an
    accelerator; None on the CPU without --peak-tflops, or on a device the table lacks."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"{args.peak_tflops:g} TFLOPS (--peak-tflops)"
    if args.platform != "cuda":
        return None
    name = torch.cuda.get_device_name()
    found = device_peak(name)
    if found is None:
        print(f"warning: no bf16 peak known for {name!r}; pass --peak-tflops for the MFU columns", file=sys.stderr)
        return None
    return found[0] * 1e12, f"{found[0]:g} TFLOPS dense bf16 for the {name} ({found[1]}, halved)"


def sweep_rows(results: list[dict], spec: ModelSpec, args: argparse.Namespace, peak: float | None) -> list[dict]:
    """One summary per layout, variant and length: tok/s, MFU (of all the layout's devices), memory
    per rank, the planner's prediction."""
    out = []
    for result in results:
        layout, variant = result["layout"], VARIANTS[result["variant"]]
        for r in result["lengths"]:
            row = {"layout": layout, "variant": result["variant"], "seq_len": r["seq_len"],
                   "predicted_gib": predicted_peak_gib(spec, layout, variant, r["seq_len"], args.platform)}
            if "train_s" in r:
                train_s, log_prob_s = statistics.median(r["train_s"]), statistics.median(r["log_prob_s"])
                flops = train_flops(spec, [r["seq_len"]] * args.rows)
                devices = peak * LAYOUTS[layout].ranks if peak else None
                row.update(
                    tokens=r["tokens"], train_s=train_s, log_prob_s=log_prob_s, train_tok_s=r["tokens"] / train_s,
                    log_prob_tok_s=r["tokens"] / log_prob_s, skipped=r["skipped"],
                    train_mfu=flops / train_s / devices if devices else None,
                    log_prob_mfu=flops / 3 / log_prob_s / devices if devices else None,
                )
            row.update(status=status(r), **{key: r.get(key) for key in PER_RANK_MAX + SYNCS})
            out.append(row)
    return out


def status(r: dict) -> str | None:
    """None for a measured length, else what happened instead."""
    if "oom" in r:
        return f"OOM ({r['oom']})"
    if "failed" in r:
        return r["failed"]
    if r.get("not_run"):
        return "not run"
    return None


def _gib(mib: float | None) -> str:
    return "—" if mib is None else f"{mib / 1024:,.1f}"


def sweep_table(rows: list[dict], device: bool, mfu: bool, layouts: bool) -> str:
    """One line per (layout,) variant and length; a length not measured shows what happened instead.
    Memory is the largest of the layout's ranks."""
    speed = ["train step tok/s", *(["train MFU"] if mfu else []), "log-prob tok/s", *(["log-prob MFU"] if mfu else []),
             "train step s", "log-prob s"]
    per = " / rank" if layouts else ""
    memory = ([f"peak device memory{per} (GiB)", f"planner's train peak{per} (GiB)", "predicted / measured",
               "host syncs: train / log-prob"] if device
              else [f"peak RSS{per} (MiB)", f"growth over the loaded model{per} (MiB)",
                    f"tensor peak{per}: log-prob pass (MiB)", f"tensor peak{per}: train step (MiB)"])
    cols = [*(["layout"] if layouts else []), "variant", "tokens / sequence", *speed, *memory]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * (1 + layouts) + "--:|" * (len(cols) - 1 - layouts)]
    for r in rows:
        ran = r["status"] != "not run"
        if r["status"] is None:
            cells = [f"{r['train_tok_s']:,.0f}"] + ([f"{r['train_mfu']:.1%}"] if mfu else [])
            cells += [f"{r['log_prob_tok_s']:,.0f}"] + ([f"{r['log_prob_mfu']:.1%}"] if mfu else [])
            cells += [f"{r['train_s']:.3f}", f"{r['log_prob_s']:.3f}"]
        else:  # OOM / timeout / failed in the first cell, or not run
            cells = [r["status"] if ran else "—"] + ["—"] * (len(speed) - 1)
        if device:  # an OOM's peak is what it reached before it failed
            measured = r["peak_device_mib"] if r["status"] is None else None
            syncs = (r.get("train_syncs"), r.get("log_prob_syncs"))
            cells += [_gib(r["peak_device_mib"] if ran else None), f"{r['predicted_gib']:,.1f}",
                      f"{r['predicted_gib'] * 1024 / measured:.2f}" if measured else "—",
                      f"{syncs[0]} / {syncs[1]}" if None not in syncs else "—"]
        else:
            cells += [_mib(r[key] if ran else None) for key in ("peak_rss_mib", "rss_growth_mib")]
            cells += [_mib(r[key] if ran else None, 1) for key in ("log_prob_tensor_peak_mib", "train_tensor_peak_mib")]
        lines.append("| " + " | ".join([*([r["layout"]] if layouts else []), r["variant"], f"{r['seq_len']:,}", *cells])
                     + " |")
    return "\n".join(lines)


def _mib(mib: float | None, decimals: int = 0) -> str:
    return "—" if mib is None else f"{mib:,.{decimals}f}"


def kernels_table(results: list[dict], device: bool, layouts: bool) -> str:
    lines = ["| " + ("layout | " if layouts else "") + "variant | what it switches "
             "| what ran (`actor.kernels.describe()`, the optimizer) | micro-batches | log-prob chunk |"
             + (" device memory once loaded (GiB) |" if device else ""),
             "|---|" + ("---|" if layouts else "") + "---|---|---|--:|" + ("--:|" if device else "")]
    for result in results:
        info, v = result["info"], VARIANTS[result["variant"]]
        packed = "—" if not info else "packed" if info["packs"] else "padded"
        size = info.get("log_prob_chunk_size")
        chunk = "—" if not info else (f"{size:,} tokens" if size else "one") + (", fused" if v.fused else "")
        kernels = info.get("kernels", "did not start")
        loaded = f" {_gib(info.get('loaded_device_mib'))} |" if device else ""
        lines.append(f"| {result['layout'] + ' | ' if layouts else ''}{result['variant']} | {v.words} | {kernels} "
                     f"| {packed} | {chunk} |{loaded}")
    return "\n".join(lines)


def sweep_threads(results: list[dict], args: argparse.Namespace) -> str:
    """The sweep's threads per rank: one rank's count, or the layouts' policy."""
    if args.layouts == ["single"]:
        threads = {r["info"].get("threads") for r in results if r["info"]} - {None}
        return f"torch.set_num_threads({', '.join(map(str, sorted(threads))) or '?'}) in the one rank"
    return threads_policy(args.threads, args.layouts)


def sweep_report(results: list[dict], rows: list[dict], command: str, spec: ModelSpec, model: str,
                 args: argparse.Namespace, peak: tuple[float, str] | None, load_before: float) -> str:
    device = args.platform == "cuda"
    layouts = args.layouts != ["single"]
    prompt = ", ".join(f"{prompt_tokens(s, args.prompt_share):,} + {s - prompt_tokens(s, args.prompt_share):,}"
                       for s in args.seq_lens)
    facts = [
        f"Command: `{command}`",
        "",
        *machine_facts(sweep_threads(results, args), load_before, args.platform),
        f"- model: {model}; {args.dtype} parameters, random weights",
        f"- batch per length s: {args.rows} row{'s' if args.rows > 1 else ''} of exactly s tokens, "
        f"prompt + response = {prompt} "
        f"(--prompt-share {args.prompt_share:g}), no padding; micro-batch 1 row; GSPO loss "
        f"(`loss.gspo.PAPER_SETTINGS`); per step the log-prob pass (its log-probs become `old_log_probs`), "
        f"then one train step; median of {args.steps} steps after 1 warm-up",
        *(["- layouts: " + "; ".join(f"{name} = {describe_layout(name)} on {LAYOUTS[name].ranks} rank(s) x "
                                      f"{rank_threads(name, args.threads)} thread(s)" for name in args.layouts)
           + "; a step's time is the slowest rank's, a memory figure the largest rank's"] if layouts else []),
        ("- each layout and variant runs in fresh processes, one per rank" if layouts else
         "- each variant runs in one fresh process on one rank")
        + ", the lengths in ascending order; an out-of-memory error is caught there and reported as OOM, and that "
        "variant's longer lengths are not run" + (f"; --run-timeout {args.run_timeout:g} s per variant"
                                                  if args.run_timeout else ""),
        f"- FLOPs: train step = 6 x {matmul_params(spec):,} active matmul parameters (q/k/v/o, router, top-"
        f"{spec.moe_topk} experts' three matrices per layer, LM head) x tokens + 6 x {spec.num_layers} layers x "
        f"{spec.num_attention_heads} heads x {spec.head_dim} x s^2 per sequence (causal attention); log-prob pass "
        "= a third of that",
    ]
    if peak:
        facts.append(f"- MFU = FLOPs / wall time / peak{' / the layout ranks' if layouts else ''}; peak = {peak[1]}")
    if device:
        facts.append("- peak device memory: `torch.cuda.max_memory_allocated()` over the length's steps (reset before "
                     "each length); the planner's: `megatron_bridge.plan.memory.estimate(spec, "
                     + ("the layout" if layouts else "one-device layout")
                     + " with the variant's switches, s, micro_batch_size=1).train_peak` (bf16 weights, fp32 grads "
                     "and Adam, and the larger of the activations with the logits and the optimizer step's temporaries)")
        facts.append("- host syncs: after the timed steps, one more train step and log-prob pass under torch's sync "
                     "debug mode (`torch.cuda.set_sync_debug_mode(\"warn\")`), rank 0's: how often the host waited "
                     "for the device (a value or size read back, a blocking copy, a stream's synchronize), each wait "
                     "a gap in the device's queue")
    else:
        facts.append("- peak RSS: the process's VmHWM over the length's timed steps (reset before each length through "
                     "/proc/self/clear_refs); growth: that minus the RSS right after the model was loaded "
                     "(activations, Adam's moments from the first step, allocator caches)")
        facts.append("- tensor peak: after the timed steps, one more log-prob pass and one more train step under "
                     "`bench.log_prob_memory.LiveBytes`, which counts every tensor storage created in the pass from "
                     "its creation to its release: the most bytes alive at once (activations, logits, gradients in "
                     "flight, collectives' buffers, the optimizer step's temporaries; not the weights, gradient "
                     "buffers and Adam moments, which exist before the pass)"
                     + ("; not measured (—) with context parallel and padded micro-batches, whose attention builds "
                        "torch's CausalBias, a tensor subclass that torch cannot build under the counter's dispatch mode"
                        if any(LAYOUTS[n].train.cp > 1 for n in args.layouts)
                        and any(not VARIANTS[v].pack for v in args.variants) else ""))
    skipped = sum(r.get("skipped") or 0 for r in rows)
    return "\n".join(facts + [
        *([f"- warning: {skipped} steps were skipped (non-finite)"] if skipped else []),
        "",
        sweep_table(rows, device, peak is not None, layouts),
        "",
        "What ran in each variant:",
        "",
        kernels_table(results, device, layouts),
        *sync_sites(rows),
    ])


def sync_sites(rows: list[dict]) -> list[str]:
    """Where the train step of the last row with a sync count made the host wait, as report lines."""
    counted = [r for r in rows if r.get("train_sync_sites")]
    if not counted:
        return []
    r = counted[-1]
    return ["", f"Where the train step made the host wait ({r['variant']}, {r['seq_len']:,} tokens; waits, the "
                "Python line that asked):", "",
            *(f"- {n} x `{site}`" for site, n in r["train_sync_sites"].items())]


def sweep_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    load_before = load_before_run()
    results = []
    with tempfile.TemporaryDirectory(prefix="actor_sweep_") as tmp:
        checkpoint = args.checkpoint or write_model(tmp, args)
        spec = load_model_spec(checkpoint)
        model = describe_model(spec, args)
        print(f"model: {model}", file=sys.stderr, flush=True)
        for layout in args.layouts:
            for name in args.variants:
                tag = name if args.layouts == ["single"] else f"{layout} {name}"
                print(f"[{tag}] {VARIANTS[name].words} on {describe_layout(layout)} ...", file=sys.stderr, flush=True)
                result = run_variant(layout, name, checkpoint, args, Path(tmp))
                for row in sweep_rows([result], spec, args, None):
                    done = (f"{row['train_tok_s']:,.0f} train tok/s, {row['log_prob_tok_s']:,.0f} log-prob tok/s"
                            if row["status"] is None else row["status"])
                    if row["status"] == "not run":
                        memory = ""
                    elif row["peak_device_mib"] is not None:
                        memory = (f", peak {_gib(row['peak_device_mib'])} GiB (planner {row['predicted_gib']:.1f}; "
                                  f"{_gib(row['device_before_mib'])} GiB held before the length)")
                    elif row["train_tensor_peak_mib"] is not None:
                        memory = f", tensor peak {row['train_tensor_peak_mib']:,.0f} MiB in the train step"
                    else:
                        memory = ""
                    print(f"[{tag}] {row['seq_len']:,} tokens: {done}{memory}", file=sys.stderr, flush=True)
                print(f"[{tag}] {result['wall_s']:.0f} s with start-up", file=sys.stderr, flush=True)
                results.append(result)
    peak = peak_flops(args)  # after the ranks: asking the GPU's name opens a CUDA context in this process
    rows = sweep_rows(results, spec, args, peak[0] if peak else None)
    body = sweep_report(results, rows, command_line(SCRIPT, argv), spec, model, args, peak, load_before)
    publish(body, args.out, SCRIPT, "Actor throughput", SWEEP_BLOCK)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python bench/actor_throughput.py",
        description="Tokens/s of the megatron actor's GSPO train step and log-prob pass, peak memory and a "
        "phase profile, for the tiny (or mid-size) Qwen3-MoE on CPU gloo ranks or accelerators under several "
        "parallel layouts; with --seq-lens, tok/s, MFU and peak memory against sequence length with each fast "
        "path on and off, on one rank or on the --layouts given (e.g. single cp2 cp4: context parallel).",
        epilog="layouts: " + "; ".join(f"{name} = {describe_layout(name)} on {LAYOUTS[name].ranks} rank(s)" for name in LAYOUTS)
        + ". variants (--seq-lens): " + "; ".join(f"{name} = {v.words}" for name, v in VARIANTS.items()),
    )
    p.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=None, metavar="LAYOUT",
                   help=f"layouts to run (choices: {', '.join(LAYOUTS)}; default: {', '.join(TABLE_LAYOUTS)}, all "
                        "but the context-parallel ones; with --seq-lens: single)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per layout, after one warm-up (default 5)")
    p.add_argument("--rows", type=int, default=None,
                   help=f"rows in the global batch (default {BatchShape.rows}; with --seq-lens 1 per length)")
    p.add_argument("--prompt", type=int, default=BatchShape.prompt, help="longest prompt (default 32)")
    p.add_argument("--response", type=int, default=BatchShape.response, help="response width (default 96)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help=f"micro-batch size (default {BatchShape.micro_batch}; --seq-lens: always 1)")
    p.add_argument("--lengths", choices=LENGTHS, default=BatchShape.lengths,
                   help="response lengths: uniform in [R/3, R] (default), long-tail (most short, a few long) or "
                        "fixed (every row --prompt + --response)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="also run every layout with micro-batches by a token budget of N per micro-batch "
                        "(dynamic batch size)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per rank (default: usable cores // ranks, at least 1)")
    p.add_argument("--platform", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo ranks (default); cuda: one GPU per rank, nccl")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="parameter dtype (default fp32)")
    p.add_argument("--model", choices=tuple(ACTOR_MODELS), default="tiny",
                   help="tiny (default), mid (0.70 B parameters, bench/common.py MID_SIZE) or qwen3_30b_a3b (a slice "
                        f"of Qwen3-30B-A3B with the real layer shapes, --layers of them, default {SLICE_LAYERS})")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's; the slice's 2)")
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts per layer, e.g. 16 for one EP8 rank's share of 128 (default: the model's)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the model's; to cut the slice "
                   "for a CPU)")
    p.add_argument("--checkpoint", default=None,
                   help="HF directory of the model (default: write --model's random weights to a temp dir)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, metavar="S",
                   help="run the sequence-length sweep instead of the layout tables: sequences of S tokens, "
                        "micro-batch 1, on layout single or the --layouts given")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=DEFAULT_VARIANTS, metavar="VARIANT",
                   help=f"fast-path variants of the sweep (default: {', '.join(DEFAULT_VARIANTS)}; "
                        f"choices: {', '.join(VARIANTS)})")
    p.add_argument("--prompt-share", type=float, default=0.2,
                   help="the sweep's prompt share of each sequence, the rest response (default 0.2: 2k + 8k at 10k)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak in TFLOPS for the MFU columns (default: bf16 dense from the table of "
                        "known GPUs; no MFU on the CPU unless given)")
    p.add_argument("--run-timeout", type=float, default=None, metavar="SECONDS",
                   help="stop a sweep variant's processes after this long and report it as a timeout")
    p.add_argument("--torch-profile", metavar="DIR", default=None,
                   help="also run one extra train step under torch.profiler and write each rank's top ops to DIR")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown file whose generated block to (re)write, e.g. docs/bench_actor.md (the sweep "
                        f"writes the block marked '{SWEEP_BLOCK}')")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    for flag in ("layers", "experts", "vocab", "rows", "micro_batch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.checkpoint and not Path(args.checkpoint, "config.json").is_file():
        p.error(f"--checkpoint {args.checkpoint}: no config.json there (expected a HF model directory)")
    if args.checkpoint and (args.layers or args.experts or args.vocab):
        p.error("--layers / --experts / --vocab shape the random model; a --checkpoint has its own shape")
    top_k = base_config(args.model)["num_experts_per_tok"]
    if args.experts is not None and args.experts < top_k:
        p.error(f"--experts {args.experts}: each token is routed to {top_k} experts; keep at least that many")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        p.error("--peak-tflops must be > 0")
    if args.platform == "cuda" and not torch.cuda.is_available():
        p.error("--platform cuda: torch sees no GPU here")
    if args.seq_lens:
        _check_sweep(p, args)
    else:
        _check_layouts(p, args)
    return args


def _check_sweep(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.layouts = args.layouts or ["single"]
    for flag, given in (("--max-tokens", args.max_tokens), ("--torch-profile", args.torch_profile)):
        if given:
            p.error(f"{flag} is for the layout tables, not the --seq-lens sweep")
    if args.micro_batch not in (None, 1):
        p.error("--seq-lens measures micro-batches of one row; leave out --micro-batch")
    if min(args.seq_lens) < 2:
        p.error("--seq-lens: each length must be >= 2 (a prompt and a response token)")
    if sorted(set(args.seq_lens)) != args.seq_lens:
        p.error("--seq-lens must be ascending, each once: a variant that runs out of memory at one length skips the "
                "longer ones")
    if not 0 < args.prompt_share < 1:
        p.error("--prompt-share must be between 0 and 1")
    if args.run_timeout is not None and args.run_timeout <= 0:
        p.error("--run-timeout must be > 0")
    args.rows = args.rows or 1
    args.micro_batch = 1
    for name in args.layouts:
        multiple = LAYOUTS[name].train.seq_multiple
        uneven = [s for s in args.seq_lens if s % multiple]
        if uneven:
            p.error(f"--seq-lens {' '.join(map(str, uneven))}: layout {name} splits a sequence into {multiple} chunks; "
                    f"choose multiples of {multiple}: the actor would pad the rest, and the sweep measures rows "
                    "without padding")
        for variant in args.variants:
            if LAYOUTS[name].train.cp > 1 and not VARIANTS[variant].flash_attn:
                p.error(f"layout {name} with variant {variant}: megatron's DotProductAttention has no context "
                        "parallel; choose variants with the fused attention: "
                        + ", ".join(n for n, v in VARIANTS.items() if v.flash_attn))
    _check_ranks(p, args)
    check_out(p, args.out, SCRIPT, SWEEP_BLOCK)


def _check_layouts(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag, given in (("--variants", args.variants != DEFAULT_VARIANTS), ("--run-timeout", args.run_timeout)):
        if given:
            p.error(f"{flag} is for the --seq-lens sweep")
    args.layouts = args.layouts or list(TABLE_LAYOUTS)
    args.rows = args.rows or BatchShape.rows
    args.micro_batch = args.micro_batch or BatchShape.micro_batch
    if args.max_tokens is not None and args.max_tokens < args.prompt + args.response:
        p.error(f"--max-tokens {args.max_tokens} must hold the longest sequence, --prompt + --response = "
                f"{args.prompt + args.response}")
    check_out(p, args.out, SCRIPT)
    for name in args.layouts:
        if args.max_tokens and LAYOUTS[name].train.pp > 1:
            p.error(f"--max-tokens with layout {name}: micro-batches of different lengths need megatron's variable "
                    "sequence lengths in the pipeline, which the CPU path's allgather MoE dispatcher turns off; "
                    "choose layouts without PP")
    _check_ranks(p, args)


def _check_ranks(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every layout's ranks have a GPU each (--platform cuda) and a share of --rows."""
    if args.platform == "cuda":
        devices = torch.cuda.device_count()
        too_wide = [name for name in args.layouts if LAYOUTS[name].ranks > devices]
        if too_wide:
            p.error(f"--platform cuda: layouts {', '.join(too_wide)} need more ranks than the {devices} visible GPU(s); "
                    "choose layouts that fit, e.g. --layouts single")
    for name in args.layouts:
        dp = LAYOUTS[name].dp
        if args.rows % (dp * args.micro_batch):
            p.error(f"--rows {args.rows} must split into DP{dp} x --micro-batch {args.micro_batch} for layout {name}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.seq_lens:
        return sweep_main(args, argv)
    shape = BatchShape(rows=args.rows, prompt=args.prompt, response=args.response, micro_batch=args.micro_batch,
                       lengths=args.lengths)
    if args.torch_profile:
        Path(args.torch_profile).mkdir(parents=True, exist_ok=True)
    load_before = load_before_run()
    results = []
    with tempfile.TemporaryDirectory(prefix="tiny_qwen3_moe_") as tmp:
        checkpoint = args.checkpoint or write_model(tmp, args)
        model = describe_model(load_model_spec(checkpoint), args)
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
    threads_note = threads_policy(args.threads, args.layouts)
    body = report(results, command_line(SCRIPT, argv), shape, args.steps, threads_note, load_before, args, model)
    publish(body, args.out, SCRIPT, "Actor throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())

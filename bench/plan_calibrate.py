#!/usr/bin/env python
"""Calibrate the planner's step-time model on CPU gloo ranks, then check it against the actor.

    python bench/plan_calibrate.py probe --out docs/bench_plan.md      # rates -> bench/calibration/*.yaml
    python bench/plan_calibrate.py compare --steps 5 --out docs/bench_plan.md   # predicted vs measured
    python bench/plan_calibrate.py calibrate --steps 5 --out docs/bench_plan.md # both, their rounds in turn
    python -m megatron_bridge.plan check --model tiny_qwen3_moe --parallel tiny_cpu \
        --hardware bench/calibration/cpu_gloo_2x1.yaml ...                  # a sheet in the planner

``probe`` measures, for each way bench/actor_throughput.py runs ranks here (``RANKS x THREADS``:
1 x 2 for ``single``, 1 x 1 for ``single-1t``, 2 x 1 and 4 x 1 for the 2- and 4-rank layouts), with
that many ranks running at once, each with that many intra-op threads (so the 4-rank probe shares
the cores as the 4-rank layouts do), every configuration once in each of ``--rounds`` rounds, in
turn, its figures fitted over every round's points (the machine's drift falls on all of them alike):

- the gloo collectives' launch latency and bandwidth: ``all_gather_into_tensor`` and
  ``all_to_all_single`` of 1 KiB to 1 MiB per rank back to back, each a median over repeats,
  fitted together to t = latency + bytes through a rank / rate (a ring all-gather moves (n-1) x
  the local buffer through each rank, an all-to-all (n-1)/n of it:
  ``megatron_bridge.plan.collectives``); then every call of the 2- and 3-layer models at TP2 with
  sequence parallel (the ranks in TP pairs), forward with the log-probs and backward at 4 rows of 128
  tokens, timed one by one: seconds per call as a decoder layer issues them between its own compute (it
  includes waiting for a peer held up by its compute or by the scheduler, which back-to-back calls
  never do) are the sheet's latency, per ring step (a pair's call is one; ``step_time.launch_seconds``
  counts a group's n - 1); where the ranks share the cores at least two a core (4 x 1 on 2 cores)
  the sheet says ``ranks_share_cores`` (the planner then counts no pipeline bubble: the waiting
  stage leaves its core to the busy one);
- one decoder layer of the tiny Qwen3-MoE (``configs/model/tiny_qwen3_moe.yaml``, megatron's
  GPTModel with the kernels the CPU actor builds: torch SDPA, grouped-GEMM experts, fp32), as the
  difference between a 3-layer and a 2-layer model (a layer costs more the deeper the model, and the
  tiny model has 4), forward and backward separately (means of three times the repeats), at 4 rows
  of 16, 48, 128 and 256 tokens, fitted together to t_fwd = fixed_fwd + FLOPs / rate and
  t_bwd = fixed_bwd + 2 FLOPs / rate (``megatron_bridge.plan.flops``): the rate the layer's work
  reaches at these shapes, and its fixed cost per micro-batch (Python, kernel launches); and the
  rest of the model (the 2-layer model less two such layers: embedding, output layer and the actor's
  chunked log-probs, ``loss.vocab_parallel``, on half of each row) less the output layer's FLOPs
  at that rate, a fixed cost per micro-batch (the median over the lengths);
- where the ranks pair up, the same layer at TP2 with sequence parallel and at EP2 (the CPU
  actor's allgather MoE dispatcher), as the 3-layer less the 2-layer model at 4 rows of 128 tokens,
  the seconds inside collectives left out: what it takes beyond its FLOPs over TP at the rate and
  the layer's fixed cost is what a layer adds under TP (under EP), a fixed cost per micro-batch;
- the actor's own train step (``MegatronActor.train_step``, the GSPO loss the bench trains with) on
  the 1- and 2-layer models, at one and two micro-batches of 4 rows of 128 tokens, a bare forward
  and backward of one such micro-batch and the optimizer step alone, in turns, the differences taken
  within each repetition: what the step adds per micro-batch (megatron's schedule, the policy loss
  beyond the log-probs; counted with the rest of the model's backward), per decoder layer (the
  optimizer step's work tensor by tensor) and per step (the clip and Python, the step's metric
  sums), beyond the Adam bytes at the copy rate and the gradient reduce-scatter and parameter
  all-gather at the gloo fit, which ``step_time`` counts as terms of their own;
- the memory copy rate (``Tensor.copy_`` of 32 MiB, read + write), at which the planner counts
  the optimizer's Adam bytes;

all after one all-gather of the model's parameters, as the actor's distributed optimizer runs at the
end of every optimizer step (``bench/cpu_threads.py``: one rank on all the cores runs slower after it).

and writes each as a hardware sheet (configs/hardware's format; ``kind: measured``, ``by: probe``,
the fixed costs under ``overheads``) that ``python -m megatron_bridge.plan check --hardware PATH``
reads. A 1-rank sheet has no peers to measure collectives with: its link figures are the 2-rank
probe's (it uses none of them: a single rank sends nothing).

``compare`` runs bench/actor_throughput.py's layouts (its default batch: 16 rows, micro-batches of 4
rows padded to the longest, one optimizer step; median of ``--steps`` after a warm-up), every layout
once in each of ``--rounds`` rounds, and beside each measured train step (the rounds' median) the
planner's prediction for it (``step_time.optimizer_step``: that layout, micro-batches of 4
sequences at the padded length, at the sheet of the layout's ranks x threads), with the error and
the order of the layouts by each, and which pairs of layouts the rounds tell apart (every round of
one faster than every round of the other; closer pairs trade places between runs). Nothing of the
comparison feeds back into the sheets. The log-prob pass is shown too (``step_time.log_prob_pass``),
not judged.

``calibrate`` is ``probe`` and ``compare`` in one run, their rounds in turn (probe round 1, comparison
round 1, probe round 2, ...): the rates are fitted from the probe's rounds alone, as ``probe`` fits
them, but over the same stretch of the machine as the steps they are checked against (on a small
shared machine a rank's speed drifts by more between two runs half an hour apart than within one:
docs/bench_plan.md).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on sys.path, the packages are not
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import yaml  # noqa: E402

from bench.common import (  # noqa: E402
    check_out, command_line, cpu_cores, load_before_run, machine_facts, median_seconds, publish, run_ranks,
    save_model,
)
from megatron_bridge.plan import flops  # noqa: E402
from megatron_bridge.plan.hardware import GB  # noqa: E402
from megatron_bridge.plan.model_spec import ModelSpec, load_model_spec  # noqa: E402

SCRIPT = "bench/plan_calibrate.py"
TITLE = "The planner's step time against the CPU actor"
PROBE_BLOCK = "probe"  # the probe's generated block in --out (bench/common.py markers); compare writes the first
MODEL = "tiny_qwen3_moe"
SHEETS = REPO / "bench" / "calibration"
LOCAL_BYTES = (1024, 16 * 1024, 128 * 1024, 1024 * 1024)  # per rank, fp32
LAYER_TOKENS = (16, 48, 128, 256)  # sequence lengths of the layer probe, 4 rows each
LAYER_ROWS = 4
# the decoder layer is timed as the third of a model's (3 layers less 2): a layer costs more the deeper
# the model (7.7-8.1, 8.3-8.4, 8.6-8.7 ms from the second layer to the fourth at 4 x 128 tokens on
# one rank: the working set outgrows the caches), and the tiny model has 4
LAYER_DEPTHS = (2, 3)
# a layer is a difference of two models' passes, and a pass varies by 10-20 % from one to the next on
# a small shared machine (the 3-layer model at 4 x 128 tokens on one rank: sd 7-18 ms of 75-105 ms):
# LAYER_REPEATS times the repeats, and their mean (a train step sums its passes; a median flips
# between the fast and the slow passes of a rank whose OpenMP workers sleep, bench/cpu_threads.py)
LAYER_REPEATS = 3
COPY_BYTES = 32 * 2**20


def _shown(path: Path) -> str:
    """A path as the docs quote it: relative to the repository where it is inside it."""
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def sheet_name(ranks: int, threads: int) -> str:
    return f"cpu_gloo_{ranks}x{threads}"


def bench_configs() -> list[tuple[int, int]]:
    """(ranks, threads per rank) of every layout bench/actor_throughput.py runs on this machine."""
    from bench.actor_throughput import LAYOUTS

    return sorted({(b.ranks, b.threads or max(1, cpu_cores() // b.ranks)) for b in LAYOUTS.values()})


# --- the probe, in each rank -------------------------------------------------------------------------


def _collectives(repeats: int) -> list[dict]:
    """Seconds per call of an all-gather and an all-to-all of each size (every rank calls them
    back to back, so a call's time includes waiting for the slowest peer)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    out = []
    for local in LOCAL_BYTES:
        x = torch.randn(local // 4)
        gathered = torch.empty(n * x.numel())
        a2a = torch.empty_like(x) if x.numel() % n == 0 else None
        dist.barrier()
        seconds = median_seconds(lambda: dist.all_gather_into_tensor(gathered, x), repeats)
        out.append({"op": "all_gather", "local_bytes": local, "through_bytes": local * (n - 1), "s": seconds})
        if a2a is not None:
            dist.barrier()
            seconds = median_seconds(lambda: dist.all_to_all_single(a2a, x), repeats)
            out.append({"op": "all_to_all", "local_bytes": local, "through_bytes": local * (n - 1) / n, "s": seconds})
    return out


def _rows(spec: ModelSpec, s: int) -> dict[str, torch.Tensor]:
    """A probe micro-batch: 4 rows of ``s`` random tokens, the second half of each scored."""
    scored = (torch.arange(LAYER_ROWS)[:, None] * s + torch.arange(s // 2, s)).flatten()  # rows of [b * s, V]
    return {"ids": torch.randint(3, spec.vocab_size, (LAYER_ROWS, s)), "positions": torch.arange(s).expand(LAYER_ROWS, s),
            "scored": scored, "targets": torch.randint(0, spec.vocab_size, scored.shape)}


def _log_prob_loss(model, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's forward with the actor's log-probs on its logits (``loss.vocab_parallel``, the
    entropy as a metric); their mean as the loss."""
    from loss.vocab_parallel import vocab_parallel_log_probs_and_entropy

    logits = model(input_ids=rows["ids"], position_ids=rows["positions"], attention_mask=None)
    log_probs, _ = vocab_parallel_log_probs_and_entropy(logits.reshape(-1, logits.shape[-1]), rows["scored"],
                                                        rows["targets"], 1.0, True, reuse_logits=True)
    return log_probs.mean()


# The parallelism of the CPU layouts whose decoder layer the probe times on pairs of ranks: a layer
# under TP2 with sequence parallel (tp2sp, tp2ep2) and under EP2 (the allgather dispatcher: ep2,
# tp2ep2, pp2ep2) costs more than its share of FLOPs at the rate (the SP gathers' and the
# dispatcher's own Python and permutations; smaller GEMMs); the sheet keeps that beyond as a fixed cost
PARALLEL_LAYERS = {"tp": {"tp": 2, "sequence_parallel": True}, "ep": {"ep": 2}}
PARALLEL_LAYER_TOKENS = 128


def _parallel_layers(spec: ModelSpec, repeats: int) -> dict[str, dict]:
    """One decoder layer under each of ``PARALLEL_LAYERS`` (megatron's groups rebuilt for each, so
    this runs last): the ``LAYER_DEPTHS`` models at 4 rows of 128 tokens, forward with the log-probs
    and backward, alternately, every collective timed (bench/actor_throughput.py's
    ``time_collectives``); the layer is the deeper model less the shallower, of the seconds outside
    the collectives; and the seconds per call over every pass (at TP2 each call spans a pair of
    ranks: one ring step)."""
    from megatron.core import parallel_state

    from bench.actor_throughput import PhaseTimers, time_collectives
    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.runtime.actor import initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions, build_model_chunks

    timers = PhaseTimers()
    time_collectives(timers)
    rows = _rows(spec, PARALLEL_LAYER_TOKENS)
    out = {}
    for name, parallel in PARALLEL_LAYERS.items():
        parallel_state.destroy_model_parallel()
        train = TrainParallel(**parallel)
        initialize_parallel(train)
        models = {layers: build_model_chunks(replace(spec, num_layers=layers), train,
                                             BuildOptions(params_dtype=torch.float32), "cpu")[1][0]
                  for layers in LAYER_DEPTHS}
        mean, per_call = _depth_passes(models, rows, repeats, timers)
        low, high = LAYER_DEPTHS
        out[name] = {"parallel": parallel, "flops": LAYER_ROWS * flops.layer_forward_flops(spec, PARALLEL_LAYER_TOKENS),
                     "fwd_s": mean[high, "fwd"] - mean[low, "fwd"], "bwd_s": mean[high, "bwd"] - mean[low, "bwd"],
                     "call_s": statistics.median(per_call)}
    return out


def _build_models(spec: ModelSpec) -> dict[int, Any]:
    """Megatron GPTModels of the tiny model's shape with ``LAYER_DEPTHS`` decoder layers, as the CPU
    actor builds them (parallel state up first, one rank a replica)."""
    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.runtime.actor import initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions, build_model_chunks

    train = TrainParallel()
    initialize_parallel(train)
    return {layers: build_model_chunks(replace(spec, num_layers=layers), train,
                                       BuildOptions(params_dtype=torch.float32), "cpu")[1][0]
            for layers in LAYER_DEPTHS}


def _depth_passes(models: dict[int, Any], rows: dict[str, torch.Tensor], repeats: int,
                  timers: Any = None) -> tuple[dict[tuple[int, str], float], list[float]]:
    """Mean forward and backward seconds of each of the ``LAYER_DEPTHS`` models on ``rows``
    (``LAYER_REPEATS`` times the repeats, the models alternately, every rank starting each pass
    together); with ``timers`` (the collectives routed through them, ``time_collectives``) the
    seconds inside collectives left out, and each pass's seconds per call."""
    import torch.distributed as dist

    def comm() -> float:
        return sum(timers.comm.values()) if timers is not None else 0.0

    times: dict[tuple[int, str], list[float]] = {(layers, k): [] for layers in models for k in ("fwd", "bwd")}
    per_call = []
    for rep in range(LAYER_REPEATS * repeats + 2):  # two warm-ups
        for layers, model in models.items():
            model.zero_grad(set_to_none=True)
            dist.barrier()
            if timers is not None:
                timers.reset()
            start = time.perf_counter()
            loss = _log_prob_loss(model, rows)
            middle, forward_comm = time.perf_counter(), comm()
            loss.backward()
            end, total_comm = time.perf_counter(), comm()
            if rep >= 2:
                times[layers, "fwd"].append(middle - start - forward_comm)
                times[layers, "bwd"].append(end - middle - (total_comm - forward_comm))
                if timers is not None:
                    per_call.append(total_comm / timers.calls)
    return {k: statistics.mean(v) for k, v in times.items()}, per_call


def _layer_times(spec: ModelSpec, models: dict[int, Any], repeats: int) -> list[dict]:
    """Forward and backward seconds of the ``LAYER_DEPTHS`` models per sequence length, measured
    alternately, each with the actor's log-probs on its logits (``loss.vocab_parallel``, entropy
    as a metric, the second half of each row scored, their mean as the loss): the difference is one
    decoder layer; the shallower model less its layers, the rest of the model (embedding, output
    layer, log-probs). Every rank starts each pass together, as the actor's ranks run in step (their
    collectives hold them together): ranks that share the cores share them for the whole pass."""
    out = []
    for s in LAYER_TOKENS:
        mean, _ = _depth_passes(models, _rows(spec, s), repeats)
        low, high = LAYER_DEPTHS
        layer = {k: mean[high, k] - mean[low, k] for k in ("fwd", "bwd")}
        out.append({"tokens": LAYER_ROWS * s, "seq_len": s,
                    "flops": LAYER_ROWS * flops.layer_forward_flops(spec, s),
                    "logits_flops": flops.logits_flops(spec, LAYER_ROWS * s),
                    "fwd_s": layer["fwd"], "bwd_s": layer["bwd"],
                    "rest_fwd_s": mean[low, "fwd"] - low * layer["fwd"],
                    "rest_bwd_s": mean[low, "bwd"] - low * layer["bwd"]})
    return out


def _copy_rate(repeats: int) -> float:
    src, dst = torch.randn(COPY_BYTES // 4), torch.empty(COPY_BYTES // 4)
    return 2 * COPY_BYTES / median_seconds(lambda: dst.copy_(src), repeats)


def _parameter_gather(model) -> None:
    """One gloo all-gather of the model's parameter buffer, as megatron's DistributedOptimizer runs
    after every optimizer step (also at DP 1), so that the layers are timed in the state the actor's
    are: on a rank whose intra-op threads take all the cores, OpenMP runs slower after it for the rest
    of the process (bench/cpu_threads.py)."""
    import torch.distributed as dist

    local = torch.zeros(sum(p.numel() for p in model.parameters()))
    dist.all_gather_into_tensor(torch.empty(dist.get_world_size() * local.numel()), local)


def _train_steps(spec: ModelSpec, repeats: int) -> list[dict]:
    """What the actor's own train step (``MegatronActor.train_step`` with the GSPO policy loss
    bench/actor_throughput.py trains with: megatron's schedule, the gradient sync, the distributed
    Adam with the gradient norm, the clip and the parameter all-gather) takes beyond its passes, on
    the 1- and 2-layer models: timed for one and two micro-batches of 4 rows of 128 tokens (half of
    them response), beside the bare forward and backward of one such micro-batch (the model and the
    log-probs, as the layer probe times them) and the optimizer step alone (``optimizer_step`` on the
    gradients the steps left), the four in turns. Per point: the medians of each repetition's own
    differences (a second micro-batch less its bare pass; twice the 1-micro-batch step less the
    2-micro-batch one), which the machine's drift over the repetitions leaves alone where a
    difference of medians does not; the optimizer step's median; and the parameters this rank
    updates (1/DP of them: every rank a data-parallel replica)."""
    import torch.distributed as dist

    from bench.actor_throughput import BatchShape, make_batch
    from loss.gspo import PAPER_SETTINGS
    from loss.megatron_hook import ActorLossConfig, log_prob_func, policy_loss_func
    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.runtime.actor import MegatronActor
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.runtime.optim import OptimConfig

    loss_cfg = ActorLossConfig(loss_mode="gspo", policy=PAPER_SETTINGS)
    shape = BatchShape(rows=2 * LAYER_ROWS, prompt=64, response=64, micro_batch=LAYER_ROWS, lengths="fixed")
    out = []
    for layers in (1, 2):
        actor = MegatronActor(replace(spec, num_layers=layers), TrainParallel(), BuildOptions(params_dtype=torch.float32),
                              OptimConfig(lr=1e-6), "cpu")
        actor.build_optimizer()
        batch = make_batch(shape, spec.vocab_size)
        batch["old_log_probs"] = actor.forward_only(batch, LAYER_ROWS, partial(log_prob_func, 1.0, False))["log_probs"]
        one = {k: v[:LAYER_ROWS] for k, v in batch.items()}
        rows = _rows(spec, shape.prompt + shape.response)  # the bare pass: the same shape, half of each row scored
        loss = partial(policy_loss_func, loss_cfg)
        calls = {"bare": lambda: _log_prob_loss(actor.chunks[0], rows).backward(),
                 "step1": partial(actor.train_step, one, LAYER_ROWS, loss),
                 "step2": partial(actor.train_step, batch, LAYER_ROWS, loss),
                 "optimizer": actor.optimizer_step}
        times: dict[str, list[float]] = {k: [] for k in calls}
        dist.barrier()
        # a difference of three timings tens of milliseconds long: four times the repeats
        for rep in range(4 * repeats + 2):  # two warm-ups
            for key, call in calls.items():
                start = time.perf_counter()
                call()
                if rep >= 2:
                    times[key].append(time.perf_counter() - start)
        params = sum(p.numel() for chunk in actor.chunks for p in chunk.parameters())
        reps = list(zip(times["bare"], times["step1"], times["step2"]))
        out.append({"params": params, "ranks": dist.get_world_size(), "layers": layers,
                    "micro_batch_s": statistics.median(two - one - bare for bare, one, two in reps),
                    "fixed_s": statistics.median(2 * one - two for _, one, two in reps),
                    "optimizer_s": statistics.median(times["optimizer"])})
    return out


def probe_rank(rank: int, repeats: int) -> dict:
    import torch.distributed as dist

    spec = load_model_spec(MODEL)
    collectives = _collectives(repeats) if dist.get_world_size() > 1 else []
    models = _build_models(spec)
    _parameter_gather(models[max(LAYER_DEPTHS)])
    dist.barrier()
    layers = _layer_times(spec, models, repeats)
    dist.barrier()
    steps = _train_steps(spec, repeats)
    parallel = _parallel_layers(spec, repeats) if dist.get_world_size() % 2 == 0 else {}
    return {"collectives": collectives, "parallel": parallel, "layers": layers, "steps": steps,
            "copy_bytes_s": _copy_rate(repeats)}


# --- fits ----------------------------------------------------------------------------------------------


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    solution = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                                  torch.tensor(ys, dtype=torch.float64)[:, None]).solution
    return solution[:, 0].tolist()


def fit_collectives(points: list[dict]) -> dict[str, float]:
    """t = latency + bytes / rate over the points given (seconds, bytes/s)."""
    latency, inverse = _lstsq([[1.0, p["through_bytes"]] for p in points], [p["s"] for p in points])
    return {"latency_s": latency, "bytes_s": 1 / inverse if inverse > 0 else float("inf")}


def fit_layer(points: list[dict]) -> dict[str, float]:
    """One rate for forward and backward (backward = 2x the forward's FLOPs) and a fixed cost each."""
    rows = [[1.0, 0.0, p["flops"]] for p in points] + [[0.0, 1.0, 2 * p["flops"]] for p in points]
    fixed_fwd, fixed_bwd, inverse = _lstsq(rows, [p["fwd_s"] for p in points] + [p["bwd_s"] for p in points])
    if inverse <= 0:
        raise SystemExit("error: the layer's time does not grow with its FLOPs in this probe (a busy machine?); "
                         "run it again, with more --repeats")
    rate = 1 / inverse
    # the rest of the model: its fixed cost beyond the output layer's FLOPs at the layer's rate
    rest_fwd = statistics.median(p["rest_fwd_s"] - p["logits_flops"] / rate for p in points)
    rest_bwd = statistics.median(p["rest_bwd_s"] - 2 * p["logits_flops"] / rate for p in points)
    return {"fixed_fwd_s": fixed_fwd, "fixed_bwd_s": fixed_bwd, "flops_s": rate, "rest_fwd_s": rest_fwd,
            "rest_bwd_s": rest_bwd}


def fit_parallel_layer(points: list[dict], layer: dict[str, float]) -> dict[str, float]:
    """Seconds a decoder layer under one of ``PARALLEL_LAYERS`` takes beyond what the planner counts
    for it at the layer fit (``step_time.micro_batch``: its FLOPs over TP at the rate, and the
    layer's fixed cost as the sheet writes it, at least 0), forward and backward; medians over the
    ranks."""
    seconds = points[0]["flops"] / points[0]["parallel"].get("tp", 1) / layer["flops_s"]
    return {"fwd_s": statistics.median(p["fwd_s"] for p in points) - max(0.0, layer["fixed_fwd_s"]) - seconds,
            "bwd_s": statistics.median(p["bwd_s"] for p in points) - max(0.0, layer["fixed_bwd_s"]) - 2 * seconds}


def fit_train_step(points: list[dict], copy_bytes_s: float, collectives: dict[str, float] | None) -> dict[str, float]:
    """What the actor's train step takes beyond the bare passes of its micro-batches (seconds):
    per micro-batch (megatron's schedule, the policy loss beyond the log-probs: a second micro-batch
    less its bare pass); per decoder layer and step (the optimizer step's work tensor by tensor:
    megatron's Adam and gradient norm on CPU loop over the parameters; the 2-layer model's optimizer
    step less the 1-layer one's, at the probe's DP, taken for any: a DP2 rank's came out at 2.4-6.7 ms
    a layer here against a DP1 rank's 3.6-4.3, no steady saving from the smaller shard); and per step
    (the count and metric all-reduces, the clip, Python: the one-micro-batch step less its
    micro-batch, its layers' share, its shard's Adam bytes at the copy rate and its gradient
    reduce-scatter and parameter all-gather, fp32, at the probe's back-to-back gloo fit, which the
    planner counts as terms of their own); medians over the points."""
    from megatron_bridge.plan.collectives import ring_bytes
    from megatron_bridge.plan.step_time import ADAM_BYTES

    def optimizer(layers: int) -> float:
        return statistics.median(p["optimizer_s"] for p in points if p["layers"] == layers)

    per_layer = optimizer(2) - optimizer(1)

    def fixed(p: dict) -> float:
        n = p["ranks"]
        sync = 2 * (collectives["latency_s"] + ring_bytes(p["params"] * 4, n) / collectives["bytes_s"]) if n > 1 else 0.0
        return p["fixed_s"] - p["params"] / n * ADAM_BYTES / copy_bytes_s - sync - p["layers"] * per_layer

    return {"micro_batch_s": statistics.median(p["micro_batch_s"] for p in points),
            "layer_s": per_layer, "step_s": statistics.median(map(fixed, points))}


def summarise_probe(ranks: list[dict]) -> dict[str, Any]:
    """Every rank's points (medians per rank), the fits over all of them."""
    collectives = [p for r in ranks for p in r["collectives"]]
    layers = [p for r in ranks for p in r["layers"]]
    out: dict[str, Any] = {"layer": fit_layer(layers), "layer_points": layers, "collective_points": collectives,
                           "copy_bytes_s": statistics.median(r["copy_bytes_s"] for r in ranks),
                           "step_points": [p for r in ranks for p in r["steps"]]}
    if collectives:
        out["collectives"] = fit_collectives(collectives)
        out["by_op"] = {op: fit_collectives([p for p in collectives if p["op"] == op])
                        for op in sorted({p["op"] for p in collectives})}
        parallel = [r["parallel"] for r in ranks if r.get("parallel")]
        if parallel:
            out["in_layer_call_s"] = statistics.median(r["tp"]["call_s"] for r in parallel)
            out["parallel_layers"] = {name: fit_parallel_layer([r[name] for r in parallel], out["layer"])
                                      for name in PARALLEL_LAYERS}
    out["train_step"] = fit_train_step(out["step_points"], out["copy_bytes_s"], out.get("collectives"))
    return out


def sheet(ranks: int, threads: int, fit: dict[str, Any], links: dict[str, Any], command: str, when: str) -> str:
    """A hardware sheet of the probe's figures (configs/hardware/*.yaml's format)."""
    layer, step, col = fit["layer"], fit["train_step"], links["collectives"]
    where = (f"python {SCRIPT} probe on {when}: {ranks} gloo rank(s) at once, {threads} intra-op thread(s) each, "
             f"on {cpu_cores()} cores")
    own = ranks > 1
    link_source = (f"{where}; gloo all_gather_into_tensor + all_to_all_single, 1 KiB-1 MiB per rank, fitted to "
                   "t = latency + bytes through a rank / rate" if own else
                   f"the {links['ranks']}-rank probe's gloo fit ({links['when']}); one rank has no peers")

    def figure(value: float, source: str) -> dict:
        return {"value": float(f"{value:.4g}"), "kind": "measured", "by": "probe", "source": source}

    # A call as a decoder layer issues it, between its own compute: it includes waiting for a peer
    # held up by its compute or by the scheduler, which back-to-back calls never do. Per ring step
    # (step_time.launch_seconds counts a group's n - 1): the layer's TP pairs are one. Ranks that
    # share the cores, at least two a core, leave their core to another rank while a pipeline stage
    # waits: no bubble.
    shared = ranks * threads >= 2 * cpu_cores()
    if "in_layer_call_s" in links:
        latency_s = links["in_layer_call_s"]
        latency_words = (f"seconds per gloo call in the forward and backward of {LAYER_DEPTHS[0]}- and "
                         f"{LAYER_DEPTHS[1]}-layer models at TP2 with sequence parallel, every call timed "
                         f"({links['ranks']} ranks, TP pairs: one ring step a call; back to back the fit's "
                         f"intercept is {col['latency_s'] * 1e6:.0f} us a call over all of them)"
                         f"{'' if own else ' (2-rank probe)'}")
    else:  # an odd number of ranks has no TP pairs: the back-to-back figure, per ring step
        latency_s = col["latency_s"] / (links["ranks"] - 1)
        latency_words = f"the back-to-back fit's intercept over {links['ranks']} ranks, per ring step"

    data = {
        "device": "cpu",
        "bf16_tflops": figure(layer["flops_s"] / 1e12,
                              f"{where}; fp32 (the CPU actor's dtype, not bf16): the tiny Qwen3-MoE's decoder layer "
                              f"({LAYER_DEPTHS[1]}-layer minus {LAYER_DEPTHS[0]}-layer megatron model) forward and "
                              f"backward at {LAYER_ROWS} rows of "
                              f"{', '.join(map(str, LAYER_TOKENS))} tokens, FLOPs of megatron_bridge.plan.flops over "
                              "seconds beyond the fixed cost (overheads); an achieved rate: the MFU does not apply"),
        "hbm_gb_s": figure(fit["copy_bytes_s"] / GB, f"{where}; Tensor.copy_ of 32 MiB fp32, bytes read + written"),
        "intra_node_gb_s": figure(col["bytes_s"] / GB, link_source),
        "inter_node_gb_s": figure(col["bytes_s"] / GB, "one node: the same figure as intra_node_gb_s"),
        "overheads": {
            "collective_latency_us": float(f"{latency_s * 1e6:.4g}"),
            "layer_forward_us": float(f"{max(0.0, layer['fixed_fwd_s']) * 1e6:.4g}"),
            "layer_backward_us": float(f"{max(0.0, layer['fixed_bwd_s']) * 1e6:.4g}"),
            "micro_batch_forward_us": float(f"{max(0.0, layer['rest_fwd_s']) * 1e6:.4g}"),
            # a training micro-batch's: the rest of the model's backward and the actor's schedule and loss
            "micro_batch_backward_us": float(f"{max(0.0, layer['rest_bwd_s'] + step['micro_batch_s']) * 1e6:.4g}"),
            **{f"{name}_layer_{direction}_us": float(f"{max(0.0, extra[key]) * 1e6:.4g}")
               for name, extra in fit.get("parallel_layers", {}).items()
               for direction, key in (("forward", "fwd_s"), ("backward", "bwd_s"))},
            "optimizer_step_us": float(f"{max(0.0, step['step_s']) * 1e6:.4g}"),
            "optimizer_layer_us": float(f"{max(0.0, step['layer_s']) * 1e6:.4g}"),
            "ranks_share_cores": shared,
            "by": "probe",
            "source": f"{where}; latency: {latency_words}; layer: the "
                      "fixed cost per micro-batch of the decoder layer fit; tp_layer, ep_layer (where the ranks "
                      "pair up): "
                      f"a layer at TP2 with sequence parallel, at EP2, ({LAYER_DEPTHS[1]}-layer less "
                      f"{LAYER_DEPTHS[0]}-layer model at {LAYER_ROWS} rows of {PARALLEL_LAYER_TOKENS} tokens, "
                      "its collectives' seconds left out) less its FLOPs over TP at the rate and the layer's "
                      "fixed cost; micro_batch: the "
                      f"{LAYER_DEPTHS[0]}-layer model with the log-probs less its layers, less the output layer's "
                      "FLOPs at the layer's rate (median "
                      "over the lengths), the backward's plus what the actor's train step adds per micro-batch "
                      "(megatron's schedule, the policy loss: a 2-micro-batch step less a 1-micro-batch one less "
                      "a bare forward and backward, the median of each repetition's difference); "
                      "optimizer_layer: a decoder layer's share of the optimizer step (the 2-layer "
                      "model's optimizer step less the 1-layer one's, median); "
                      "optimizer_step: what the actor's train step adds per step "
                      "over the 1- and 2-layer models (the 1-micro-batch step less that micro-batch, its layers' "
                      "optimizer share, its Adam "
                      "bytes at hbm_gb_s, its fp32 gradient reduce-scatter and parameter all-gather at the "
                      "back-to-back gloo fit; median)",
        },
    }
    header = (f"# Rates of this machine's CPU gloo ranks ({ranks} x {threads}), MEASURED by:\n#   {command}\n"
              "# They hold for this machine and this many ranks and threads only; docs/bench_plan.md compares\n"
              "# the planner's predictions at them with bench/actor_throughput.py.\n")
    return header + yaml.safe_dump(data, sort_keys=False, width=200)


def _probe_round(args: argparse.Namespace, round_: int, measured: dict[tuple[int, int], list[dict]]) -> None:
    """Every configuration once, in turn: its ranks' points added to ``measured``."""
    for ranks, threads in args.configs:
        tag = f"[round {round_}/{args.rounds}] [{ranks} x {threads}]"
        print(f"{tag} probing ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        measured[ranks, threads] += run_ranks(probe_rank, ranks, threads, args.repeats)
        print(f"{tag} {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def _write_probe(args: argparse.Namespace, command: str, measured: dict[tuple[int, int], list[dict]], when: str,
                 load_before: float) -> None:
    """The fits over every round's and every rank's points: the sheets, and the probe's block of ``--out``."""
    fits = {}
    for (ranks, threads), points in measured.items():
        fits[ranks, threads] = summarise_probe(points) | {"when": when, "ranks": ranks}
        print(f"[{ranks} x {threads}] {describe_fit(fits[ranks, threads])}", file=sys.stderr, flush=True)
    with_links = [k for k in fits if "collectives" in fits[k]]  # parse_args asks for one at least
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for (ranks, threads), fit in fits.items():
        links = fit if "collectives" in fit else fits[min(with_links)]
        path = args.out_dir / f"{sheet_name(ranks, threads)}.yaml"
        path.write_text(sheet(ranks, threads, fit, links, command, when))
        print(f"wrote {path}", file=sys.stderr)
    body = "\n".join([
        f"Command: `{command}`",
        "",
        *machine_facts("per configuration, RANKS x THREADS: that many gloo ranks at once, each with "
                       "torch.set_num_threads(THREADS)", load_before),
        f"- written: {', '.join(f'`{_shown(args.out_dir / sheet_name(*k))}.yaml`' for k in fits)} ({when})",
        f"- {args.rounds} rounds of every configuration in turn"
        + (" (each round followed by that round of the comparison)" if args.command == "calibrate" else "")
        + f"; in each, medians of {args.repeats} repeats after 2 "
        f"warm-ups per point (the layers: means of {LAYER_REPEATS * args.repeats}; the train steps: medians of "
        f"{4 * args.repeats}), each rank's own; the fits over every round's and every rank's points",
        "",
        probe_table(fits),
    ])
    publish(body, args.out, SCRIPT, TITLE, PROBE_BLOCK)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def probe_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    command, when, load_before = command_line(SCRIPT, argv), _now(), load_before_run()
    # every configuration once a round, in turn, so that the machine's drift over the probe (its
    # copy rate moved between 3.9 and 9.8 GB/s from one probe to the next) falls on each of them alike
    measured: dict[tuple[int, int], list[dict]] = {config: [] for config in args.configs}
    for round_ in range(1, args.rounds + 1):
        _probe_round(args, round_, measured)
    _write_probe(args, command, measured, when, load_before)
    return 0


def describe_fit(fit: dict) -> str:
    layer = fit["layer"]
    words = (f"layer {layer['flops_s'] / 1e9:.2f} GFLOP/s + {layer['fixed_fwd_s'] * 1e3:.2f} ms fwd / "
             f"{layer['fixed_bwd_s'] * 1e3:.2f} ms bwd fixed; rest of the model {layer['rest_fwd_s'] * 1e3:.2f} / "
             f"{layer['rest_bwd_s'] * 1e3:.2f} ms; the train step adds {fit['train_step']['micro_batch_s'] * 1e3:.2f} ms "
             f"a micro-batch, {fit['train_step']['step_s'] * 1e3:.2f} ms a step and "
             f"{fit['train_step']['layer_s'] * 1e3:.2f} ms a layer a step; "
             f"copy {fit['copy_bytes_s'] / GB:.1f} GB/s")
    if "collectives" in fit:
        c = fit["collectives"]
        words += (f"; gloo {_op_fit(c)} back to back, "
                  f"{fit.get('in_layer_call_s', float('nan')) * 1e6:.0f} us a call in a TP2 layer")
    for name, extra in fit.get("parallel_layers", {}).items():
        words += f"; a layer under {name.upper()}2 adds {extra['fwd_s'] * 1e3:.2f} / {extra['bwd_s'] * 1e3:.2f} ms"
    return words


def _op_fit(fit: dict[str, float]) -> str:
    if fit["bytes_s"] == float("inf"):  # the noise outweighed the bytes: the time did not grow with them
        return f"{fit['latency_s'] * 1e6:,.0f} us, no growth with the bytes"
    return f"{fit['latency_s'] * 1e6:,.0f} us + bytes / {fit['bytes_s'] / GB:.2f} GB/s"


def probe_table(fits: dict) -> str:
    lines = ["| ranks x threads | layer rate (GFLOP/s) | layer fixed fwd (ms) | layer fixed bwd (ms) | "
             "rest of the model fwd (ms) | rest bwd (ms) | train step per micro-batch (ms) | train step fixed (ms) | "
             "optimizer step per layer (ms) | "
             "a layer adds at TP2 fwd / bwd (ms) | at EP2 (ms) | gloo call in a TP2 layer "
             "(us) | gloo latency back to back (us) | gloo rate (GB/s) | all-gather fit | all-to-all fit | copy (GB/s) |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|--:|"]
    for (ranks, threads), fit in sorted(fits.items()):
        layer = fit["layer"]
        extras = fit.get("parallel_layers", {})
        cells = [f"{extras[name]['fwd_s'] * 1e3:.2f} / {extras[name]['bwd_s'] * 1e3:.2f}" if name in extras else "—"
                 for name in PARALLEL_LAYERS]
        if "collectives" in fit:
            c, by_op = fit["collectives"], fit["by_op"]
            cells += [f"{fit.get('in_layer_call_s', float('nan')) * 1e6:,.0f}", f"{c['latency_s'] * 1e6:,.0f}",
                     f"{c['bytes_s'] / GB:.2f}"] + [
                _op_fit(by_op[op]) if op in by_op else "—" for op in ("all_gather", "all_to_all")]
        else:
            cells += ["—"] * 5
        lines.append(f"| {ranks} x {threads} | {layer['flops_s'] / 1e9:.2f} | {layer['fixed_fwd_s'] * 1e3:.2f} | "
                     f"{layer['fixed_bwd_s'] * 1e3:.2f} | {layer['rest_fwd_s'] * 1e3:.2f} | "
                     f"{layer['rest_bwd_s'] * 1e3:.2f} | {fit['train_step']['micro_batch_s'] * 1e3:.2f} | "
                     f"{fit['train_step']['step_s'] * 1e3:.2f} | {fit['train_step']['layer_s'] * 1e3:.2f} | "
                     + " | ".join(cells)
                     + f" | {fit['copy_bytes_s'] / GB:.1f} |")
    return "\n".join(lines)


# --- compare ----------------------------------------------------------------------------------------------


def predicted(spec: ModelSpec, name: str, seq_len: int, response: int, rows: int, micro_batch: int,
              sheet_path: Path) -> dict:
    """The planner's train step (one optimizer step over ``rows`` sequences computed at ``seq_len``
    tokens, ``response`` of them response: what the log-probs score) and log-prob pass for bench
    layout ``name`` at the sheet's rates."""
    from bench.actor_throughput import LAYOUTS
    from megatron_bridge.plan import step_time
    from megatron_bridge.plan.hardware import Assumptions, Rates, load_hardware
    from megatron_bridge.plan.layout import Cluster, Layout

    bench = LAYOUTS[name]
    layout = Layout(name, train=bench.train, cluster=Cluster(nnodes=1, devices_per_node=bench.ranks, device="cpu"))
    assume = Assumptions()  # the MFU leaves the sheet's measured compute rate alone
    rates = Rates.of(load_hardware(str(sheet_path)), assume)
    # the padding counts with the prompt: the model computes every row at seq_len
    w = step_time.Workload(seq_len=seq_len, prompt_len=seq_len - response, response_len=response, global_batch=rows,
                           mini_batch=rows, micro_batch_size=micro_batch)
    return {"train": step_time.optimizer_step(spec, layout, w, rates, assume),
            "log_prob": step_time.log_prob_pass(spec, layout, w, rates)}


def sheet_for(name: str, out_dir: Path, threads: int | None) -> Path:
    from bench.actor_throughput import LAYOUTS

    bench = LAYOUTS[name]
    return out_dir / f"{sheet_name(bench.ranks, threads or bench.threads or max(1, cpu_cores() // bench.ranks))}.yaml"


def order(values: dict[str, float]) -> list[str]:
    return sorted(values, key=values.get)


def told_apart(rounds: dict[str, list[float]]) -> list[tuple[str, str]]:
    """The pairs (faster, slower) of layouts that the measurement tells apart: every round of one
    faster than every round of the other. Closer pairs trade places between runs of the same
    command, so no model can be held to their order."""
    return [(a, b) for a in rounds for b in rounds if max(rounds[a]) < min(rounds[b])]


SHOWN_TERMS = (("compute", "compute"), ("tensor_parallel", "TP"), ("expert_all_to_all", "EP"),
               ("pipeline_bubble", "bubble"), ("pipeline_p2p", "p2p"), ("gradient_sync", "grad RS"),
               ("parameter_gather", "param AG"), ("optimizer", "optimizer"))


def compare_table(rows: list[dict]) -> str:
    lines = ["| layout | ranks x threads | sheet | predicted train step s | measured train step s | rounds s | error | "
             + " | ".join(f"predicted {label} s" for _, label in SHOWN_TERMS)
             + " | predicted log-prob s | measured log-prob s | error |",
             "|---|---|---|--:|--:|--:|--:|" + "--:|" * len(SHOWN_TERMS) + "--:|--:|--:|"]
    for r in rows:
        terms = " | ".join(f"{r['train_terms'][k]:.3f}" for k, _ in SHOWN_TERMS)
        lines.append(f"| {r['layout']} | {r['ranks']} x {r['threads']} | {r['sheet']} | {r['predicted_train']:.3f} | "
                     f"{r['measured_train']:.3f} | {min(r['train_rounds']):.3f}-{max(r['train_rounds']):.3f} | "
                     f"{r['train_error']:+.0%} | {terms} | {r['predicted_log_prob']:.3f} | "
                     f"{r['measured_log_prob']:.3f} | {r['log_prob_error']:+.0%} |")
    return "\n".join(lines)


def _compare_round(args: argparse.Namespace, round_: int, checkpoint: str, shape,
                   results: dict[str, list[dict]]) -> None:
    """Every layout once, in turn: its measured steps added to ``results``."""
    from bench.actor_throughput import describe_layout, run_layout

    for name in args.layouts:
        print(f"[round {round_}/{args.rounds}] [{name}] {describe_layout(name)} ...", file=sys.stderr, flush=True)
        results[name].append(run_layout(name, checkpoint, shape, None, args.steps, args.threads, None, "cpu", "fp32"))


def _compared(args: argparse.Namespace, results: dict[str, list[dict]], shape, spec: ModelSpec,
              response: int) -> list[dict]:
    """Each layout's measured rounds beside the planner's prediction from its sheet in ``args.sheets``."""
    rows = []
    for name, runs in results.items():
        seq_len = runs[0]["computed_tokens"] // shape.rows  # every row padded to the longest (x TP)
        path = sheet_for(name, args.sheets, args.threads)
        p = predicted(spec, name, seq_len, response, shape.rows, shape.micro_batch, path)
        train, log_prob = sum(p["train"].values()), sum(p["log_prob"].values())
        measured_train = statistics.median(r["train_s"] for r in runs)
        measured_log_prob = statistics.median(r["log_prob_s"] for r in runs)
        rows.append({"layout": name, "ranks": runs[0]["ranks"], "threads": runs[0]["threads"],
                     "sheet": path.name, "seq_len": seq_len,
                     "predicted_train": train, "measured_train": measured_train,
                     "train_rounds": [r["train_s"] for r in runs],
                     "train_error": train / measured_train - 1, "train_terms": p["train"],
                     "predicted_log_prob": log_prob, "measured_log_prob": measured_log_prob,
                     "log_prob_error": log_prob / measured_log_prob - 1})
        print(f"[{name}] train step predicted {train:.3f} s, measured {measured_train:.3f} s "
              f"({rows[-1]['train_error']:+.0%})", file=sys.stderr, flush=True)
    return rows


def _measure(args: argparse.Namespace, probed: dict[tuple[int, int], list[dict]] | None = None):
    """Every layout once a round, so that the machine's drift over the run falls on all of them alike;
    with ``probed``, each round after a probe round into it. (measured steps by layout, batch shape,
    model spec, mean response length)"""
    from bench.actor_throughput import BatchShape, make_batch

    shape = BatchShape()
    spec = load_model_spec(MODEL)
    response = round(float(make_batch(shape, spec.vocab_size)["response_mask"].sum()) / shape.rows)  # mean
    results: dict[str, list[dict]] = {name: [] for name in args.layouts}
    with tempfile.TemporaryDirectory(prefix="plan_calibrate_") as tmp:
        checkpoint = save_model(tmp, "tiny")
        for round_ in range(1, args.rounds + 1):
            if probed is not None:
                _probe_round(args, round_, probed)
            _compare_round(args, round_, checkpoint, shape, results)
    return results, shape, spec, response


def compare_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    missing = [str(sheet_for(n, args.sheets, args.threads)) for n in args.layouts
               if not sheet_for(n, args.sheets, args.threads).exists()]
    if missing:
        raise SystemExit(f"error: no sheet {', '.join(sorted(set(missing)))}; run `python {SCRIPT} probe` first")
    command, load_before = command_line(SCRIPT, argv), load_before_run()
    results, shape, spec, response = _measure(args)
    rows = _compared(args, results, shape, spec, response)
    publish(compare_report(rows, command, shape, response, args, load_before), args.out, SCRIPT, TITLE)
    return 0


def calibrate_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The probe's rounds and the comparison's in turn (a probe round, then a comparison round): the
    rates and the steps they predict measured over the same stretch of the machine's drift."""
    command, when, load_before = command_line(SCRIPT, argv), _now(), load_before_run()
    probed: dict[tuple[int, int], list[dict]] = {config: [] for config in args.configs}
    results, shape, spec, response = _measure(args, probed)
    _write_probe(args, command, probed, when, load_before)  # the sheets first: the predictions read them
    rows = _compared(args, results, shape, spec, response)
    publish(compare_report(rows, command, shape, response, args, load_before), args.out, SCRIPT, TITLE)
    return 0


def compare_report(rows: list[dict], command: str, shape, response: int, args: argparse.Namespace,
                   load_before: float) -> str:
    predicted_s = {r["layout"]: r["predicted_train"] for r in rows}
    pred, meas = order(predicted_s), order({r["layout"]: r["measured_train"] for r in rows})
    worst = max(rows, key=lambda r: abs(r["train_error"]))
    within = sum(abs(r["train_error"]) <= 0.30 for r in rows)
    apart = told_apart({r["layout"]: r["train_rounds"] for r in rows})
    swapped = [(a, b) for a, b in apart if predicted_s[a] >= predicted_s[b]]
    close = [(a, b) for i, a in enumerate(meas) for b in meas[i + 1:] if (a, b) not in apart]
    return "\n".join([
        f"Command: `{command}`",
        "",
        *machine_facts("bench/actor_throughput.py's: max(1, cores // ranks) per rank (single-1t: 1)", load_before),
        f"- batch (bench/actor_throughput.py's default): {shape.describe()}; micro-batches of {shape.micro_batch} "
        f"rows, every row padded to the longest ({rows[0]['seq_len']} tokens, {response} of them response on "
        f"average); one optimizer step per train step; median of {args.steps} steps after 1 warm-up, in each of "
        f"{args.rounds} rounds of every layout in turn; measured: the median of the rounds",
        f"- predicted: `megatron_bridge.plan.step_time.optimizer_step` (train step) and `log_prob_pass`, the tiny "
        f"Qwen3-MoE, the layout on one node of its ranks, micro-batches of {shape.micro_batch} sequences at the padded "
        f"length, at the sheet of the layout's ranks x threads ({_shown(args.sheets)}/, "
        + ("written by this run's probe, its rounds taken in turn with these)" if args.command == "calibrate"
           else "written by the probe before this run)"),
        "",
        compare_table(rows),
        "",
        f"- train step within 30 %: {within} of {len(rows)} layouts; largest error {worst['train_error']:+.0%} "
        f"({worst['layout']})",
        f"- order by predicted train step (fastest first): {', '.join(pred)}",
        f"- order by measured train step (fastest first): {', '.join(meas)}",
        f"- the same order: {'yes' if pred == meas else 'no'}",
        f"- pairs of layouts the rounds tell apart (every round of one faster than every round of the other): "
        f"{len(apart)} of {len(rows) * (len(rows) - 1) // 2}; in the predicted order: {len(apart) - len(swapped)} of "
        f"{len(apart)}" + (f" (not: {', '.join(f'{a} < {b}' for a, b in swapped)})" if swapped else ""),
        f"- pairs whose rounds overlap (their order changes between runs): "
        f"{', '.join(f'{a} / {b}' for a, b in close) or 'none'}",
    ])


# --- command line -------------------------------------------------------------------------------------------


def _config(text: str) -> tuple[int, int]:
    ranks, sep, threads = text.partition("x")
    try:
        value = (int(ranks), int(threads))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RANKSxTHREADS, e.g. 2x1")
    if not sep or min(value) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RANKSxTHREADS, both >= 1")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.actor_throughput import LAYOUTS, TABLE_LAYOUTS

    p = argparse.ArgumentParser(prog=f"python {SCRIPT}", description=__doc__.split("\n\n``probe``")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    probe = sub.add_parser("probe", help="measure this machine's rates; write hardware sheets")
    cmp = sub.add_parser("compare",
                         help="predicted against measured train step for bench/actor_throughput.py's layouts")
    both = sub.add_parser("calibrate", help="probe and compare, their rounds in turn (a probe round, then a "
                                            "comparison round): both over the same stretch of the machine's drift")
    for q in (probe, both):
        q.add_argument("--configs", nargs="+", type=_config, default=None, metavar="RANKSxTHREADS",
                       help="ranks at once x intra-op threads each (default: every one bench/actor_throughput.py "
                            "runs here, e.g. 1x1 1x2 2x1 4x1 on 2 cores)")
        q.add_argument("--repeats", type=int, default=3,
                       help="timed repeats per point and round, after 2 warm-ups (default 3)")
        q.add_argument("--out-dir", type=Path, default=SHEETS, help=f"where the sheets go (default {_shown(SHEETS)})")
    for q in (cmp, both):
        q.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(TABLE_LAYOUTS), metavar="LAYOUT",
                       help=f"layouts (default: bench/actor_throughput.py's table: {', '.join(TABLE_LAYOUTS)})")
        q.add_argument("--steps", type=int, default=5, help="measured steps per layout, after one warm-up (default 5)")
        q.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (default: the bench's)")
    cmp.add_argument("--sheets", type=Path, default=SHEETS, help="the probe's sheets (default bench/calibration)")
    for q, what in ((probe, "configuration"), (cmp, "layout"), (both, "configuration and layout")):
        q.add_argument("--rounds", type=int, default=3,
                       help=f"times every {what} is measured, in turn each round (default 3)")
    probe.add_argument("--out", type=Path, default=None,
                       help=f"markdown file whose generated block '{PROBE_BLOCK}' to (re)write, e.g. "
                            "docs/bench_plan.md")
    cmp.add_argument("--out", type=Path, default=None, help="markdown file whose generated block to (re)write")
    both.add_argument("--out", type=Path, default=None,
                      help=f"markdown file whose generated blocks (the comparison's and '{PROBE_BLOCK}') to (re)write")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.command in ("probe", "calibrate"):
        args.configs = args.configs or bench_configs()
        if args.repeats < 1:
            p.error("--repeats must be >= 1")
        if all(ranks < 2 for ranks, _ in args.configs):
            p.error("--configs has no configuration of 2 or more ranks: no collective rates to write; add one, e.g. 2x1")
        args.out_dir = args.out_dir.resolve()
        check_out(p, args.out, SCRIPT, PROBE_BLOCK)
    if args.command in ("compare", "calibrate"):
        if args.steps < 1:
            p.error("--steps must be >= 1")
        args.sheets = args.out_dir if args.command == "calibrate" else args.sheets.resolve()
        check_out(p, args.out, SCRIPT)
    if args.command == "calibrate":  # refused now, not after the rounds: every layout's sheet is probed
        probed = {f"{sheet_name(*c)}.yaml" for c in args.configs}
        unprobed = sorted({sheet_for(n, args.sheets, args.threads).name for n in args.layouts} - probed)
        if unprobed:
            p.error(f"--configs probes no {', '.join(unprobed)}, which --layouts need; add their RANKSxTHREADS")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return {"probe": probe_main, "compare": compare_main, "calibrate": calibrate_main}[args.command](args, argv)


if __name__ == "__main__":
    sys.exit(main())

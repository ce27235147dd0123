#!/usr/bin/env python
"""Throughput of the rollout weight stream (megatron_bridge.weights.export) on CPU gloo ranks.

    python bench/reshard_throughput.py                                # every layout, print tables
    python bench/reshard_throughput.py --layouts ep2 --buckets 256 --repeats 2
    python bench/reshard_throughput.py --out docs/bench_reshard.md    # also write the doc

A mid-size Qwen3-MoE (8 layers, 64 experts top-8, hidden 1024, expert ffn 384, 16 heads / 4 KV
heads of 64, vocab 32768: 0.70 B parameters, 1.40 GB in bf16, experts 87% of it) is built in bf16
with megatron-core on 2 gloo ranks, in each training layout. Each rank then streams the weights its
rollout rank needs into preallocated destination tensors (what an engine's ``load_weights`` does),
for each bucket size and two routings:

- ``ep-aware``: rollout EP2, each rank receives the dense tensors and its 32 experts;
- ``all``: rollout without EP, every rank receives every tensor.

Against two references, measured in the same processes:

- memcpy bound: the time to copy the delivered bytes once at this machine's memcpy bandwidth
  (both ranks copying at once, as in the sync) -- every delivered byte must be written once;
- baseline: every full tensor gathered to rank 0 first, one tensor at a time, then broadcast to
  every rank (what a sync without a plan does; always ``all`` routing).

Reported per rank: wall seconds of the sync (between barriers, median of ``--repeats``), bytes
delivered, GB/s, fraction of the memcpy bound, and peak extra resident memory during the sync
(sampled from /proc every 2 ms, above the level with the model and destinations allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on sys.path, the packages are not
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import MID_SIZE, check_out, command_line, cpu_cores, machine_facts, publish, run_ranks  # noqa: E402
from megatron_bridge.plan.layout import TrainParallel  # noqa: E402

SCRIPT = "bench/reshard_throughput.py"
LAYOUTS = {
    "ep2": TrainParallel(ep=2, etp=1),  # experts 0-31 on rank 0, 32-63 on rank 1; dense replicated
    "tp2": TrainParallel(tp=2, sequence_parallel=True),  # every tensor but the norms split in two (ETP2)
}
ROUTINGS = {"ep-aware": 2, "all": 1}  # rollout expert-parallel size
RANKS = 2


class PeakRSS:
    """Peak resident memory of this process while the block runs, sampled every 2 ms."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra_mib(self) -> float:
        return (self.peak - self.base) / 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memcpy_gbps(dist, nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """This rank's copy bandwidth while every rank copies at once."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return nbytes / min(times) / 1e9


def baseline_stream(exporter, dist):
    """Every full tensor gathered to rank 0 (one message per piece), then broadcast to all ranks."""
    from megatron_bridge.weights.export import _LocalPieces

    local = _LocalPieces(exporter.chunks, exporter.spec)
    rank = dist.get_rank()
    for name in exporter.names:
        full = torch.empty(exporter.shapes[name], dtype=exporter.dtype)
        requests = []
        for piece in exporter.pieces[name]:
            holder = min(exporter.holders[piece])
            if rank == 0 and holder == 0:
                piece.of(full).copy_(local[piece])
            elif rank == 0:
                part = torch.empty(exporter._piece_shape(piece), dtype=exporter.dtype)
                requests.append((dist.irecv(part, holder), piece, part))
            elif rank == holder:
                dist.send(local[piece].to(exporter.dtype).contiguous(), 0)
        for request, piece, part in requests:
            request.wait()
            piece.of(full).copy_(part)
        local.release()
        dist.broadcast(full, 0)
        yield name, full


def timed_sync(stream_fn, destinations: dict, dist, repeats: int) -> dict:
    times, peaks, delivered = [], [], 0
    for _ in range(repeats):
        dist.barrier()
        with PeakRSS() as rss:
            start = time.perf_counter()
            delivered = 0
            for name, tensor in stream_fn():
                destinations[name].copy_(tensor)
                delivered += tensor.numel() * tensor.element_size()
            dist.barrier()
            times.append(time.perf_counter() - start)
        peaks.append(rss.extra_mib)
    return {"seconds": statistics.median(times), "bytes": delivered, "peak_extra_mib": max(peaks)}


def measure(rank: int, layout: str, config_dir: str, buckets: list[float], repeats: int) -> list[dict]:
    import torch.distributed as dist

    from megatron_bridge.runtime.actor import initialize_parallel
    from megatron_bridge.weights.export import Routing, WeightExporter
    from megatron_bridge.runtime.model import BuildOptions, build_model_chunks
    from megatron_bridge.plan.model_spec import load_model_spec

    train = LAYOUTS[layout]
    initialize_parallel(train)
    spec = load_model_spec(config_dir)
    _, chunks = build_model_chunks(spec, train, BuildOptions(params_dtype=torch.bfloat16), "cpu")
    held = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    bandwidth = memcpy_gbps(dist)
    rows = []
    for routing_name, rollout_ep in ROUTINGS.items():
        routing = Routing(RANKS, spec.num_experts, rollout_ep)
        destinations = None
        for bucket_mb in buckets:
            exporter = WeightExporter(chunks, spec, routing, bucket_mb, torch.bfloat16)
            if destinations is None:  # allocated and touched before measuring, like an engine's weights
                wanted = [n for n in exporter.names if rank in routing.destinations(n)]
                destinations = {n: torch.zeros(exporter.shapes[n], dtype=torch.bfloat16) for n in wanted}
            result = timed_sync(exporter.stream, destinations, dist, repeats)
            result.update(case=routing_name, bucket_mb=bucket_mb, sent=exporter.stats.bytes_sent,
                          received=exporter.stats.bytes_received, zero_copy=_zero_copy(exporter, rank))
            rows.append(result)
        if routing_name == "all":
            result = timed_sync(lambda: baseline_stream(exporter, dist), destinations, dist, repeats)
            result.update(case="baseline (gather to rank 0, broadcast)", bucket_mb=None, sent=None, received=None,
                          zero_copy=None)
            rows.append(result)
        del destinations
    for row in rows:
        row.update(layout=layout, rank=rank, memcpy_gbps=bandwidth, held_bytes=held)
    return rows


def _zero_copy(exporter, rank) -> int:
    """Bytes yielded straight from this rank's shard (held whole, in the rollout dtype)."""
    from megatron_bridge.weights.export import Piece

    whole = [n for n in exporter.names if rank in exporter.routing.destinations(n)
             and rank in exporter.holders.get(Piece(n, None, None), [])]
    return sum(exporter._bytes(n) for n in whole)


def run_layout(layout: str, config_dir: str, buckets: list[float], repeats: int) -> list[dict]:
    ranks = run_ranks(measure, RANKS, max(1, cpu_cores() // RANKS), layout, config_dir, buckets, repeats)
    return [row for rows in ranks for row in rows]


def table(rows: list[dict]) -> str:
    lines = [
        "| layout | routing | bucket MB | rank | sync s | delivered GB | GB/s | memcpy GB/s | of memcpy bound "
        "| received GB | zero-copy GB | peak extra MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gbps = r["bytes"] / r["seconds"] / 1e9
        lines.append(
            f"| {r['layout']} | {r['case']} | {r['bucket_mb'] or '-'} | {r['rank']} | {r['seconds']:.3f} "
            f"| {r['bytes'] / 1e9:.3f} | {gbps:.2f} | {r['memcpy_gbps']:.2f} | {gbps / r['memcpy_gbps']:.0%} "
            f"| {_gb(r['received'])} | {_gb(r['zero_copy'])} | {r['peak_extra_mib']:.0f} |")
    return "\n".join(lines)


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.3f}"


def speedups(rows: list[dict]) -> str:
    """Slowest rank's sync time per case, against the baseline of the same layout."""
    lines = ["| layout | routing | bucket MB | sync s (slowest rank) | vs baseline |", "|---|---|---|---|---|"]
    by_case: dict[tuple, float] = {}
    for r in rows:
        key = (r["layout"], r["case"], r["bucket_mb"])
        by_case[key] = max(by_case.get(key, 0.0), r["seconds"])
    for (layout, case, bucket), seconds in by_case.items():
        base = by_case[(layout, "baseline (gather to rank 0, broadcast)", None)]
        lines.append(f"| {layout} | {case} | {bucket or '-'} | {seconds:.3f} | {base / seconds:.1f}x |")
    return "\n".join(lines)


def report(rows: list[dict], command: str, repeats: int, load_before: float) -> str:
    params = _param_bytes()
    return "\n".join([
        f"Command: `{command}`",
        "",
        *machine_facts(f"torch.set_num_threads(max(1, {cpu_cores()} cores // {RANKS} ranks)) per rank", load_before),
        f"- model: mid-size Qwen3-MoE (bench/common.py MID_SIZE), bf16, {params / 1e9:.2f} GB; "
        f"median of {repeats} syncs per case",
        "",
        table(rows),
        "",
        speedups(rows),
        "",
        "Paper estimate (computed by `paper_estimate()` from the shipped model and layout):",
        "",
        paper_estimate(),
    ])


def _param_bytes() -> int:
    from megatron_bridge.plan.model_spec import spec_from_hf_dict

    return 2 * spec_from_hf_dict(MID_SIZE, name="mid-size", source=SCRIPT).total_params


# Public bandwidths a sync of the 30B model is projected at (docs/bench_reshard.md names their sources).
BANDWIDTHS = {"HCCL effective, measured by verl on 2x16 910C": 5.3, "200 Gb/s RoCE per NPU": 25.0}


def paper_estimate(model: str = "qwen3_30b_a3b", layout_name: str = "qwen3_30b_a3b_2x16_a3") -> str:
    """Bytes each rank must receive per sync, and the time at public bandwidths, with and without
    EP-aware routing, for the shipped layout. The local part (zero-copy views and one copy into the
    engine) runs at HBM bandwidth on the NPU and is left out; the CPU numbers above show it costs
    about one memcpy of the delivered bytes."""
    from megatron_bridge.plan.layout import load_layout
    from megatron_bridge.plan.model_spec import load_model_spec

    spec, layout = load_model_spec(model), load_layout(layout_name)
    train, rollout = layout.train, layout.rollout
    experts = spec.num_layers * spec.num_experts * spec.expert_params * 2  # bf16 bytes
    dense = spec.total_params * 2 - experts
    held_dense = dense / (train.tp * train.pp)  # norms are replicated: negligible
    # Best case: a rollout rank's experts sit among the training rank's own experts in its PP stage.
    aware_need = dense + experts / rollout.ep
    aware_local = held_dense + experts / rollout.ep / train.pp
    all_need = dense + experts
    all_local = held_dense + experts / (train.ep * train.pp)
    rows = [
        f"Qwen3-30B-A3B ({spec.total_params / 1e9:.1f} B parameters, {(dense + experts) / 1e9:.1f} GB in bf16, "
        f"experts {experts / (dense + experts):.0%}) on `configs/parallel/{layout_name}.yaml`: train TP{train.tp} "
        f"PP{train.pp} EP{train.ep}, rollout TP{rollout.tp} DP{rollout.dp} EP{rollout.ep}, 32 ranks.",
        "",
        "| routing | needed per rank GB | held locally GB | received per rank GB | "
        + " | ".join(f"sync s at {bw} GB/s ({name})" for name, bw in BANDWIDTHS.items()) + " |",
        "|---|---|---|---|" + "---|" * len(BANDWIDTHS),
    ]
    for name, need, local in (("ep-aware", aware_need, aware_local), ("all", all_need, all_local)):
        received = need - local
        times = " | ".join(f"{received / 1e9 / bw:.1f}" for bw in BANDWIDTHS.values())
        rows.append(f"| {name} | {need / 1e9:.2f} | {local / 1e9:.2f} | {received / 1e9:.2f} | {times} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python bench/reshard_throughput.py",
        description="GB/s and peak memory of the rollout weight stream for a mid-size Qwen3-MoE on 2 CPU gloo "
        "ranks, per training layout, routing and bucket size, against memcpy and a gather-to-rank-0 baseline.",
    )
    p.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS), metavar="LAYOUT",
                   help=f"training layouts (default: all; choices: {', '.join(LAYOUTS)})")
    p.add_argument("--buckets", nargs="+", type=float, default=[64, 256, 1024], metavar="MB",
                   help="bucket sizes in MB (default: 64 256 1024)")
    p.add_argument("--repeats", type=int, default=3, help="syncs per case; the median is reported (default 3)")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown file whose generated block to (re)write, e.g. docs/bench_reshard.md")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if any(b <= 0 for b in args.buckets):
        p.error("--buckets must be positive")
    check_out(p, args.out, SCRIPT)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_reshard_model_") as config_dir:
        Path(config_dir, "config.json").write_text(json.dumps(MID_SIZE))
        for layout in args.layouts:
            print(f"layout {layout} ...", file=sys.stderr, flush=True)
            rows += run_layout(layout, config_dir, args.buckets, args.repeats)
    publish(report(rows, command_line(SCRIPT, argv), args.repeats, load_before), args.out, SCRIPT,
            "Weight sync throughput on CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Checkpoint save, load and HF export times on CPU gloo ranks (megatron_bridge.runtime.checkpoint).

    python bench/checkpoint_io.py                                     # both sizes, 2 and 4 ranks, print tables
    python bench/checkpoint_io.py --sizes tiny --ranks 2 --repeats 1  # a quick look
    python bench/checkpoint_io.py --out docs/bench_checkpoint.md      # also write the doc

Two Qwen3-MoE models, saved with transformers into a temporary directory: ``tiny``
(``configs/model/tiny_qwen3_moe.yaml``) and ``large``, the same architecture with hidden 512,
8 layers, 32 experts top-4, expert ffn 256 and vocab 8192 (115.5 M parameters). Each trains in
fp32 under EP2 on 2 ranks and PP2 x EP2 (DP2 for the dense part) on 4 ranks. After one GSPO update
(so that Adam's moments exist) every rank measures, ``--repeats`` times:

- a synchronous ``checkpoint.save`` into a new directory;
- an async one: ``save`` with megatron's ``AsyncCallsQueue`` (the time the call blocks), then
  ``finish_saves`` right away (the time until the checkpoint is complete; in training the next
  update would run in between);
- ``checkpoint.load`` of the synchronous checkpoint into a freshly built actor of the same layout.

Each time is the slowest rank's, between barriers; the tables give the median over the repeats,
the bytes of the checkpoint's files against ``megatron_bridge.plan.memory.checkpoint_bytes``, and
the bytes each rank's ``.distcp`` files hold. The 2-rank checkpoint is then exported with
``python -m recipe.model_merger merge`` in a process of its own (wall time and peak resident
memory from GNU time, ``/usr/bin/time``), against a process that only imports what the export
imports.

Every layout runs in fresh processes (megatron's parallel state is global), started with
``torch.multiprocessing.spawn``, one gloo rank each, ``cores // ranks`` intra-op threads per rank
(at least 1), so 4 ranks on 2 cores are 2x oversubscribed.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on sys.path, the packages are not
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.actor_throughput import BatchShape, build_actor, dp_share, make_batch  # noqa: E402
from bench.common import check_out, command_line, cpu_cores, load_before_run, machine_facts, publish, run_ranks  # noqa: E402
from megatron_bridge.plan.layout import TrainParallel  # noqa: E402

SCRIPT = "bench/checkpoint_io.py"
TIME = "/usr/bin/time"  # GNU time, for the export's peak memory
SIZES: dict[str, dict[str, Any]] = {  # overrides of configs/model/tiny_qwen3_moe.yaml
    "tiny": {},
    "large": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, intermediate_size=1024,
                  vocab_size=8192),
}
LAYOUTS = {  # by number of ranks
    2: TrainParallel(ep=2, etp=1),
    4: TrainParallel(pp=2, ep=2, etp=1),  # DP2 for the dense part, each expert on one rank
}
# One small update: enough for the optimizer state to exist; its size does not change the checkpoint.
SHAPE = BatchShape(rows=8, prompt=16, response=32, micro_batch=2)
# What recipe.model_merger's merge imports, also lazily (megatron's checkpoint reader, transformers'
# AutoConfig), for the import-only reference process.
EXPORT_IMPORTS = ("import recipe.model_merger, megatron_bridge.weights.dist_checkpoint, torch.distributed.checkpoint, "
                  "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader, "
                  "transformers.models.qwen3_moe.configuration_qwen3_moe; "
                  "from transformers import AutoConfig, GenerationConfig")


@dataclass(frozen=True)
class Timings:
    """The slowest rank's seconds per repeat."""

    sync_s: list[float]
    blocked_s: list[float]
    async_done_s: list[float]
    load_s: list[float]


# --- inside a rank -------------------------------------------------------------------------------


def timed(fn) -> float:
    """Wall seconds of ``fn()`` on this rank, started together with the other ranks."""
    torch.distributed.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_update(actor) -> None:
    """A GSPO update on a synthetic batch (the log-prob pass supplies ``old_log_probs``)."""
    from loss.gspo import PAPER_SETTINGS
    from loss.megatron_hook import ActorLossConfig, log_prob_func, policy_loss_func

    loss_cfg = ActorLossConfig(loss_mode="gspo", policy=PAPER_SETTINGS)
    mine = dp_share(make_batch(SHAPE, actor.spec.vocab_size), by_length=False)
    log_probs = actor.forward_only(mine, SHAPE.micro_batch, partial(log_prob_func, loss_cfg.temperature, False), None)
    mine["old_log_probs"] = log_probs["log_probs"]
    metrics = actor.train_step(mine, SHAPE.micro_batch, partial(policy_loss_func, loss_cfg), None)
    if metrics["actor/skipped"]:
        raise RuntimeError("the update was skipped (non-finite); the optimizer state would be missing")


def file_bytes(directory: Path) -> dict[str, int]:
    """Bytes of every file in a checkpoint directory, by name."""
    return {f.name: f.stat().st_size for f in directory.iterdir() if f.is_file()}


def measure(rank: int, train: TrainParallel, checkpoint: str, work: Path, repeats: int) -> dict[str, Any]:
    """This rank's save, async save and load seconds per repeat (torch.distributed is up)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from megatron_bridge.runtime import checkpoint as dist_checkpoint
    from megatron_bridge.runtime.actor import initialize_parallel

    initialize_parallel(train)
    actor = build_actor(train, checkpoint)
    one_update(actor)
    queue = AsyncCallsQueue()  # one for the whole run, as the actor worker keeps it
    out: dict[str, Any] = {"sync_s": [], "blocked_s": [], "async_done_s": [], "load_s": []}
    for repeat in range(repeats):
        sync_dir, async_dir = work / f"sync{repeat}", work / f"async{repeat}"
        out["sync_s"].append(timed(partial(dist_checkpoint.save, actor, str(sync_dir))))
        torch.distributed.barrier()
        start = time.perf_counter()
        dist_checkpoint.save(actor, str(async_dir), queue)
        out["blocked_s"].append(time.perf_counter() - start)
        dist_checkpoint.finish_saves(queue, actor, str(async_dir))
        out["async_done_s"].append(time.perf_counter() - start)
        fresh = build_actor(train, checkpoint)  # built outside the timing: a resume builds it anyway
        out["load_s"].append(timed(partial(dist_checkpoint.load, fresh, str(sync_dir))))
        del fresh
        gc.collect()  # the next fresh actor should not find this one's memory still held
        torch.distributed.barrier()
        if rank == 0:
            out["files"], out["async_files"] = file_bytes(sync_dir), file_bytes(async_dir)
            shutil.rmtree(async_dir)
            if repeat < repeats - 1:  # the last synchronous one stays, for the export
                shutil.rmtree(sync_dir)
        torch.distributed.barrier()
    return out


def threads_per_rank(ranks: int) -> int:
    return max(1, cpu_cores() // ranks)


def run_layout(ranks: int, checkpoint: str, work: Path, repeats: int) -> dict[str, Any]:
    """Spawn the ranks; the slowest rank's times per repeat, the files and the bytes per writing rank."""
    start = time.perf_counter()
    results = run_ranks(measure, ranks, threads_per_rank(ranks), LAYOUTS[ranks], checkpoint, work, repeats)
    slowest = {key: [max(r[key][i] for r in results) for i in range(repeats)] for key in Timings.__annotations__}
    # ranks finish a save at different times: how early the first one is shows the imbalance
    fastest_sync = statistics.median(min(r["sync_s"][i] for r in results) for i in range(repeats))
    files = results[0]["files"]
    return {"ranks": ranks, "timings": Timings(**slowest), "fastest_sync_s": fastest_sync, "files": files,
            "async_rank_bytes": rank_bytes(results[0]["async_files"], ranks),
            "rank_bytes": rank_bytes(files, ranks), "job_wall_s": time.perf_counter() - start}


def rank_bytes(files: dict[str, int], ranks: int) -> list[int]:
    """Bytes of the ``__<rank>_<k>.distcp`` tensor files each rank wrote."""
    per_rank = [0] * ranks
    for name, size in files.items():
        if name.endswith(".distcp"):
            per_rank[int(name[2:].split("_", 1)[0])] += size
    return per_rank


def run_process(argv: list[str], scratch: Path) -> tuple[float, float]:
    """Wall seconds and peak resident MiB of a command, from GNU time. Linux counts in a child's
    peak the address space it was forked from (until its exec), so a child of this process, which
    holds the HF model, would report at least this process's size; GNU time is a small process."""
    report = scratch / "time.txt"
    subprocess.run([TIME, "-f", "%e %M", "-o", str(report), *argv], cwd=REPO, stdout=subprocess.DEVNULL, check=True)
    wall, kib = report.read_text().split()
    return float(wall), int(kib) / 1024


def export_argv(checkpoint_dir: Path, target: Path, hf: str) -> list[str]:
    return [sys.executable, "-m", "recipe.model_merger", "merge", "--backend", "megatron", "--local_dir",
            str(checkpoint_dir), "--target_dir", str(target), "--hf_model_path", hf, "--overwrite"]


def run_export(checkpoint_dir: Path, hf: str, work: Path, repeats: int) -> dict[str, float]:
    """Medians over ``repeats`` of the export process and of the import-only one."""
    target = work / "hf_export"
    exports = [run_process(export_argv(checkpoint_dir, target, hf), work) for _ in range(repeats)]
    imports = [run_process([sys.executable, "-c", EXPORT_IMPORTS], work) for _ in range(repeats)]
    hf_bytes = sum(f.stat().st_size for f in target.glob("*.safetensors"))
    shutil.rmtree(target)
    return {"wall_s": statistics.median(w for w, _ in exports), "rss_mib": max(m for _, m in exports),
            "import_wall_s": statistics.median(w for w, _ in imports), "import_rss_mib": max(m for _, m in imports),
            "hf_bytes": hf_bytes}


def planned_bytes(hf: str, ranks: int) -> tuple[int, int]:
    from megatron_bridge.plan.memory import checkpoint_bytes
    from megatron_bridge.plan.model_spec import load_model_spec

    return checkpoint_bytes(load_model_spec(hf), ranks, weight_bytes=4)  # fp32 training


def run_size(size: str, ranks_list: list[int], repeats: int) -> dict[str, Any]:
    """Every layout of one model size, and the export of its 2-rank (or first) checkpoint."""
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.tiny_model import save_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix=f"bench_ckpt_{size}_") as tmp:
        hf = save_tiny_checkpoint(Path(tmp, "hf"), **SIZES[size])
        spec = load_model_spec(hf)
        layouts, export = [], None
        for ranks in ranks_list:
            print(f"[{size}] {describe_layout(ranks)} on {ranks} ranks ...", file=sys.stderr, flush=True)
            work = Path(tmp, f"ranks{ranks}")
            result = run_layout(ranks, hf, work, repeats)
            result["planned"] = planned_bytes(hf, ranks)
            layouts.append(result)
            t = result["timings"]
            print(f"[{size}] per repeat: {t} ({result['job_wall_s']:.0f} s with start-up)", file=sys.stderr,
                  flush=True)
            if export is None:
                print(f"[{size}] export of the {ranks}-rank checkpoint ...", file=sys.stderr, flush=True)
                export = run_export(work / f"sync{repeats - 1}", hf, Path(tmp), repeats) | {"ranks": ranks}
            shutil.rmtree(work)
    return {"size": size, "params": spec.total_params, "layouts": layouts, "export": export}


# --- reporting -----------------------------------------------------------------------------------


def describe_layout(ranks: int) -> str:
    t = LAYOUTS[ranks]
    dp = ranks // (t.tp * t.pp * t.cp)
    parts = [f"PP{t.pp}"] if t.pp > 1 else []
    parts += [f"EP{t.ep}"] if t.ep > 1 else []
    return " x ".join(parts) + (f" (DP{dp} dense)" if dp > 1 else "")


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def gb_per_s(n: float, seconds: float) -> str:
    return f"{n / 1e9 / seconds:.3g}"  # significant digits: the tiny model moves megabytes


def describe_model(result: dict) -> str:
    overrides = SIZES[result["size"]]
    shape = ", ".join(f"{k} {v}" for k, v in overrides.items()) or "configs/model/tiny_qwen3_moe.yaml"
    return f"{result['size']} ({shape}): {result['params'] / 1e6:.1f} M parameters"


def save_table(results: list[dict]) -> str:
    lines = [
        "| model | layout | ranks x threads | sync save s | sync save, fastest rank s | async: save blocks s "
        "| async: until finished s | blocks / sync | load s | write GB/s | sync save per repeat s |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        for layout in r["layouts"]:
            t = layout["timings"]
            sync, blocked = statistics.median(t.sync_s), statistics.median(t.blocked_s)
            total = sum(layout["files"].values())
            lines.append(
                f"| {r['size']} | {describe_layout(layout['ranks'])} | {layout['ranks']} x "
                f"{threads_per_rank(layout['ranks'])} | {sync:.2f} | {layout['fastest_sync_s']:.2f} | {blocked:.2f} "
                f"| {statistics.median(t.async_done_s):.2f} | {blocked / sync:.2f} | {statistics.median(t.load_s):.2f} "
                f"| {gb_per_s(total, sync)} "
                f"| {', '.join(f'{x:.2f}' for x in t.sync_s)} |"
            )
    return "\n".join(lines)


def size_table(results: list[dict]) -> str:
    lines = [
        "| model | layout | files | on disk MB | planned MB (`checkpoint_bytes`) | on disk / planned "
        "| .distcp MB per rank, min-max | planned per rank MB |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        for layout in r["layouts"]:
            total = sum(layout["files"].values())
            planned, per_rank = layout["planned"]
            lines.append(
                f"| {r['size']} | {describe_layout(layout['ranks'])} | {len(layout['files'])} | {mb(total)} "
                f"| {mb(planned)} | {total / planned:.3f} | {mb(min(layout['rank_bytes']))}-{mb(max(layout['rank_bytes']))} "
                f"| {mb(per_rank)} |"
            )
    return "\n".join(lines)


def export_table(results: list[dict]) -> str:
    lines = [
        "| model | checkpoint | HF weights MB | export process s | import-only process s | GB/s (whole process) "
        "| GB/s (beyond imports) | export peak RSS MiB | import-only peak RSS MiB | difference MiB |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        e = r["export"]
        beyond = e["wall_s"] - e["import_wall_s"]
        lines.append(
            f"| {r['size']} | {describe_layout(e['ranks'])}, {e['ranks']} ranks | {mb(e['hf_bytes'])} "
            f"| {e['wall_s']:.2f} | {e['import_wall_s']:.2f} | {gb_per_s(e['hf_bytes'], e['wall_s'])} "
            f"| {gb_per_s(e['hf_bytes'], beyond)} | {e['rss_mib']:,.0f} | {e['import_rss_mib']:,.0f} "
            f"| {e['rss_mib'] - e['import_rss_mib']:,.0f} |"
        )
    return "\n".join(lines)


def odd_sizes(results: list[dict]) -> list[str]:
    """Async checkpoints whose tensor files differ in size from the synchronous ones (none expected;
    ``.metadata`` holds the directory's name, so it is left out)."""
    return [f"- note: {r['size']} on {layout['ranks']} ranks: the async checkpoint's .distcp files per rank hold "
            f"{layout['async_rank_bytes']} bytes, the synchronous one's {layout['rank_bytes']}"
            for r in results for layout in r["layouts"] if layout["async_rank_bytes"] != layout["rank_bytes"]]


CAVEATS = """\
What this can and cannot say:

- It is one machine's local disk (a virtual disk here) and its page cache. megatron's writer calls
  `fsync` on every file, so a save waits for the disk; a load right after the save reads files that
  are still in the page cache, so load times are memory and unpickling speed, not disk reads.
  The export likewise reads a checkpoint that is in the page cache.
- 2 cores: each rank's writer forks worker processes and the ranks share the cores, so 4 ranks
  are oversubscribed and the times include waiting for a core. The ratio of async blocking to
  synchronous save is the useful number; absolute GB/s are not an NPU/GPU cluster's, where the
  async staging is a device-to-host copy and the files go to a parallel file system.
- The first save in a process pays first-use costs (the per-repeat column shows how much); with
  3 or more repeats the median is one of the later ones.
- The async "until finished" time calls `finish_saves` right after `save`; in training the next
  update runs in between, competing for the same cores here.
- The older per-rank `torch.save` checkpoint format no longer exists in the code, so there is no
  old-against-new comparison."""


def report(results: list[dict], command: str, repeats: int, load_before: float, ranks_list: list[int]) -> str:
    threads_note = f"torch.set_num_threads(max(1, {cpu_cores()} cores // ranks)) per rank"
    if max(ranks_list) > cpu_cores():
        threads_note += f"; {max(ranks_list)} ranks on {cpu_cores()} cores are oversubscribed"
    export_cmd = "python " + " ".join(export_argv(Path("<checkpoint>"), Path("<target>"), "<hf model>")[1:])
    return "\n".join([
        f"Command: `{command}`",
        "",
        *machine_facts(threads_note, load_before),
        *(f"- model {describe_model(r)}" for r in results),
        f"- fp32 weights, OptimConfig defaults (DistributedOptimizer, Adam), one GSPO update of "
        f"{SHAPE.rows} rows before the saves; every time is the slowest rank's, the median of {repeats} "
        f"repeat(s)",
        "- write GB/s: the checkpoint's bytes on disk over the synchronous save time (MB = 1e6 bytes, GB = 1e9)",
        *odd_sizes(results),
        "",
        "Save and load:",
        "",
        save_table(results),
        "",
        "Size: the files against `checkpoint_bytes(spec, world_size, weight_bytes=4)` (weights, fp32 main "
        "parameters, two Adam moments); per rank: the `.distcp` files each rank wrote:",
        "",
        size_table(results),
        "",
        f"HF export (`{TIME} -f \"%e %M\" {export_cmd}`, median of {repeats} runs; peak RSS the largest), "
        f"against `{TIME} -f \"%e %M\" python -c \"{EXPORT_IMPORTS}\"`:",
        "",
        export_table(results),
        "",
        CAVEATS,
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python bench/checkpoint_io.py",
        description="Save (sync and async), load and HF export times of dist_checkpointing checkpoints, for a tiny "
        "and a larger synthetic Qwen3-MoE on CPU gloo ranks.",
        epilog="ranks: " + "; ".join(f"{n} = {describe_layout(n)}" for n in LAYOUTS),
    )
    p.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=list(SIZES), help="models (default: all)")
    p.add_argument("--ranks", nargs="+", type=int, choices=tuple(LAYOUTS), default=list(LAYOUTS),
                   help="layouts by number of ranks (default: 2 4); the first one's checkpoint is exported")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every timing, median reported (default 3)")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown file whose generated block to (re)write, e.g. docs/bench_checkpoint.md")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if not os.access(TIME, os.X_OK):
        p.error(f"{TIME} (GNU time) is needed to measure the export's peak memory")
    check_out(p, args.out, SCRIPT)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = load_before_run()
    start = time.perf_counter()
    results = [run_size(size, args.ranks, args.repeats) for size in args.sizes]
    body = report(results, command_line(SCRIPT, argv), args.repeats, load_before, args.ranks)
    print(f"total {time.perf_counter() - start:.0f} s", file=sys.stderr)
    publish(body, args.out, SCRIPT, "Checkpoint save, load and export on CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())

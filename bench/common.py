"""What the benchmark scripts share: the machine description, a free port, the gloo ranks a
measurement runs on, and rewriting only the generated block of a results doc."""

from __future__ import annotations

import json
import os
import platform as host
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

# Warnings every rank would print on every run, none of them about the measurement.
BENIGN_WARNINGS = (
    ".*(Apex|Transformer Engine).*",  # megatron's import-time notes
    ".*non-leaf Tensor.*",  # megatron's DistributedOptimizer.zero_grad probing .grad of its shard views
    ".*CUDA_DEVICE_MAX_CONNECTIONS.*",  # a CUDA stream hint for sequence parallel
    ".*Disabling sequence parallel.*",  # expert linears with ETP1 under TP2+SP
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_ranks(measure: Callable[..., Any], world: int, threads: int, *args) -> list:
    """``measure(rank, *args)`` on ``world`` gloo ranks of the CPU platform, each a fresh process
    (megatron's parallel state is global) with ``threads`` intra-op threads; the JSON-able results
    by rank. ``measure`` must be a module-level function (it is pickled to the ranks)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench_ranks_") as out_dir:
        mp.spawn(_rank_entry, args=(world, free_port(), out_dir, threads, measure, args), nprocs=world, join=True)
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


def _rank_entry(rank: int, world: int, port: int, out_dir: str, threads: int, measure: Callable[..., Any],
                args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames megatron still uses
    for message in BENIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    import torch.distributed as dist

    from megatron_bridge.runtime import platform

    platform.activate("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(measure(rank, *args)))
    finally:
        dist.destroy_process_group()


def machine_facts(threads_note: str, load_before: float) -> list[str]:
    import megatron.core

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    model = names[0] if names else host.processor() or "unknown CPU"
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return [
        f"- CPU: {cpu_cores()} cores usable ({model}), {mem_gib:.0f} GiB memory, {host.system()} {host.release()}",
        f"- 1-minute load average before the run: {load_before:.2f} (other processes on the machine skew the numbers)",
        f"- Python {host.python_version()}, torch {torch.__version__}, megatron-core {megatron.core.__version__}, gloo backend",
        f"- threads: {threads_note}",
    ]


def markers(script: str) -> tuple[str, str]:
    return f"<!-- bench:begin (written by {script}) -->", "<!-- bench:end -->"


def has_generated_block(text: str, script: str) -> bool:
    begin, end = markers(script)
    return begin in text and end in text.split(begin, 1)[1]


def check_out(parser, out: Path | None, script: str) -> None:
    """Refuse an ``--out`` file that exists without this script's generated block, before measuring."""
    if out and out.exists() and not has_generated_block(out.read_text(), script):
        parser.error(f"--out {out} has no generated block ({' ... '.join(markers(script))}); add one or choose a new file")


def write_doc(path: Path, body: str, script: str, title: str) -> None:
    """Replace the generated block of ``path`` (or create the file), keeping the prose around it."""
    begin, end = markers(script)
    text = path.read_text() if path.exists() else f"# {title}\n\n{begin}\n{end}\n"
    if not has_generated_block(text, script):
        raise SystemExit(f"error: {path} has no generated block ({begin} ... {end}); refusing to overwrite it")
    head, rest = text.split(begin, 1)
    path.write_text(head + f"{begin}\n{body}\n{end}" + rest.split(end, 1)[1])

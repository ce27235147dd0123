"""What the benchmark scripts share: the machine description, a free port, and rewriting only the
generated block of a results doc."""

from __future__ import annotations

import os
import platform as host
import socket
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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


def write_doc(path: Path, body: str, script: str, title: str) -> None:
    """Replace the generated block of ``path`` (or create the file), keeping the prose around it."""
    begin, end = markers(script)
    text = path.read_text() if path.exists() else f"# {title}\n\n{begin}\n{end}\n"
    if not has_generated_block(text, script):
        raise SystemExit(f"error: {path} has no generated block ({begin} ... {end}); refusing to overwrite it")
    head, rest = text.split(begin, 1)
    path.write_text(head + f"{begin}\n{body}\n{end}" + rest.split(end, 1)[1])

"""What the benchmark scripts share: the machine description, a free port, the ranks a
measurement runs on (CPU gloo ranks, or one per accelerator), the mid-size model, and rewriting
only the generated block of a results doc."""

from __future__ import annotations

import json
import os
import platform as host
import socket
import sys
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

# A Qwen3-MoE between the tiny test model and Qwen3-30B-A3B (0.70 B parameters, experts 87 % of
# them), for measurements where the tiny model's kernels are too small to say anything.
MID_SIZE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=1024, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
    moe_intermediate_size=384, intermediate_size=3072, vocab_size=32768, max_position_embeddings=4096,
    rope_theta=1e6, rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False, router_aux_loss_coef=0.0,
    bos_token_id=1, eos_token_id=2,
)

MODELS = {"tiny": "tiny Qwen3-MoE", "mid": "mid-size Qwen3-MoE (bench/common.py MID_SIZE)"}  # --model: its description


def save_model(directory: str | Path, model: str, seed: int = 0) -> str:
    """A Hub-format checkpoint of the tiny model or the mid-size one, random weights."""
    from megatron_bridge.tiny_model import save_tiny_checkpoint

    overrides = {k: v for k, v in MID_SIZE.items() if k not in ("architectures", "model_type")} if model == "mid" else {}
    return save_tiny_checkpoint(directory, seed, **overrides)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_ranks(measure: Callable[..., Any], world: int, threads: int, *args, platform: str = "cpu") -> list:
    """``measure(rank, *args)`` on ``world`` ranks of ``platform`` (gloo ranks on the CPU, one
    device each on an accelerator), each a fresh process (megatron's parallel state is global)
    with ``threads`` intra-op threads; the JSON-able results by rank. ``measure`` must be a
    module-level function (it is pickled to the ranks)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench_ranks_") as out_dir:
        mp.spawn(_rank_entry, args=(world, free_port(), out_dir, threads, platform, measure, args), nprocs=world,
                 join=True)
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


def _rank_entry(rank: int, world: int, port: int, out_dir: str, threads: int, platform_name: str,
                measure: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames megatron still uses
    for message in BENIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    import torch.distributed as dist

    from megatron_bridge.runtime import platform

    platform.init_distributed(platform.activate(platform_name))
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(measure(rank, *args)))
    finally:
        dist.destroy_process_group()


def synchronize() -> None:
    """Wait for the accelerator's queued work (a no-op on the CPU), so a timer reads finished work."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def machine_facts(threads_note: str, load_before: float, platform: str = "cpu") -> list[str]:
    import megatron.core

    from megatron_bridge.plan.platforms import PLATFORMS

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    model = names[0] if names else host.processor() or "unknown CPU"
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return [
        f"- CPU: {cpu_cores()} cores usable ({model}), {mem_gib:.0f} GiB memory, {host.system()} {host.release()}",
        f"- 1-minute load average before the run: {load_before:.2f} (other processes on the machine skew the numbers)",
        *([f"- device: {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB, "
           f"CUDA {torch.version.cuda}"] if platform == "cuda" else []),
        f"- Python {host.python_version()}, torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
        f"{PLATFORMS[platform].backend} backend",
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


def command_line(script: str, argv: list[str] | None) -> str:
    """How the script was run, as the docs quote it."""
    return " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)])


def publish(body: str, out: Path | None, script: str, title: str) -> None:
    """Print the report and, with ``--out``, write it into that doc's generated block."""
    print(body)
    if out:
        write_doc(out, body, script, title)
        print(f"wrote {out}", file=sys.stderr)


def write_doc(path: Path, body: str, script: str, title: str) -> None:
    """Replace the generated block of ``path`` (or create the file), keeping the prose around it."""
    begin, end = markers(script)
    text = path.read_text() if path.exists() else f"# {title}\n\n{begin}\n{end}\n"
    if not has_generated_block(text, script):
        raise SystemExit(f"error: {path} has no generated block ({begin} ... {end}); refusing to overwrite it")
    head, rest = text.split(begin, 1)
    path.write_text(head + f"{begin}\n{body}\n{end}" + rest.split(end, 1)[1])

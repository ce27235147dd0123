"""What the benchmark scripts share: the machine description, a free port, the ranks a
measurement runs on (CPU gloo ranks, or one per accelerator), the mid-size model, random
checkpoints of a shipped model's shape, and rewriting only the generated block(s) of a results doc."""

from __future__ import annotations

import json
import os
import platform as host
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_bridge.runtime.platform import free_port

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


def save_model(directory: str | Path, model: str, seed: int = 0, **overrides: Any) -> str:
    """A Hub-format checkpoint of the tiny model or the mid-size one, random weights; ``overrides``:
    HF config keys to change (e.g. ``num_hidden_layers``)."""
    from megatron_bridge.tiny_model import save_tiny_checkpoint

    mid = {k: v for k, v in MID_SIZE.items() if k not in ("architectures", "model_type")} if model == "mid" else {}
    return save_tiny_checkpoint(directory, seed, **mid, **overrides)


def qwen3_moe_tensors(cfg: dict[str, Any]):
    """(HF name, shape, kind) of every tensor of a Qwen3-MoE checkpoint with HF config ``cfg``, as
    transformers saves it (one tensor per expert and projection); kind: embedding, linear or norm."""
    h, v, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    inner, experts = cfg["moe_intermediate_size"], cfg["num_experts"]
    yield "model.embed_tokens.weight", (v, h), "embedding"
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", (h,), "norm"
        yield p + "post_attention_layernorm.weight", (h,), "norm"
        for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            yield p + f"self_attn.{name}.weight", shape, "linear"
        yield p + "self_attn.q_norm.weight", (d,), "norm"
        yield p + "self_attn.k_norm.weight", (d,), "norm"
        yield p + "mlp.gate.weight", (experts, h), "linear"
        for e in range(experts):
            for name, shape in (("gate_proj", (inner, h)), ("up_proj", (inner, h)), ("down_proj", (h, inner))):
                yield p + f"mlp.experts.{e}.{name}.weight", shape, "linear"
    yield "model.norm.weight", (h,), "norm"
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", (v, h), "linear"


def save_shipped_model(directory: str | Path, name: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                       device: str = "cpu", **overrides: Any) -> str:
    """A Hub-format checkpoint (config.json + model.safetensors) of a shipped model's shape
    (``configs/model/<name>.yaml``) with ``overrides`` (e.g. fewer layers or experts), random
    weights drawn as ``megatron_bridge.tiny_model`` draws them (unit-variance linear maps, unit
    embedding entries, norms near 1), written tensor by tensor without building the model, so that
    a slice of a large model is quick to write; drawn on ``device`` (``cuda`` is faster), kept in
    ``dtype``."""
    from safetensors.torch import save_file

    from megatron_bridge.plan.model_spec import load_hf_config

    cfg = {**load_hf_config(name), **overrides, "torch_dtype": str(dtype).removeprefix("torch.")}
    if cfg.get("model_type") != "qwen3_moe":
        raise ValueError(f"{name}: only Qwen3-MoE shapes can be written, not model_type={cfg.get('model_type')!r}")
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    generator = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for tensor_name, shape, kind in qwen3_moe_tensors(cfg):
        x = torch.randn(shape, generator=generator, device=device)
        x = 1.0 + 0.2 * x if kind == "norm" else x / shape[-1] ** 0.5 if kind == "linear" else x
        tensors[tensor_name] = x.to(dtype).cpu()
    Path(directory).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(directory, "model.safetensors")), metadata={"format": "pt"})
    Path(directory, "config.json").write_text(json.dumps(cfg, indent=2))
    return str(directory)


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_ranks(measure: Callable[..., Any], world: int, threads: int, *args, platform: str = "cpu",
              timeout: float | None = None) -> list:
    """``measure(rank, *args)`` on ``world`` ranks of ``platform`` (gloo ranks on the CPU, one
    device each on an accelerator), each a fresh process (megatron's parallel state is global)
    with ``threads`` intra-op threads; the JSON-able results by rank. ``measure`` must be a
    module-level function (it is pickled to the ranks). With ``timeout`` (seconds), ranks still
    running then are killed and ``TimeoutError`` is raised."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench_ranks_") as out_dir:
        context = mp.spawn(_rank_entry, args=(world, free_port(), out_dir, threads, platform, measure, args),
                           nprocs=world, join=False)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not context.join(None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                for process in context.processes:
                    process.join()
                raise TimeoutError(f"the ranks ran past {timeout:g} s and were stopped")
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


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """``fn``'s median wall seconds over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_before_run() -> float:
    """The 1-minute load average now, with a warning when other processes will skew the numbers."""
    load = os.getloadavg()[0]
    if load > cpu_cores() / 2:
        print(f"warning: 1-minute load average is {load:.2f} on {cpu_cores()} cores; other processes will skew "
              "the numbers", file=sys.stderr)
    return load


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


def markers(script: str, block: str | None = None) -> tuple[str, str]:
    """The lines around a script's generated block; ``block`` names one of several blocks a script
    writes (the unnamed one is its first)."""
    return f"<!-- bench:begin (written by {script}{', ' + block if block else ''}) -->", "<!-- bench:end -->"


def has_generated_block(text: str, script: str, block: str | None = None) -> bool:
    begin, end = markers(script, block)
    return begin in text and end in text.split(begin, 1)[1]


def check_out(parser, out: Path | None, script: str, block: str | None = None) -> None:
    """Refuse an ``--out`` file that exists without this script's generated block, before measuring."""
    if out and out.exists() and not has_generated_block(out.read_text(), script, block):
        parser.error(f"--out {out} has no generated block ({' ... '.join(markers(script, block))}); add one or "
                     "choose a new file")


def command_line(script: str, argv: list[str] | None) -> str:
    """How the script was run, as the docs quote it."""
    return " ".join(["python", script, *(sys.argv[1:] if argv is None else argv)])


def publish(body: str, out: Path | None, script: str, title: str, block: str | None = None) -> None:
    """Print the report and, with ``--out``, write it into that doc's generated block."""
    print(body)
    if out:
        write_doc(out, body, script, title, block)
        print(f"wrote {out}", file=sys.stderr)


def write_doc(path: Path, body: str, script: str, title: str, block: str | None = None) -> None:
    """Replace the generated block of ``path`` (or create the file), keeping the prose around it."""
    begin, end = markers(script, block)
    text = path.read_text() if path.exists() else f"# {title}\n\n{begin}\n{end}\n"
    if not has_generated_block(text, script, block):
        raise SystemExit(f"error: {path} has no generated block ({begin} ... {end}); refusing to overwrite it")
    head, rest = text.split(begin, 1)
    path.write_text(head + f"{begin}\n{body}\n{end}" + rest.split(end, 1)[1])

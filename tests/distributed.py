"""Run a function on N CPU gloo ranks (or accelerator ranks) in fresh processes (megatron keeps
global state, so every test gets new processes). Workers report through JSON files so a failing
rank is visible."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import torch.multiprocessing as mp

from megatron_bridge.runtime.platform import free_port

# The ranks fork from a server process (one per test process) that has imported these once, so a
# rank starts at once instead of importing them again (~5 s of CPU each, the larger part of a short
# test). The server only imports: no tensor op, no process group, no megatron state, so each rank
# still starts as clean as a new interpreter.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "transformers",
           "transformers.models.qwen3_moe.modeling_qwen3_moe", "megatron_bridge.runtime.actor",
           "megatron_bridge.verify", "loss.megatron_hook"]


def _entry(rank: int, world_size: int, port: int, out_dir: str, platform_name: str, env: dict, fn, args) -> None:
    os.environ.clear()  # the caller's environment as it is now, not as it was when the server started
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    # torch was loaded in the server, before OMP_NUM_THREADS: one thread a rank, as the recipe's
    # ranks run (two on two cores per rank would oversubscribe them)
    torch.set_num_threads(1)

    from megatron_bridge.runtime import platform

    platform.init_distributed(platform.activate(platform_name))
    try:
        result = fn(rank, world_size, *args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, tmp_path, *args, platform_name: str = "cpu") -> list:
    """fn(rank, world_size, *args) -> JSON-able, on every rank (one device each on an accelerator
    platform); returns the results by rank."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(_entry, args=(world_size, free_port(), str(tmp_path), platform_name, dict(os.environ), fn, args),
                       nprocs=world_size, join=True, start_method="forkserver")
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(world_size)]


def reset_parallel_state() -> None:
    """Drop megatron's groups, so the next layout starts from its own parallel state in the same
    ranks (spawning ranks costs more than a layout). The torch process groups behind them stay for
    the next layout that asks for the same ranks (``_reused_group``): destroying and making them
    again took about half of a tiny layout's time, and a group is the same whichever megatron role
    asks for it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    # 0.12.1's destroy_model_parallel leaves these; initialize_model_parallel sets them only on
    # the ranks of the (position) embedding group, so a stale list would put a rank in a group
    # it has no handle of.
    ps._EMBEDDING_GLOBAL_RANKS = ps._POSITION_EMBEDDING_GLOBAL_RANKS = None
    global _torch_new_group
    if _torch_new_group is None:
        _torch_new_group, dist.new_group = dist.new_group, _reused_group


_torch_new_group = None  # torch's own, once reset_parallel_state has put _reused_group in its place
_groups: dict = {}  # (ranks, backend) -> the group made for them in this rank


def _reused_group(ranks=None, backend=None, pg_options=None, **kwargs):
    """``torch.distributed.new_group``, once per rank set: megatron's ``initialize_model_parallel``
    asks for every group on every rank in the same order, so every rank takes the same groups from
    here (a group with options of its own is made anew)."""
    if pg_options is not None:
        return _torch_new_group(ranks=ranks, backend=backend, pg_options=pg_options, **kwargs)
    key = (tuple(ranks) if ranks is not None else None, backend)
    if key not in _groups:
        _groups[key] = _torch_new_group(ranks=ranks, backend=backend, **kwargs)
    return _groups[key]

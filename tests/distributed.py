"""Run a function on N CPU gloo ranks (or accelerator ranks) in fresh processes (megatron keeps
global state, so every test gets new processes). Workers report through JSON files so a failing
rank is visible."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.multiprocessing as mp

from megatron_bridge.runtime.platform import free_port


def _entry(rank: int, world_size: int, port: int, out_dir: str, platform_name: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch.distributed as dist

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
    mp.spawn(_entry, args=(world_size, free_port(), str(tmp_path), platform_name, fn, args), nprocs=world_size,
             join=True)
    return [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(world_size)]


def reset_parallel_state() -> None:
    """Drop megatron's groups, and the torch process groups behind them (only the default group
    is ours), so the next layout starts from nothing in the same ranks (spawning ranks costs more
    than a layout)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    # 0.12.1's destroy_model_parallel leaves these; initialize_model_parallel sets them only on
    # the ranks of the (position) embedding group, so a stale list would put a rank in a group
    # it has no handle of.
    ps._EMBEDDING_GLOBAL_RANKS = ps._POSITION_EMBEDDING_GLOBAL_RANKS = None
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)

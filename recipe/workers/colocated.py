"""One device as one Ray actor: the actor role (``recipe.workers.actor``) and the rollout role
(``recipe.workers.rollout``) of the same rank in one process, taking turns with the device memory,
and the weight stream between them.

The driver (``recipe.driver``) calls the same method on every worker with that worker's share of
the data; the methods that run collectives (log-probs, update, weight sync, checkpoint) must be
called on all workers together.

The device alternates between the engine and the Megatron shards: ``generate`` offloads the
training state the layout names (``param_offload``, ``grad_offload``, ``optimizer_offload``; the
reference model's weights under ``param_offload``; it has no grads or optimizer) before it wakes
the engine, and every method that computes with a shard puts the engine to sleep first, unless
``rollout.free_cache_engine`` is false (the config sets it so where engine and training fit together).
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from recipe.config import RecipeConfig
from recipe.rollout.base import SamplingParams
from recipe.workers.actor import ActorWorker
from recipe.workers.rollout import Answer, GenerationCall, RolloutWorker

if TYPE_CHECKING:
    from megatron_bridge.moe.table import RoutingRecord
    from megatron_bridge.plan.platforms import Platform

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class RankInfo:
    """Where a worker sits in the train and rollout layouts (the driver splits data with it)."""

    rank: int
    node_ip: str
    dp_rank: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    first_of_replica: bool  # the rank whose outputs stand for its DP replica


def free_address() -> tuple[str, int]:
    """This node's IP and a free TCP port on it (rank 0 hosts the torch.distributed rendezvous)."""
    import ray

    from megatron_bridge.runtime.platform import free_port

    return ray.util.get_node_ip_address(), free_port("")


def quiet_known_warnings() -> None:
    """Known, harmless warnings of megatron-core 0.12.1 on this torch, once per call otherwise."""
    for message in (".*(Transformer Engine|Apex).*", r".*torch\.distributed\.\w+` is deprecated.*",
                    ".*is not a leaf Tensor is being accessed.*"):
        warnings.filterwarnings("ignore", message=message)


def join_world(device: str, rank: int, world_size: int, master_addr: str, master_port: int) -> Platform:
    """This process as ``rank`` of a torch.distributed world on ``device``'s platform, set in the
    environment as torchrun sets it (vLLM's external launcher reads it there). Ray gives each rank
    one device, so its local rank is 0."""
    from megatron_bridge.runtime.platform import activate, init_distributed

    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    platform = activate(device)
    init_distributed(platform)
    return platform


def busy(method: Callable) -> Callable:
    """Count the seconds a step's method runs in the worker (``Worker.take_busy``): beside the
    driver's time for the same phase, the rest is Ray's (transfer, scheduling) and waiting."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.busy[method.__name__] = self.busy.get(method.__name__, 0.0) + time.perf_counter() - start

    return timed


class Worker:
    def __init__(self, rank: int, world_size: int, threads: int):
        self.rank, self.world_size = rank, world_size
        self.busy: dict[str, float] = {}
        self.profiler: torch.profiler.profile | None = None
        torch.set_num_threads(threads)
        quiet_known_warnings()

    def address(self) -> tuple[str, int]:
        return free_address()

    def setup(self, cfg: RecipeConfig, model_dir: str, master_addr: str, master_port: int) -> RankInfo:
        """Join torch.distributed, build both roles and give the engine the actor's weights (so the
        engine always serves exactly what the actor holds)."""
        from recipe.rollout import ENGINES

        platform = self._join(cfg, master_addr, master_port)
        # an engine that shards the experts over its EP ranks receives only its own experts' weights
        rollout_ep = cfg.layout.rollout.ep if ENGINES[cfg.actor_rollout_ref.rollout.name].expert_parallel else 1
        self.actor = ActorWorker(cfg, self.rank, self.world_size, model_dir, DTYPES[cfg.actor_rollout_ref.model.dtype],
                                 platform.name, rollout_ep, make_room=self._sleep_rollout)
        self.rollout = RolloutWorker(cfg, model_dir, DTYPES[cfg.actor_rollout_ref.rollout.dtype], platform.name)
        self.free_engine = cfg.actor_rollout_ref.rollout.free_cache_engine
        self.sync_weights()
        return self._info()

    def _join(self, cfg: RecipeConfig, master_addr: str, master_port: int) -> Platform:
        """This rank in the training ranks' torch.distributed world, on the layout's platform."""
        return join_world(cfg.layout.cluster.device, self.rank, self.world_size, master_addr, master_port)

    def _info(self) -> RankInfo:
        import ray
        from megatron.core import parallel_state as ps

        return RankInfo(
            rank=self.rank, node_ip=ray.util.get_node_ip_address(),
            dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
            first_of_replica=ps.get_tensor_model_parallel_rank() == 0
            and ps.get_pipeline_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0,
        )

    def _sleep_rollout(self) -> None:
        if self.free_engine:
            self.rollout.sleep()  # the training state coming back needs the memory the engine holds

    # --- one step ----------------------------------------------------------------------------

    @busy
    def run(self, calls: list[tuple[list[list[int]], list[int], SamplingParams, int]]) -> None:
        """Generate the calls, each (prompts, request ids, sampling, key), joined (``RolloutWorker.run``)."""
        self.actor.offload()
        self.rollout.run([GenerationCall(*call) for call in calls])

    def result(self, key: int) -> Answer:
        return self.rollout.result(key)

    @busy
    def compute_log_probs(self, batch: dict[str, torch.Tensor], model: str,
                          replay: bool) -> tuple[torch.Tensor, RoutingRecord | None]:
        self._sleep_rollout()
        return self.actor.compute_log_probs(batch, model, replay)

    def sample_routing(self, batch: dict[str, torch.Tensor]) -> RoutingRecord:
        self._sleep_rollout()
        return self.actor.sample_routing(batch)

    @busy
    def update(self, batch: dict[str, torch.Tensor], mini_batch_rows: int,
               replay: bool) -> tuple[list[dict[str, float]], RoutingRecord]:
        self._sleep_rollout()
        return self.actor.update(batch, mini_batch_rows, replay)

    @busy
    def sync_weights(self) -> dict[str, float]:
        from recipe.rollout.sync import sync_weights

        return sync_weights(self.actor.export(), self.rollout.engine)

    def take_busy(self) -> dict[str, float]:
        """The seconds each step method ran here since the last call (``busy``), and start anew."""
        taken, self.busy = self.busy, {}
        return taken

    def profile(self, start: bool, rows: int = 30) -> str | None:
        """torch.profiler over this worker's calls from ``profile(True)`` to ``profile(False)``, which
        returns the ``rows`` operators and kernels taking the most self time on the host and on the
        device (``bench/recipe_phases.py --profile``)."""
        if start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            return None
        self.profiler.__exit__(None, None, None)
        events, self.profiler = self.profiler.key_averages(), None
        tables = [f"rank {self.rank}, by self time on the host:",
                  events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)]
        if torch.cuda.is_available():
            tables += ["by self time on the device:",
                       events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60)]
        return "\n".join(tables)

    def weights_fingerprint(self) -> tuple[float, float]:
        return self.actor.weights_fingerprint()

    def memory(self) -> dict[str, float]:
        return self.actor.memory()

    # --- checkpoints -------------------------------------------------------------------------

    def save(self, directory: str) -> None:
        self.actor.save(directory)

    def finish_save(self) -> None:
        self.actor.finish_save()

    def load(self, directory: str) -> bool:
        restored = self.actor.load(directory)
        self.sync_weights()
        return restored

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

"""One device as one Ray actor (``Rank``), with the roles its pool gives it: the actor role
(``recipe.workers.actor``: the Megatron shard and its passes), the rollout role
(``recipe.workers.rollout``: the engine), or both.

- Both (colocated): the roles take turns with the device memory, and the weights go from the shard
  to the engine in the same process. ``run`` offloads the training state the layout names
  (``param_offload``, ``grad_offload``, ``optimizer_offload``; the reference model's weights under
  ``param_offload``) before it wakes the engine, and every method that computes with a shard puts
  the engine to sleep first, unless ``rollout.free_cache_engine`` is false (the config sets it so
  where engine and training fit together).
- A rollout pool of its own (``actor_rollout_ref.hybrid_engine=false``): the training ranks hold
  the actor role alone, the rollout ranks the rollout role alone, on devices of their own, so that
  generation runs while the trainer updates (``async_training.mode=one_step_off``). The rollout
  ranks form a torch.distributed world of their own (the engine's: vLLM's external launcher runs
  its TP / DP / EP groups in it). The weights cross over a group of training rank 0 and the rollout
  ranks (``recipe.rollout.broadcast``): every training rank streams its export, rank 0 broadcasts
  it; the driver opens that group once (``join_weights`` on both sides at once) and calls
  ``sync_weights`` on both sides together. Such a pool answers ``result`` and takes ``pause``
  beside a ``run`` in progress (``CONCURRENT``).

The driver (``recipe.driver``) calls the same method on every rank of a pool with that rank's share
of the data (``recipe.workers.group.WorkerGroup.call``); the methods that run collectives
(log-probs, update, weight sync, checkpoint) must be called on all of them together.
"""

from __future__ import annotations

import enum
import functools
import os
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from recipe.rollout.base import SamplingParams
from recipe.workers.actor import ActorWorker
from recipe.workers.rollout import Answer, GenerationCall, RolloutWorker
from recipe.workers.settings import RankSettings

if TYPE_CHECKING:
    from megatron_bridge.moe.table import RoutingRecord
    from megatron_bridge.plan.platforms import Platform
    from recipe.rollout.broadcast import TransferPlan


class Roles(enum.Flag):
    TRAIN = enum.auto()
    ROLLOUT = enum.auto()
    BOTH = TRAIN | ROLLOUT


# The methods a rank with the rollout role alone runs beside the others, each in a Ray concurrency
# group of its own with this many threads: ``pause`` must reach a ``run`` in progress, and a call's
# ``result`` leaves while the others of its ``run`` go on (one thread per generation batch in flight
# waits for its answer; more queue). Everything else runs one call at a time. Colocated ranks take
# no such threads: their ``result`` waits for the ``run`` before it.
CONCURRENT = {"pause": 1, "result": 32}


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
    """Count the seconds a step's method runs in the worker (``Rank.take_busy``): beside the
    driver's time for the same phase, the rest is Ray's (transfer, scheduling) and waiting."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.busy[method.__name__] = self.busy.get(method.__name__, 0.0) + time.perf_counter() - start

    return timed


class Rank:
    def __init__(self, rank: int, world_size: int, roles: Roles):
        self.rank, self.world_size, self.roles = rank, world_size, roles
        self.busy: dict[str, float] = {}
        self.profiler: torch.profiler.profile | None = None
        self.actor: ActorWorker | None = None
        self.rollout: RolloutWorker | None = None
        self.weights = self.plan = None  # a pool of its own: the weight group and what crosses it
        # One intra-op thread, whatever the rank's share of cores: on a device torch's host work is
        # light, and the CPU runs the tiny models, slower on two threads than on one (docs/bench_actor.md).
        torch.set_num_threads(1)
        quiet_known_warnings()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port on it (rank 0 hosts the torch.distributed rendezvous)."""
        import ray

        from megatron_bridge.runtime.platform import free_port

        return ray.util.get_node_ip_address(), free_port("")

    def setup(self, settings: RankSettings, model_dir: str, master_addr: str, master_port: int) -> RankInfo:
        """Join the pool's torch.distributed world and build the roles. Colocated, the engine gets
        the actor's weights at once (so it always serves exactly what the actor holds); a rollout
        rank of a pool of its own has random or initial weights until its first ``sync_weights``."""
        from recipe.rollout import ENGINES
        from recipe.rollout.broadcast import TransferPlan, weight_backend

        platform = join_world(settings.layout.cluster.device, self.rank, self.world_size, master_addr, master_port)
        if self.roles & Roles.TRAIN:
            colocated = self.roles == Roles.BOTH
            # colocated, an engine that shards the experts over its EP ranks receives only its own
            # experts' weights; apart, training rank 0 takes the whole model and passes it on
            rollout_ep = settings.layout.rollout.ep if colocated and ENGINES[settings.rollout.engine].expert_parallel else 1
            self.actor = ActorWorker(settings, self.rank, self.world_size, model_dir, platform.name, rollout_ep,
                                     make_room=self._sleep_rollout, weight_receivers=None if colocated else 1)
        if self.roles & Roles.ROLLOUT:
            self.rollout = RolloutWorker(settings, model_dir, platform.name, colocated=self.actor is not None)
        self.free_engine = settings.rollout.free_cache_engine
        if self.roles == Roles.BOTH:
            self.sync_weights()
        else:  # the weight group's settings, joined later (``join_weights``)
            self.weights_timeout_s = settings.weight_sync_timeout_s
            self.weights_backend = weight_backend(platform.name, settings.weight_sync_backend)
            if self.actor is not None:
                self.plan = TransferPlan.of(self.actor.exporter)
        return self._info(settings)

    def _info(self, settings: RankSettings) -> RankInfo:
        import ray

        if self.actor is None:  # a rollout rank of its own: where it sits in the rollout layout
            import torch.distributed as dist

            rank, size, tp = dist.get_rank(), dist.get_world_size(), settings.layout.rollout.tp
            return RankInfo(rank=rank, node_ip=ray.util.get_node_ip_address(), dp_rank=rank // tp, dp_size=size // tp,
                            tp_rank=rank % tp, pp_rank=0, first_of_replica=rank % tp == 0)
        from megatron.core import parallel_state as ps

        return RankInfo(
            rank=self.rank, node_ip=ray.util.get_node_ip_address(),
            dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
            first_of_replica=ps.get_tensor_model_parallel_rank() == 0
            and ps.get_pipeline_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0,
        )

    def _sleep_rollout(self) -> None:
        if self.rollout is not None and self.free_engine:
            self.rollout.sleep()  # the training state coming back needs the memory the engine holds

    # --- generation (the rollout role) -------------------------------------------------------

    @busy
    def run(self, calls: list[tuple[list[list[int]], list[int], SamplingParams, int]]) -> None:
        """Generate the calls, each (prompts, request ids, sampling, key), joined (``RolloutWorker.run``)."""
        if self.actor is not None:
            self.actor.offload()
        self.rollout.run([GenerationCall(*call) for call in calls])

    def result(self, key: int) -> Answer:
        """Call ``key``'s responses and generation seconds, as soon as they are ready."""
        return self.rollout.result(key)

    def pause(self) -> None:
        """Partial rollout: the ``run`` in progress stops after its current token (its calls not yet
        answered answer paused), those queued behind it answer held, until the next weights are in."""
        self.rollout.pause()

    def resume(self, key: int) -> Answer | None:
        """Generation ``key`` continued under the weights held now (None: nothing of it waits here)."""
        return self.rollout.resume(key)

    # --- passes (the actor role) -------------------------------------------------------------

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

    # --- weights from the actor to the engines -------------------------------------------------

    def transfer_plan(self) -> TransferPlan:
        """A training rank of a split run: what its weight group's broadcast carries."""
        return self.plan

    def join_weights(self, host: str, port: int, size: int, plan: TransferPlan | None = None) -> None:
        """Open the weight group of training rank 0 (the sender; it hosts the store) and the rollout
        ranks, which get the ``plan`` of what it will carry."""
        from recipe.rollout.broadcast import SENDER, WeightGroup

        member = SENDER if self.actor is not None else self.rank + 1
        self.weights = WeightGroup(host, port, member, size, self.weights_timeout_s, *self.weights_backend)
        if plan is not None:
            self.plan = plan

    @busy
    def sync_weights(self) -> dict[str, float] | None:
        """The actor's weights into the engine: in this process (colocated), sent to the rollout pool
        (a training rank), or received from the training ranks' send (a rollout rank)."""
        from recipe.rollout import broadcast, sync

        if self.rollout is None:
            return broadcast.send(self.actor.export(), self.plan, self.weights)
        if self.actor is None:
            sync.load_all(broadcast.receive(self.plan, self.weights), self.rollout.engine)
            self.rollout.release()
            return None
        return sync.sync_weights(self.actor.export(), self.rollout.engine)

    # --- what the driver reads ---------------------------------------------------------------

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
        """Load the actor's shard; colocated, the engine gets it at once (a split run's driver syncs
        the rollout pool once every training rank has loaded)."""
        restored = self.actor.load(directory)
        if self.rollout is not None:
            self.sync_weights()
        return restored

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

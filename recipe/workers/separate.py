"""A rollout pool of its own (``actor_rollout_ref.hybrid_engine=false``): the training ranks hold
the actor role alone (``TrainerWorker``), the rollout ranks the rollout role alone
(``RolloutRank``), each in a Ray actor of its own, on devices of their own, so that generation can
run while the trainer updates (``async_training.mode=one_step_off``).

The weights cross processes over a group of training rank 0 and the rollout ranks
(``recipe.rollout.broadcast``): every training rank streams its export, rank 0 broadcasts it. The
driver opens that group once (``join_weights`` on both sides at once) and calls ``sync_weights``
on both sides together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ray
import torch

from recipe.config import RecipeConfig
from recipe.rollout.base import SamplingParams
from recipe.workers.actor import ActorWorker
from recipe.workers.colocated import DTYPES, RankInfo, Worker, free_address, join_world, quiet_known_warnings
from recipe.workers.rollout import Answer, GenerationCall, RolloutWorker

if TYPE_CHECKING:
    from recipe.rollout.broadcast import TransferPlan


class TrainerWorker(Worker):
    """A training rank without an engine: the colocated ``Worker``'s passes, checkpoints and
    memory, with the weight sync sent to the rollout pool."""

    def setup(self, cfg: RecipeConfig, model_dir: str, master_addr: str, master_port: int) -> RankInfo:
        from recipe.rollout.broadcast import TransferPlan, weight_backend

        platform = self._join(cfg, master_addr, master_port)
        # rank 0 takes the whole model and passes it on; the rollout ranks hold every expert
        self.actor = ActorWorker(cfg, self.rank, self.world_size, model_dir, DTYPES[cfg.actor_rollout_ref.model.dtype],
                                 platform.name, 1, make_room=self._sleep_rollout, weight_receivers=1)
        self.plan = TransferPlan.of(self.actor.exporter)
        self.weights = None  # the weight group, on rank 0 once joined
        self.weights_timeout_s = cfg.async_training.weight_sync_timeout_s
        self.weights_backend = weight_backend(platform.name, cfg.async_training.weight_sync_backend)
        return self._info()

    def _sleep_rollout(self) -> None:
        pass  # no engine shares this device

    def transfer_plan(self) -> TransferPlan:
        return self.plan

    def join_weights(self, host: str, port: int, size: int) -> None:
        """Rank 0: open the weight group (it hosts the store) with the rollout ranks."""
        from recipe.rollout.broadcast import SENDER, WeightGroup

        self.weights = WeightGroup(host, port, SENDER, size, self.weights_timeout_s, *self.weights_backend)

    def sync_weights(self) -> dict[str, float]:
        from recipe.rollout.broadcast import send

        return send(self.actor.export(), self.plan, self.weights)

    def load(self, directory: str) -> bool:
        return self.actor.load(directory)  # the driver syncs the rollout pool once all ranks have loaded


class RolloutRank:
    """One rollout rank: its engine, in a process with no Megatron shard. The rollout ranks form a
    torch.distributed world of their own (the engine's: vLLM's external launcher runs its TP / DP /
    EP groups in it), apart from the training ranks'.
    ``pause`` runs in a concurrency group of its own, so that it reaches a ``run`` in progress, and
    ``result`` in another, so that a call's answer leaves while the others of its ``run`` go on;
    every other call runs one at a time, in the default group."""

    # ``result`` threads: one per generation batch in flight on the rank waits for its answer (more
    # than these queue until one is answered)
    concurrency_groups = {"pause": 1, "results": 32}

    def __init__(self, rank: int, world_size: int, threads: int):
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(threads)
        quiet_known_warnings()  # the config's imports reach megatron-core

    def address(self) -> tuple[str, int]:
        return free_address()

    def setup(self, cfg: RecipeConfig, model_dir: str, master_addr: str, master_port: int) -> RankInfo:
        """Join the rollout ranks' world and build the engine (random or initial weights until the
        first ``sync_weights``); where this rank sits in the rollout layout."""
        import ray
        import torch.distributed as dist

        from recipe.rollout.broadcast import weight_backend

        platform = join_world(cfg.layout.cluster.device, self.rank, self.world_size, master_addr, master_port)
        self.rollout = RolloutWorker(cfg, model_dir, DTYPES[cfg.actor_rollout_ref.rollout.dtype], platform.name,
                                     colocated=False)
        self.weights = self.plan = None
        self.weights_timeout_s = cfg.async_training.weight_sync_timeout_s
        self.weights_backend = weight_backend(platform.name, cfg.async_training.weight_sync_backend)
        rank, size, tp = dist.get_rank(), dist.get_world_size(), cfg.layout.rollout.tp
        return RankInfo(rank=rank, node_ip=ray.util.get_node_ip_address(), dp_rank=rank // tp, dp_size=size // tp,
                        tp_rank=rank % tp, pp_rank=0, first_of_replica=rank % tp == 0)

    def join_weights(self, host: str, port: int, size: int, plan: TransferPlan) -> None:
        from recipe.rollout.broadcast import WeightGroup

        self.weights = WeightGroup(host, port, self.rank + 1, size, self.weights_timeout_s, *self.weights_backend)
        self.plan = plan

    def run(self, calls: list[tuple[list[list[int]], list[int], SamplingParams, int]]) -> None:
        """Generate the calls, each (prompts, request ids, sampling, key), joined (``RolloutWorker.run``)."""
        self.rollout.run([GenerationCall(*call) for call in calls])

    @ray.method(concurrency_group="results")
    def result(self, key: int) -> Answer:
        """Call ``key``'s responses and generation seconds, as soon as they are ready."""
        return self.rollout.result(key)

    @ray.method(concurrency_group="pause")
    def pause(self) -> None:
        """Partial rollout: the ``run`` in progress stops after its current token (its calls not yet
        answered answer paused), those queued behind it answer held, until the next weights are in."""
        self.rollout.pause()

    def resume(self, key: int) -> Answer | None:
        """Generation ``key`` continued under the weights held now (None: nothing of it waits here)."""
        return self.rollout.resume(key)

    def sync_weights(self) -> None:
        """Receive the training ranks' broadcast into the engine (with their ``sync_weights``)."""
        from recipe.rollout.broadcast import receive
        from recipe.rollout.sync import load_all

        load_all(receive(self.plan, self.weights), self.rollout.engine)
        self.rollout.release()

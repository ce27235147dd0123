"""The actor role of one rank: its Megatron shard (and the reference model's when KL is on), the
passes the driver asks for (log-probs, update, routing drift), offload of the training state, its
checkpoint shard, and the weight export for the rollout engine.

Batches follow ``megatron_bridge.runtime.batch``. The passes, the export and the checkpoint run
collectives: every rank calls them together. Before a shard computes, whatever the layout's
offload flags sent to the host comes back; ``make_room`` first frees the device for it (colocated,
the rollout engine goes to sleep).
"""

from __future__ import annotations

import sys
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch

from megatron_bridge.runtime.batch import INPUT_IDS, ROUTED_EXPERTS
from megatron_bridge.runtime.offload import KINDS
from recipe.workers.settings import PassSizes, RankSettings

if TYPE_CHECKING:
    from megatron_bridge.moe.table import RoutingRecord
    from megatron_bridge.runtime.actor import MegatronActor
    from megatron_bridge.weights.export import WeightExporter


def _why_padded(use_remove_padding: bool) -> str:
    return (" (megatron's DotProductAttention cannot keep packed sequences apart: use_flash_attn=false)"
            if use_remove_padding else " (use_remove_padding=false)")


class ActorWorker:
    def __init__(self, settings: RankSettings, rank: int, world_size: int, model_dir: str, platform: str,
                 rollout_expert_parallel: int, make_room: Callable[[], None], weight_receivers: int | None = None):
        """Build and load the shards (torch.distributed must be up). The weights go to the rollout
        rank of each rank, experts split over ``rollout_expert_parallel`` of them (1: all to each);
        with ``weight_receivers`` only to the first that many ranks (``export.Routing``)."""
        from megatron_bridge.moe.routing import RoutingTap
        from megatron_bridge.plan.model_spec import load_model_spec
        from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
        from megatron_bridge.runtime.model import BuildOptions
        from megatron_bridge.weights.export import Routing, WeightExporter

        self.rank, self.world_size, self.make_room = rank, world_size, make_room
        self.settings = s = settings.actor
        self.train, self.device = settings.layout.train, settings.layout.cluster.device
        initialize_parallel(self.train, seed=settings.seed)
        spec = load_model_spec(model_dir)
        options = BuildOptions(params_dtype=s.dtype)
        self.actor = MegatronActor(spec, self.train, options, s.optim, platform, s.pack)
        self.actor.load_hf(model_dir)
        if rank == 0:  # what computes, once per run (Ray shows a worker's stderr on the driver's)
            chunk = s.loss.log_prob_chunk_size
            print(f"actor on {platform}: {self.actor.kernels.describe()}; log-probs and entropy: "
                  f"{f'chunks of up to {chunk} tokens' if chunk else 'one chunk a micro-batch'}"
                  f"{', fused (torch.compile)' if s.loss.fused_kernels else ''}; micro-batches: "
                  f"{'packed' if self.actor.packs else 'padded' + _why_padded(s.pack)}; "
                  f"optimizer: {self.actor.optimizer_path}", file=sys.stderr, flush=True)
        self.moves: dict[str, float] = {}  # offload metrics since the driver last read them
        self.save_queue = None  # megatron's queue of background saves (actor.checkpoint.async_save)
        self.saving_to = ""  # the directory of the save in progress
        if s.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.save_queue = AsyncCallsQueue()
        self.ref = None
        if s.with_reference:
            self.ref = MegatronActor(spec, self.train, options, None, platform, s.pack)
            self.ref.load_hf(model_dir)
        self.routing_tap = RoutingTap(self.actor.chunks, spec.moe_topk, self.train.sequence_parallel)
        self.actor.forward_context = self.routing_tap.micro_batch
        self.exporter = WeightExporter(
            self.actor.chunks, spec, Routing(world_size, spec.num_experts, rollout_expert_parallel, weight_receivers),
            bucket_mb=s.export_bucket_mb, dtype=s.dtype,
        )

    # --- the device: offload and back -------------------------------------------------------

    def offload(self) -> None:
        """Before the engine takes the device: the training state the layout's flags name leaves it."""
        t = self.train
        if not (t.param_offload or t.grad_offload or t.optimizer_offload):
            return
        for shard in (self.actor, self.ref):
            if shard is not None:
                stats = shard.offload(t.param_offload, t.grad_offload, t.optimizer_offload)
                self._count("timing_s/offload", stats["seconds"])
                for kind in KINDS:
                    self._count(f"perf/offload_bytes/{kind}", stats[kind])

    def _on_device(self, shard: MegatronActor) -> None:
        """``shard``'s training state back on the device, before anything computes with it."""
        if shard.host_copy.away:
            self.make_room()
            self._count("timing_s/onload", shard.onload()["seconds"])

    def _count(self, key: str, value: float) -> None:
        self.moves[key] = self.moves.get(key, 0.0) + value

    # --- passes -----------------------------------------------------------------------------

    def compute_log_probs(self, batch: dict[str, torch.Tensor], model: str,
                          replay: bool) -> tuple[torch.Tensor, RoutingRecord | None]:
        """Per-token log-probs [B, R] of the responses under the actor ("actor") or the reference
        ("ref"). The actor's pass also records its routing; with ``replay`` (R3) it replays the
        batch's ``routed_experts`` and records what its routers would have chosen."""
        if model == "ref":
            if self.ref is None:
                raise RuntimeError("no reference model: it is built only with actor_rollout_ref.actor.use_kl_loss=true "
                                   "or algorithm.use_kl_in_reward=true")
            self._on_device(self.ref)
            return self._log_probs(self.ref, batch, self.settings.ref_log_probs), None
        self._on_device(self.actor)
        _check_replay(batch, replay)
        rows, width = batch[INPUT_IDS].shape
        with self.routing_tap.recording(rows, width, capture=True, replay=replay, training=False) as out:
            log_probs = self._actor_log_probs(batch)
        return log_probs, out.record

    def sample_routing(self, batch: dict[str, torch.Tensor]) -> RoutingRecord:
        """The actor's own routing of ``batch`` now (after the update): a forward pass without replay."""
        self._on_device(self.actor)
        rows, width = batch[INPUT_IDS].shape
        with self.routing_tap.recording(rows, width, capture=True, replay=False, training=False) as out:
            self._actor_log_probs(batch)
        return out.record

    def _actor_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The actor's pass as the old-log-prob pass runs."""
        return self._log_probs(self.actor, batch, self.settings.old_log_probs)

    def _log_probs(self, shard: MegatronActor, batch: dict[str, torch.Tensor], sizes: PassSizes) -> torch.Tensor:
        from loss.megatron_hook import log_prob_func

        loss = self.settings.loss
        loss_fn = partial(log_prob_func, loss.temperature, False, log_prob_chunk_size=loss.log_prob_chunk_size,
                          fused_kernels=loss.fused_kernels)
        micro = _fitting_micro_batch(len(batch[INPUT_IDS]), sizes.micro_batch_rows)
        return shard.forward_only(batch, micro, loss_fn, sizes.max_tokens)["log_probs"].cpu()

    def update(self, batch: dict[str, torch.Tensor], mini_batch_rows: int,
               replay: bool) -> tuple[list[dict[str, float]], RoutingRecord]:
        """PPO epochs over this DP rank's rows in mini-batches of ``mini_batch_rows``; with
        ``replay`` every training forward (and recompute) replays the batch's ``routed_experts``."""
        from loss.megatron_hook import policy_loss_func

        self._on_device(self.actor)
        s = self.settings
        _check_replay(batch, replay)
        rows, width = batch[INPUT_IDS].shape
        with self.routing_tap.recording(rows, width, capture=False, replay=replay, training=True) as out:
            steps = self.actor.update(batch, mini_batch_rows, s.update.micro_batch_rows, s.ppo_epochs,
                                      partial(policy_loss_func, s.loss), s.update.max_tokens)
        return steps, out.record

    # --- weights out ------------------------------------------------------------------------

    def export(self) -> WeightExporter:
        """The exporter of the actor's weights, with them on the device (``stream()`` them)."""
        self._on_device(self.actor)
        return self.exporter

    def weights_fingerprint(self) -> tuple[float, float]:
        """Sum and sum of squares (float64) of this rank's actor parameters: equal between runs
        that start from the same weights in the same layout."""
        self._on_device(self.actor)
        params = [p.detach().double() for chunk in self.actor.chunks for p in chunk.parameters()]
        return float(sum(p.sum() for p in params)), float(sum(p.square().sum() for p in params))

    def memory(self) -> dict[str, float]:
        """Peak memory, and what offload moved since the last call: ``timing_s/offload``,
        ``timing_s/onload`` and ``perf/offload_bytes/<params|grads|optimizer>`` (bytes freed on the
        device; grads are freed, not copied). The driver reads this once per step."""
        from recipe.tracking.metrics import memory_metrics

        moves, self.moves = self.moves, {}
        return {**memory_metrics(self.device), **moves}

    # --- checkpoint shard -------------------------------------------------------------------

    def save(self, directory: str) -> None:
        """This rank's part of the reshardable checkpoint in ``directory``
        (``megatron_bridge.runtime.checkpoint``); with ``actor.checkpoint.async_save`` the files
        are written in the background until ``finish_save``."""
        from megatron_bridge.runtime import checkpoint

        self._on_device(self.actor)
        checkpoint.save(self.actor, directory, self.save_queue)
        self.saving_to = directory

    def finish_save(self) -> None:
        """Wait for the background save, with every rank (a no-op when saves are synchronous)."""
        from megatron_bridge.runtime import checkpoint

        if self.save_queue is not None:
            checkpoint.finish_saves(self.save_queue, self.actor, self.saving_to)

    def load(self, directory: str) -> bool:
        """Load a checkpoint written under any layout; whether the RNG states came back too."""
        from megatron_bridge.runtime import checkpoint

        self._on_device(self.actor)
        return checkpoint.load(self.actor, directory)


def _check_replay(batch: dict[str, torch.Tensor], replay: bool) -> None:
    if replay and ROUTED_EXPERTS not in batch:
        raise ValueError(f"routing replay needs the experts to replay: the batch has no {ROUTED_EXPERTS!r}")


def _fitting_micro_batch(rows: int, wanted: int) -> int:
    """The largest micro-batch <= ``wanted`` that divides ``rows`` (the actor splits evenly)."""
    size = max(1, min(wanted, rows))
    while rows % size:
        size -= 1
    return size

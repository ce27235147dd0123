"""One training rank as a Ray actor: its Megatron shard (actor, and the reference model when KL is
on), the colocated rollout engine, and the weight stream between them.

The driver (``recipe.trainer``) calls the same method on every worker with that worker's share of
the data; the methods that run collectives (log-probs, update, weight sync, checkpoint) must be
called on all workers together. Batches follow ``megatron_bridge.runtime.actor``'s convention.

The device alternates between the engine and the Megatron shards: ``generate`` offloads the
training state the layout names (``param_offload``, ``grad_offload``, ``optimizer_offload``; the
reference model's weights under ``param_offload``; it has no grads or optimizer) before it wakes the engine, and every
method that computes with a shard puts the engine to sleep and brings that shard back first.
"""

from __future__ import annotations

import os
import random
import socket
import warnings
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron_bridge.runtime.offload import KINDS
from recipe.config import RecipeConfig
from recipe.rollout.base import Generation, SamplingParams

if TYPE_CHECKING:
    from megatron_bridge.moe.table import RoutingRecord

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
CHECKPOINT_FILE = "rank_{rank:05d}.pt"


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
    rollout_dp_rank: int
    first_of_rollout_group: bool


def free_address() -> tuple[str, int]:
    """This node's IP and a free TCP port on it (rank 0 hosts the torch.distributed rendezvous)."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


class Worker:
    def __init__(self, rank: int, world_size: int, threads: int):
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(threads)
        # known, harmless warnings of megatron-core 0.12.1 on this torch, once per call otherwise
        for message in (".*(Transformer Engine|Apex).*", r".*torch\.distributed\.\w+` is deprecated.*",
                        ".*is not a leaf Tensor is being accessed.*"):
            warnings.filterwarnings("ignore", message=message)

    def address(self) -> tuple[str, int]:
        return free_address()

    # --- set-up ------------------------------------------------------------------------------

    def setup(self, cfg: RecipeConfig, model_dir: str, master_addr: str, master_port: int) -> RankInfo:
        """Join torch.distributed, build and load the shards, start the engine and give it the
        actor's weights (so the engine always serves exactly what the actor holds)."""
        import ray
        from loss.megatron_hook import ActorLossConfig
        from megatron.core import parallel_state as ps

        from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
        from megatron_bridge.weights.export import Routing, WeightExporter
        from megatron_bridge.runtime.model import BuildOptions
        from megatron_bridge.plan.model_spec import load_model_spec
        from megatron_bridge.runtime.platform import activate, init_distributed
        from megatron_bridge.moe.routing import RoutingTap

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        self.cfg = cfg
        layout, arr = cfg.layout, cfg.actor_rollout_ref
        platform = activate(layout.cluster.device)
        init_distributed(platform)
        initialize_parallel(layout.train, seed=cfg.trainer.seed)

        spec = load_model_spec(model_dir)
        dtype = DTYPES[arr.model.dtype]
        options = BuildOptions(params_dtype=dtype)
        self.actor = MegatronActor(spec, layout.train, options, arr.actor.optim, platform.name)
        self.actor.load_hf(model_dir)
        self.moves: dict[str, float] = {}  # offload metrics since the driver last read them
        self.ref = None
        if cfg.needs_reference:
            self.ref = MegatronActor(spec, layout.train, options, None, platform.name)
            self.ref.load_hf(model_dir)
        self.routing = RoutingTap(self.actor.chunks, spec.moe_topk, layout.train.sequence_parallel)
        self.actor.forward_context = self.routing.micro_batch

        a = arr.actor
        self.loss_config = ActorLossConfig(
            loss_mode=a.policy_loss.loss_mode, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
            clip_ratio_c=a.clip_ratio_c, loss_agg_mode=a.loss_agg_mode, use_kl_loss=a.use_kl_loss,
            kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, entropy_coeff=a.entropy_coeff,
            temperature=arr.rollout.temperature,
        )

        self.engine = self._make_engine(model_dir, dtype, platform.name)
        rollout_ep = layout.rollout.ep if cfg.actor_rollout_ref.rollout.name == "vllm" else 1
        self.exporter = WeightExporter(
            self.actor.chunks, spec, Routing(self.world_size, spec.num_experts, rollout_ep),
            bucket_mb=arr.rollout.update_weights_bucket_megabytes, dtype=dtype,
        )
        self.sync_weights()

        rollout_tp = layout.rollout.tp
        return RankInfo(
            rank=self.rank, node_ip=ray.util.get_node_ip_address(),
            dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
            first_of_replica=ps.get_tensor_model_parallel_rank() == 0
            and ps.get_pipeline_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0,
            rollout_dp_rank=self.rank // rollout_tp, first_of_rollout_group=self.rank % rollout_tp == 0,
        )

    def _make_engine(self, model_dir: str, dtype: torch.dtype, platform_name: str):
        cfg = self.cfg
        if cfg.actor_rollout_ref.rollout.name == "hf":
            from recipe.rollout.hf_engine import HFEngine

            device = "cpu" if platform_name == "cpu" else torch.device(platform_name, torch.cuda.current_device())
            return HFEngine(model_dir, dtype=dtype, device=device,
                            return_routed_experts=cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay)
        from recipe.rollout.vllm_engine import VLLMEngine

        data = cfg.data
        return VLLMEngine(model_dir, cfg.layout.rollout, platform=platform_name, dtype=dtype,
                          max_model_len=data.max_prompt_length + data.max_response_length, seed=cfg.trainer.seed,
                          return_routed_experts=cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay,
                          engine_kwargs=cfg.actor_rollout_ref.rollout.engine_kwargs.get("vllm"))

    # --- one step ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], request_ids: list[int], params: SamplingParams) -> Generation:
        self._offload()
        self.engine.wake_up()
        return self.engine.generate(prompts, params, request_ids=request_ids)

    def _offload(self) -> None:
        """Before the engine takes the device: the training state the layout's flags name leaves it."""
        t = self.cfg.layout.train
        if not (t.param_offload or t.grad_offload or t.optimizer_offload):
            return
        for shard in (self.actor, self.ref):
            if shard is not None:
                stats = shard.offload(t.param_offload, t.grad_offload, t.optimizer_offload)
                self._count("timing_s/offload", stats["seconds"])
                for kind in KINDS:
                    self._count(f"perf/offload_bytes/{kind}", stats[kind])

    def _on_device(self, shard) -> None:
        """``shard``'s training state back on the device, before anything computes with it."""
        if shard.host_copy.away:
            self.engine.sleep()  # the state needs the memory the engine holds
            self._count("timing_s/onload", shard.onload()["seconds"])

    def _count(self, key: str, value: float) -> None:
        self.moves[key] = self.moves.get(key, 0.0) + value

    def compute_log_probs(self, batch: dict[str, torch.Tensor], model: str) -> tuple[torch.Tensor, RoutingRecord | None]:
        """Per-token log-probs [B, R] of the responses under the actor ("actor") or the reference
        ("ref"). The actor's pass also records its routing (with ``routed_experts`` in the batch,
        R3, it replays those and records what its routers would have chosen)."""
        from megatron_bridge.runtime.batch import ROUTED_EXPERTS

        self.engine.sleep()
        if model == "ref":
            if self.ref is None:
                raise RuntimeError("no reference model: it is built only with actor_rollout_ref.actor.use_kl_loss=true "
                                   "or algorithm.use_kl_in_reward=true")
            self._on_device(self.ref)
            batch = {k: v for k, v in batch.items() if k != ROUTED_EXPERTS}
            ref = self.cfg.actor_rollout_ref.ref
            return self._log_probs(self.ref, batch, ref.log_prob_micro_batch_size_per_gpu,
                                   self._budget(ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu)), None
        self._on_device(self.actor)
        rows, width = batch["input_ids"].shape
        with self.routing.recording(rows, width, capture=True, replay=ROUTED_EXPERTS in batch, training=False) as out:
            log_probs = self._actor_log_probs(batch)
        return log_probs, out.record

    def sample_routing(self, batch: dict[str, torch.Tensor]) -> RoutingRecord:
        """The actor's own routing of ``batch`` now (after the update): a forward pass without replay."""
        self.engine.sleep()
        self._on_device(self.actor)
        rows, width = batch["input_ids"].shape
        with self.routing.recording(rows, width, capture=True, replay=False, training=False) as out:
            self._actor_log_probs(batch)
        return out.record

    def _actor_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The actor's pass as the old-log-prob pass runs (verl's ``rollout.log_prob_*`` keys)."""
        r = self.cfg.actor_rollout_ref.rollout
        return self._log_probs(self.actor, batch, r.log_prob_micro_batch_size_per_gpu,
                               self._budget(r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu))

    def _log_probs(self, shard, batch: dict[str, torch.Tensor], micro: int, max_tokens: int | None) -> torch.Tensor:
        from loss.megatron_hook import log_prob_func

        loss_fn = partial(log_prob_func, self.loss_config.temperature, False)
        out = shard.forward_only(batch, _fitting_micro_batch(len(batch["input_ids"]), micro), loss_fn, max_tokens)
        return out["log_probs"].cpu()

    def _budget(self, dynamic: bool, per_gpu: int) -> int | None:
        """A pass's token budget per micro-batch with dynamic batch size (verl: x context parallel), else None."""
        return per_gpu * self.cfg.layout.train.cp if dynamic else None

    def update(self, batch: dict[str, torch.Tensor], mini_batch_rows: int) -> tuple[list[dict[str, float]], RoutingRecord]:
        """PPO epochs over this DP rank's rows in mini-batches of ``mini_batch_rows``; with
        ``routed_experts`` in the batch every training forward (and recompute) replays them."""
        from loss.megatron_hook import policy_loss_func
        from megatron_bridge.runtime.batch import ROUTED_EXPERTS

        self.engine.sleep()
        self._on_device(self.actor)
        a = self.cfg.actor_rollout_ref.actor
        rows, width = batch["input_ids"].shape
        with self.routing.recording(rows, width, capture=False, replay=ROUTED_EXPERTS in batch, training=True) as out:
            steps = self.actor.update(batch, mini_batch_rows, a.ppo_micro_batch_size_per_gpu, a.ppo_epochs,
                                      partial(policy_loss_func, self.loss_config),
                                      self._budget(a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu))
        return steps, out.record

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
        from recipe.metrics import memory_metrics

        moves, self.moves = self.moves, {}
        return {**memory_metrics(self.cfg.layout.cluster.device), **moves}

    def sync_weights(self) -> dict[str, float]:
        from recipe.rollout.sync import sync_weights

        self._on_device(self.actor)
        return sync_weights(self.exporter, self.engine)

    # --- checkpoints -------------------------------------------------------------------------

    def save(self, directory: str) -> None:
        """This rank's shard, optimizer, LR schedule and RNG states, in ``directory`` (which the
        driver creates and later renames into place)."""
        self._on_device(self.actor)
        state = {
            "actor": self.actor.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            "world_size": self.world_size,
            "layout": self.cfg.layout,
        }
        torch.save(state, os.path.join(directory, CHECKPOINT_FILE.format(rank=self.rank)))

    def load(self, directory: str) -> None:
        path = os.path.join(directory, CHECKPOINT_FILE.format(rank=self.rank))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint {directory} has no file for rank {self.rank} ({path})")
        state = torch.load(path, weights_only=False)
        if state["layout"].train != self.cfg.layout.train or state["world_size"] != self.world_size:
            raise ValueError(
                f"checkpoint {directory} was written with {state['world_size']} ranks and train layout "
                f"{state['layout'].train}; this run has {self.world_size} ranks and {self.cfg.layout.train}. "
                "Resume with the same parallel layout (or start fresh: trainer.resume_mode=disable)"
            )
        self._on_device(self.actor)
        self.actor.load_state_dict(state["actor"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        self.sync_weights()

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _fitting_micro_batch(rows: int, wanted: int) -> int:
    """The largest micro-batch <= ``wanted`` that divides ``rows`` (the actor splits evenly)."""
    size = max(1, min(wanted, rows))
    while rows % size:
        size -= 1
    return size

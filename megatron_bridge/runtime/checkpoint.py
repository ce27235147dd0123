"""One rank's part of a reshardable checkpoint on megatron-core's ``dist_checkpointing`` (the
``torch_dist`` backend, fully parallel save and load over the data-parallel ranks).

What a checkpoint holds: the model chunks' and the DistributedOptimizer's sharded state dicts
(fp32 main parameters and Adam moments of every parameter, in the model's space), the LR schedule,
the actor's step count, and each rank's RNG states. Every tensor is stored as the global tensor
its shards belong to (megatron names; layers and experts are leading axes), so a checkpoint loads
under any TP / PP / VPP / EP / ETP / DP layout of the same model.

RNG states are per rank: they are restored when the checkpoint was written by the same number of
ranks in the same training layout. Under another layout a rank has no counterpart, so each keeps
the states seeded at start (``trainer.seed``); the recipe's rollouts draw from per-request seeds
and the tiny model has no dropout, so nothing the recipe computes depends on them.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_bridge.errors import ConfigError, UserError
from megatron_bridge.weights.dist_checkpoint import CheckpointFilesError, check_complete

if TYPE_CHECKING:
    from megatron_bridge.runtime.actor import MegatronActor

RNG_KEY = "rng_state"
MODEL_SHAPE_KEY = "model_shape"
MODEL_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "num_experts",
                      "moe_ffn_hidden_size", "vocab_size", "tie_word_embeddings")
OPTIMIZER_KEY = "optimizer"


def save(actor: "MegatronActor", directory: str, queue=None) -> None:
    """Write this rank's part of the checkpoint into ``directory`` (every rank calls it together).

    With ``queue`` (megatron's ``AsyncCallsQueue``) a forked process writes the tensor files while
    training goes on: the call returns once the state is staged (copied to the host by megatron's
    preload; on the CPU the fork's copy-on-write pages keep it as it was), and ``finish_saves``
    completes the checkpoint (its metadata.json last, so until then it is incomplete)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    numpy2_compat()
    _writers_report_to_a_queue_that_dies_with_this_process()
    state, optimizers = sharded_state_dict(actor, loading=False)
    state.update(_layout(actor), steps=actor.steps)
    if optimizers is not None:
        state.update(scheduler=actor.scheduler.state_dict(), adam_step=optimizers.step())
    state[RNG_KEY] = _rng_object(_rng_state())
    os.makedirs(directory, exist_ok=True)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), _parallel_group())
    with _writing(actor, directory):
        request = dist_checkpointing.save(state, directory, strategy, async_sharded_save=queue is not None)
    if queue is not None:
        queue.schedule_async_request(request)


_queue_owner: list = []  # the manager behind megatron's results queue, alive as long as this process


def _writers_report_to_a_queue_that_dies_with_this_process() -> None:
    """megatron's file writers report through a queue of a ``multiprocessing`` manager that it forks
    on the first save and never ends: forked, the manager holds this process's sockets, so when this
    process dies its peers (Ray's raylet) do not see it go for minutes, and the manager outlives the
    run. Ours instead: the same manager, which the kernel ends when this process ends (Linux)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(initializer=_end_with_parent, initargs=(os.getpid(),))
    _queue_owner.append(manager)
    filesystem_async._results_queue = manager.Queue()


def _end_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the line above took effect
        os._exit(0)


def finish_saves(queue, actor: "MegatronActor", directory: str) -> None:
    """Wait until every rank's pending saves (into ``directory``) are written, then finalize them
    (collective)."""
    with _writing(actor, directory):
        queue.maybe_finalize_async_calls(blocking=True)


class CheckpointWriteError(UserError, OSError):
    """Writing a checkpoint's files failed: a full disk, a quota, a file size limit."""


# How a failed write reaches a rank: an OSError, or torch.save's zip writer / megatron's writer
# processes as a RuntimeError without the errno ("unexpected pos 704 vs 598", "Worker failure").
_WRITE_FAILURES = ("No space left", "Disk quota", "File too large", "inline_container", "unexpected pos",
                   "Worker failure")


@contextmanager
def _writing(actor: "MegatronActor", directory: str):
    """A failed write as one line naming the directory, its file system's free space, what a
    checkpoint of this model takes, and the fix."""
    from megatron_bridge.plan.memory import checkpoint_bytes

    try:
        yield
    except (OSError, RuntimeError) as e:
        if not isinstance(e, OSError) and not any(s in str(e) for s in _WRITE_FAILURES):
            raise
        weight_bytes = next(actor.chunks[0].parameters()).element_size()
        total, _ = checkpoint_bytes(actor.spec, torch.distributed.get_world_size(), weight_bytes)
        free = shutil.disk_usage(next(p for p in (Path(directory), *Path(directory).parents) if p.exists())).free
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointWriteError(
            f"writing checkpoint {directory} failed ({cause}): its file system has {free / 2**30:.2f} GiB free and a "
            f"checkpoint of this model takes about {total / 2**30:.2f} GiB (all ranks); free space or give "
            "trainer.default_local_dir a larger disk (max_actor_ckpt_to_keep bounds how many are kept), then re-run: "
            "it resumes from the last complete checkpoint") from e


def load(actor: "MegatronActor", directory: str) -> bool:
    """Load the checkpoint in ``directory`` into this rank's shards, whatever layout wrote it.
    Returns whether the RNG states were restored (same ranks and layout, see the module's notes)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    numpy2_compat()
    check_complete(directory)
    common = dist_checkpointing.load_common_state_dict(Path(directory))
    refuse = "; resume it with the model it was written for, or start afresh (trainer.resume_mode=disable)"
    written_for, here = common.get(MODEL_SHAPE_KEY), _model_shape(actor)
    if written_for is not None and written_for != here:  # checkpoints from before the key: megatron's checks below
        differ = [f"{k} {written_for.get(k)} there, {here[k]} here" for k in here if written_for.get(k) != here[k]]
        raise ConfigError(f"checkpoint {directory} does not fit this model: {'; '.join(differ)}{refuse}")
    layout = _layout(actor)
    same_layout = all(common.get(k) == layout[k] for k in ("world_size", "train_layout"))
    state, optimizers = sharded_state_dict(actor, loading=True)
    if same_layout:
        state[RNG_KEY] = _rng_object(None)
    strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(directory), _parallel_group())
    try:
        loaded = dist_checkpointing.load(state, directory, strategy)
    except (CheckpointingException, CheckpointException) as e:
        # torch's loader gathers every rank's failure (CheckpointException); megatron's own checks of
        # the stored shards against this model's (CheckpointingException) mean another model, as
        # does a tensor this model has and the checkpoint lacks (another depth)
        rank, failure = (0, e) if isinstance(e, CheckpointingException) else _first_failure(e)
        if isinstance(failure, CheckpointingException) or str(failure).startswith("Missing key in checkpoint"):
            raise ConfigError(f"checkpoint {directory} does not fit this model: {str(failure).splitlines()[0]}"
                              f"{refuse}") from e
        raise CheckpointFilesError(
            f"checkpoint {directory} is damaged: reading its tensors failed on rank {rank} "
            f"({type(failure).__name__}: {failure}); resume from an earlier checkpoint "
            f"(trainer.resume_mode=resume_path) or move this one away") from e
    for chunk, weights in zip(actor.chunks, loaded["model"], strict=True):
        chunk.module.load_state_dict(weights, strict=True)
    actor.steps = loaded["steps"]
    if actor.optimizer is not None:
        optimizers.load(loaded[OPTIMIZER_KEY], loaded["adam_step"])
        actor.scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_state(loaded[RNG_KEY])
    return same_layout


def _first_failure(e: CheckpointException) -> tuple[int, BaseException]:
    rank, (failure, _) = sorted(e.failures.items())[0]
    return rank, failure


def sharded_state_dict(actor: "MegatronActor", loading: bool) -> tuple[dict, "_OptimizerState | None"]:
    """The model chunks' sharded state dicts (each under its virtual pipeline stage) and the
    optimizer's tensors, which refer to them."""
    model = []
    for stage, chunk in enumerate(actor.chunks):
        with _virtual_stage(actor.train.vpp, stage):
            model.append(chunk.module.sharded_state_dict())
    state = {"model": model}
    optimizers = None
    if actor.optimizer is not None:
        optimizers = _OptimizerState(actor.optimizer, state, loading)
        state[OPTIMIZER_KEY] = optimizers.tensors
    return state, optimizers


class _OptimizerState:
    """The DistributedOptimizer's state in megatron's ``fully_sharded_model_space`` form, stored
    so that it loads under any EP: how many optimizers megatron chains depends on the layout
    (the experts get their own when EP > 1) and its ChainedOptimizer prefixes each member's keys
    with its position. Here the tensors go into the checkpoint under their own names (each
    parameter belongs to exactly one member) and the members' non-tensor state, which is the
    same for all of them but Adam's step, is rebuilt from the loading optimizer."""

    def __init__(self, optimizer, model_state: dict, loading: bool):
        from megatron.core.dist_checkpointing.mapping import ShardedBase

        from megatron_bridge.runtime.actor import _optimizers

        self.members = _optimizers(optimizer)
        self.states = [o.sharded_state_dict(model_state, is_loading=loading) for o in self.members]
        # (the dict holding a tensor, its key there) for every tensor of every member
        self.slots = [(entry, name) for s in self.states for entry in s["param_state"].values()
                      for name, value in entry.items() if isinstance(value, ShardedBase)]
        self.tensors = {i: entry[name] for i, (entry, name) in enumerate(self.slots)}

    def step(self) -> float | None:
        steps = {g.get("step") for s in self.states for g in s["optimizer"]["param_groups"]}
        if len(steps) != 1:
            raise ValueError(f"the optimizers disagree on Adam's step: {sorted(map(str, steps))}")
        return steps.pop()

    def load(self, tensors: dict, step: float | None) -> None:
        for i, (entry, name) in enumerate(self.slots):
            entry[name] = tensors[i]
        for member, state in zip(self.members, self.states):
            for group in state["optimizer"]["param_groups"]:
                if step is not None:
                    group["step"] = step
            member.load_state_dict(state)


def _layout(actor: "MegatronActor") -> dict:
    return {"world_size": torch.distributed.get_world_size(), "train_layout": actor.train.layout_only,
            MODEL_SHAPE_KEY: _model_shape(actor)}


def _model_shape(actor: "MegatronActor") -> dict:
    """What sets the checkpoint's tensor shapes. Megatron checks most shapes itself, but lets the
    embedding and output layer differ (their padded vocabulary depends on TP) and loads the overlap,
    so another vocabulary or expert count would load without a word."""
    return {field: getattr(actor.spec, field) for field in MODEL_SHAPE_FIELDS}


@contextmanager
def _virtual_stage(vpp: int | None, stage: int):
    """megatron names a chunk's layers by the virtual pipeline rank set in its parallel state."""
    from megatron.core import parallel_state as ps

    if not vpp:
        yield
        return
    before = ps.get_virtual_pipeline_model_parallel_rank()
    ps.set_virtual_pipeline_model_parallel_rank(stage)
    try:
        yield
    finally:
        ps.set_virtual_pipeline_model_parallel_rank(before)


def _parallel_group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True)


def _rng_object(data):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return ShardedObject(RNG_KEY, data, (world,), (rank,), replica_id=0)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def numpy2_compat() -> None:
    # megatron-core 0.12.1's sharding validation calls np.product, which NumPy 2 removed.
    if not hasattr(np, "product"):
        np.product = np.prod

"""Reshardable checkpoints (megatron_bridge.runtime.checkpoint): a checkpoint written under EP2
after one update loads under another layout (TP2, DP2, PP2 with VPP2; on 4 ranks PP2 x VPP2 x EP2;
one written under CP2 on 1 rank)
and the next update there matches the one after it under EP2 (loss, grad norm and new weights
within fp32 rounding, so weights, Adam moments and step came back); one written under DP2 loads
under EP2; under the same layout bit for bit, RNG states included. An incomplete or damaged
checkpoint is refused by name; the planner's checkpoint size matches the files."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from functools import partial

import pytest
import torch

from megatron_bridge.plan.layout import TrainParallel
from megatron_bridge.tiny_model import save_tiny_checkpoint
from tests.distributed import run_ranks
from tests.numerics import rounding
from tests.test_actor_update import LOSSES, OPTIM, assemble, make_batch, max_grad, tolerances

WRITER = {"ep": 2, "etp": 1}
READERS = {  # name: train layout on 2 ranks
    "ep2_same": WRITER,
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "dp2": {},
    "pp2_vpp2": {"pp": 2, "vpp": 2},
}
MICRO = 2


def _steps(rank, world_size, checkpoint, batches, train_kwargs, directory, save, out_prefix, async_save=False):
    """One update and a save (``save``; written in the background during the next update with
    ``async_save``), or a load; then the next update. Its metrics, the weights it gives (HF
    slices), a draw from each RNG afterwards, and how long the save blocked."""
    import time

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    import numpy as np
    from megatron.core import parallel_state as ps

    from loss.megatron_hook import policy_loss_func
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime import checkpoint as dist_checkpoint
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.weights.export import local_hf_slices

    train = TrainParallel(**train_kwargs)
    initialize_parallel(train)
    spec = load_model_spec(checkpoint)
    actor = MegatronActor(spec, train, BuildOptions(params_dtype=torch.float32), OptimConfig(**OPTIM), "cpu")
    actor.load_hf(checkpoint)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

    def update(batch):
        rows = len(batch["input_ids"]) // dp
        mine = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
        return actor.train_step(mine, MICRO, partial(policy_loss_func, LOSSES["gspo"]), None)

    restored, queue, blocked = None, AsyncCallsQueue() if async_save else None, None
    if save:
        update(batches[0])
        start = time.perf_counter()
        dist_checkpoint.save(actor, directory, queue)
        blocked = time.perf_counter() - start
    else:
        restored = dist_checkpoint.load(actor, directory)
    rng = [torch.rand(1).item(), random.random(), float(np.random.rand())]
    metrics = update(batches[1])
    if queue is not None:
        assert not os.path.exists(os.path.join(directory, "metadata.json"))  # written when finished
        dist_checkpoint.finish_saves(queue, actor, directory)
    torch.save([(n, r, c, t.clone()) for n, r, c, t in local_hf_slices(actor.chunks, spec)],
               f"{out_prefix}_gspo_rank{rank}.pt")
    return {**metrics, "max_grad": max_grad(actor), "steps": actor.steps, "restored": restored, "rng": rng,
            "max_weight": max(float(p.abs().max()) for c in actor.chunks for p in c.parameters()), "blocked": blocked,
            "adam": _adam_steps(actor)}


def _adam_steps(actor) -> list:
    """What steps the optimizer, and Adam's step of every parameter as [device, dtype, value]: a
    tensor of each parameter's own (torch's Adam increments each in place). Lists: they come back
    from the ranks as JSON."""
    from megatron_bridge.runtime.actor import _optimizers

    steps = [s["step"] for o in _optimizers(actor.optimizer) for s in o.optimizer.state.values()]
    assert len({id(t) for t in steps}) == len(steps), "parameters share one step tensor"
    return [actor.optimizer_path, [list(s) for s in sorted({(t.device.type, str(t.dtype), float(t)) for t in steps})]]


def _write(tmp_path_factory, layout):
    """The tiny model, two batches, the checkpoint written under ``layout`` (2 ranks) after the
    first update, that layout's continuation (the second update) and the weights it gives."""
    tmp = tmp_path_factory.mktemp("writer")
    model = save_tiny_checkpoint(tmp / "hf", seed=1)
    batches = [make_batch(model, seed) for seed in (0, 1)]
    results = run_ranks(_steps, 2, tmp, model, batches, layout, str(tmp / "ckpt"), True, str(tmp / "w"))
    return model, batches, tmp / "ckpt", results, assemble(str(tmp / "w"), "gspo", 2)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return _write(tmp_path_factory, WRITER)


def _resume(written, tmp, layout, world_size=2):
    model, batches, directory = written[:3]
    results = run_ranks(_steps, world_size, tmp, model, batches, layout, str(directory), False, str(tmp / "w"))
    return results, assemble(str(tmp / "w"), "gspo", world_size)


def _assert_continues(written, results, weights):
    """The resumed second update matches the writer's: metrics and new weights within fp32 rounding."""
    reference, ref_weights = written[3:]
    ref = reference[0]
    assert ref["actor/skipped"] == 0 and ref["steps"] == 2
    tolerance = _tolerances(written)
    # torch's AdamW on its fused kernel (this CPU has one), each parameter's step restored and stepped to 2
    assert ref["adam"] == ["torch AdamW (fused kernel)", [["cpu", "torch.float32", 2.0]]]
    for got in results:
        assert got["steps"] == 2 and got["restored"] is False and got["adam"] == ref["adam"]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/entropy", "actor/ppo_kl",
                    "actor/lr"):
            assert got[key] == pytest.approx(ref[key], rel=0, abs=tolerance[key]), key
    assert weights.keys() == ref_weights.keys()
    for name, tensor in ref_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=tolerance["weight"], msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.numerics
def test_resume_under_another_layout_continues_the_run(written, tmp_path, reader):
    results, weights = _resume(written, tmp_path, READERS[reader])
    if reader == "ep2_same":  # bit for bit, and the RNG draws too
        assert results == [{**r, "restored": True, "blocked": None} for r in written[3]]
        for name, tensor in written[4].items():
            assert torch.equal(weights[name], tensor), name
        return
    _assert_continues(written, results, weights)


@pytest.mark.slow
@pytest.mark.numerics
def test_resume_of_a_dp2_checkpoint_under_ep2(tmp_path_factory, tmp_path):
    """Dense experts (one optimizer) written, expert-parallel ones (megatron chains a second
    optimizer for them) read."""
    written_dp2 = _write(tmp_path_factory, {})
    _assert_continues(written_dp2, *_resume(written_dp2, tmp_path, WRITER))


@pytest.mark.slow
@pytest.mark.numerics
def test_resume_of_a_cp2_checkpoint_on_one_rank(tmp_path_factory, tmp_path):
    """Context parallel splits sequences, not weights: written by 2 ranks under CP2 (each holding
    half of every sequence and the whole model), read by 1 rank under CP1."""
    written_cp2 = _write(tmp_path_factory, {"cp": 2})
    _assert_continues(written_cp2, *_resume(written_cp2, tmp_path, {}, world_size=1))


@pytest.mark.slow
@pytest.mark.numerics
def test_resume_on_four_ranks_with_virtual_pipeline_stages(written, tmp_path):
    """Written by 2 ranks under EP2, read by 4 under PP2 x VPP2 x EP2 (DP2): more ranks than wrote it."""
    _assert_continues(written, *_resume(written, tmp_path, {"pp": 2, "vpp": 2, "ep": 2}, world_size=4))


def _tolerances(written) -> dict[str, float]:
    """The second update's metrics (tests.test_actor_update.tolerances) and its new weights: Adam
    moves a weight by lr * m / (sqrt(v) + eps), whose slope in the gradient is at most lr / eps."""
    model, batches, _, reference, _ = written
    ref = reference[0]
    tolerance = tolerances(model, batches[1], {**ref, "max_grad": max(r["max_grad"] for r in reference)})
    tolerance["weight"] = OPTIM["lr"] / OPTIM["adam_eps"] * tolerance["grad"] + rounding(ref["max_weight"], 2)
    return tolerance


@pytest.mark.slow
def test_second_update_depends_on_the_restored_moments(written, tmp_path):
    """The check above can fail: a resume that reloads the weights but starts Adam afresh moves
    them by more than its tolerance."""
    model, batches, directory, _, ref_weights = written
    run_ranks(_weights_only, 2, tmp_path, model, str(directory), batches, str(tmp_path / "w"))
    weights = assemble(str(tmp_path / "w"), "gspo", 2)
    worst = max(float((weights[n] - t).abs().max()) for n, t in ref_weights.items())
    assert worst > _tolerances(written)["weight"], worst


def _weights_only(rank, world_size, model, directory, batches, out_prefix):
    """Load the checkpoint's weights into an actor whose optimizer starts afresh, then update."""
    from megatron.core import parallel_state as ps

    from loss.megatron_hook import policy_loss_func
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime import checkpoint as dist_checkpoint
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.weights.export import local_hf_slices

    train = TrainParallel(**WRITER)
    initialize_parallel(train)
    spec = load_model_spec(model)
    loaded = MegatronActor(spec, train, BuildOptions(params_dtype=torch.float32), None, "cpu")
    dist_checkpoint.load(loaded, directory)
    fresh = MegatronActor(spec, train, BuildOptions(params_dtype=torch.float32), OptimConfig(**OPTIM), "cpu")
    with torch.no_grad():
        for a, b in zip(fresh.chunks, loaded.chunks):
            for p, q in zip(a.parameters(), b.parameters()):
                p.copy_(q)
    fresh.build_optimizer()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = len(batches[1]["input_ids"]) // dp
    mine = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batches[1].items()}
    fresh.train_step(mine, MICRO, partial(policy_loss_func, LOSSES["gspo"]), None)
    torch.save([(n, r, c, t.clone()) for n, r, c, t in local_hf_slices(fresh.chunks, spec)],
               f"{out_prefix}_gspo_rank{rank}.pt")
    return {}


@pytest.mark.slow
def test_async_save_writes_the_state_at_the_save(written, tmp_path):
    """Saved in the background while the next update changes the weights in place: the checkpoint
    holds them as they were at the save (a resume continues bit for bit), and it stays incomplete
    (no metadata.json) until ``finish_saves``."""
    model, batches, _, reference, ref_weights = written
    directory = tmp_path / "async"
    writer = run_ranks(_steps, 2, tmp_path, model, batches, WRITER, str(directory), True, str(tmp_path / "a"), True)
    # (Python's and NumPy's RNGs are not seeded in these processes: a run's draws are its own)
    assert [{k: v for k, v in r.items() if k not in ("blocked", "rng")} for r in writer] == \
        [{k: v for k, v in r.items() if k not in ("blocked", "rng")} for r in reference]
    results, weights = _resume((model, batches, directory), tmp_path, WRITER)
    assert results == [{**r, "restored": True, "blocked": None} for r in writer]  # RNG draws too
    for name, tensor in ref_weights.items():
        assert torch.equal(weights[name], tensor), name


def test_incomplete_checkpoint_is_named(written, tmp_path):
    from megatron_bridge.weights.dist_checkpoint import CheckpointFilesError, check_complete

    directory = tmp_path / "ckpt"
    shutil.copytree(written[2], directory)
    check_complete(directory)
    shard = sorted(p for p in os.listdir(directory) if p.endswith(".distcp"))[-1]
    os.remove(directory / shard)
    with pytest.raises(CheckpointFilesError, match=f"checkpoint {directory} is incomplete or damaged: {shard} is missing"):
        check_complete(directory)
    os.remove(directory / ".metadata")
    with pytest.raises(CheckpointFilesError, match=r"\.metadata is missing"):
        check_complete(directory)


def _save_beyond_a_size_limit(rank, world_size, model, directory, async_save):
    """What saving into ``directory`` raises when no file may grow past 64 KiB (RLIMIT_FSIZE: the
    kernel fails the write as a full disk would, EFBIG for ENOSPC), as (type, message)."""
    import resource
    import signal

    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime import checkpoint as dist_checkpoint
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.runtime.optim import OptimConfig

    train = TrainParallel(**WRITER)
    initialize_parallel(train)
    actor = MegatronActor(load_model_spec(model), train, BuildOptions(params_dtype=torch.float32),
                          OptimConfig(**OPTIM), "cpu")
    queue = AsyncCallsQueue() if async_save else None
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the signal ending the process
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limits[1]))
    try:
        dist_checkpoint.save(actor, directory, queue)
        if queue is not None:
            dist_checkpoint.finish_saves(queue, actor, directory)
    except Exception as e:  # noqa: BLE001  (the test reads what it was)
        return [type(e).__name__, str(e)]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_write_that_fails_is_one_line_naming_the_directory_and_the_size(written, tmp_path, async_save):
    """A full disk (here: a file size limit, which fails the write the same way) during a save, in
    the foreground or in megatron's background writer: one line naming the checkpoint, the free
    space, what a checkpoint takes and the fix; the checkpoint is left incomplete, so never resumed."""
    from megatron_bridge.plan.memory import checkpoint_bytes
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.weights.dist_checkpoint import damage

    model, directory = written[0], tmp_path / "full"
    total = checkpoint_bytes(load_model_spec(str(model)), world_size=2, weight_bytes=4)[0]
    for kind, message in run_ranks(_save_beyond_a_size_limit, 2, tmp_path, model, str(directory), async_save):
        assert kind == "CheckpointWriteError", message
        assert re.fullmatch(
            rf"writing checkpoint {re.escape(str(directory))} failed \(.+\): its file system has [\d.]+ GiB free and a "
            rf"checkpoint of this model takes about {total / 2**30:.2f} GiB \(all ranks\); free space or give "
            r"trainer.default_local_dir a larger disk \(max_actor_ckpt_to_keep bounds how many are kept\), then "
            r"re-run: it resumes from the last complete checkpoint", message), message
    assert damage(directory)  # incomplete: resume skips it


def _load_refusal(rank, world_size, model, directory):
    """What loading ``directory`` into an actor of ``model`` (EP2) raises, as (type, message)."""
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime import checkpoint as dist_checkpoint
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.runtime.optim import OptimConfig

    train = TrainParallel(**WRITER)
    initialize_parallel(train)
    actor = MegatronActor(load_model_spec(model), train, BuildOptions(params_dtype=torch.float32),
                          OptimConfig(**OPTIM), "cpu")
    try:
        dist_checkpoint.load(actor, directory)
    except Exception as e:  # noqa: BLE001  (the test reads what it was)
        return [type(e).__name__, str(e)]
    return None


@pytest.mark.slow
@pytest.mark.parametrize("differs", [dict(moe_intermediate_size=48), dict(num_local_experts=4), dict(num_hidden_layers=2),
                                     dict(vocab_size=384)], ids=lambda d: next(iter(d)))
def test_a_checkpoint_of_another_model_is_refused_by_name(written, tmp_path, differs):
    """A resume with a model of other widths, expert count, depth or vocabulary: a config error
    naming the checkpoint, never "damaged" (the advice for which is to move it away)."""
    other = save_tiny_checkpoint(tmp_path / "other", seed=1, **differs)
    for kind, message in run_ranks(_load_refusal, 2, tmp_path, other, str(written[2])):
        assert kind == "ConfigError", message
        assert message.startswith(f"checkpoint {written[2]} does not fit this model: "), message
        assert "trainer.resume_mode=disable" in message and "\n" not in message
        field = {"moe_intermediate_size": "moe_ffn_hidden_size", "num_local_experts": "num_experts",
                 "num_hidden_layers": "num_layers", "vocab_size": "vocab_size"}[next(iter(differs))]
        assert re.search(rf": {field} \d+ there, {next(iter(differs.values()))} here", message), message


def test_planned_checkpoint_size_matches_the_files(written):
    """The planner's checkpoint size (fp32 weights here) is the tensor bytes of the files, less
    torch.save's framing of each stored slice; each of the 2 ranks writes about half."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_bridge.plan.memory import checkpoint_bytes
    from megatron_bridge.plan.model_spec import load_model_spec

    model, _, directory = written[:3]
    total, per_rank = checkpoint_bytes(load_model_spec(str(model)), world_size=2, weight_bytes=4)
    slices = len(FileSystemReader(str(directory)).read_metadata().storage_data)
    files = {p.name: p.stat().st_size for p in directory.glob("*.distcp")}
    assert total < sum(files.values()) < total + slices * 2048
    for rank in (0, 1):
        written_by_rank = sum(size for name, size in files.items() if name.startswith(f"__{rank}_"))
        assert per_rank < written_by_rank < per_rank * 1.2 + slices * 2048 / 2


def test_a_crafted_metadata_file_is_refused_without_running_it(written, tmp_path):
    """``.metadata`` is a pickle: the package's own checks (resume, the merger, evaluation) read it
    with only the classes checkpoint metadata holds, so a payload is named and never runs."""
    import pickle

    from megatron_bridge.weights.dist_checkpoint import CheckpointFilesError, check_complete, damage, read_metadata

    directory = tmp_path / "ckpt"
    shutil.copytree(written[2], directory)
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    (directory / ".metadata").write_bytes(pickle.dumps(Payload()))
    assert damage(directory) == [".metadata asks to build posix.system, which no checkpoint's metadata holds (not "
                                 "loaded: it could run code)"]
    with pytest.raises(CheckpointFilesError, match=r"\.metadata asks to build posix\.system"):
        check_complete(directory)
    assert not ran.exists()
    # what torch and megatron write reads the same as torch's own reader gives it
    from torch.distributed.checkpoint import FileSystemReader

    ours, torchs = read_metadata(written[2]), FileSystemReader(str(written[2])).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata and ours.storage_data == torchs.storage_data


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("damaged, reason", [
    ("__0_0.distcp", r"__0_0\.distcp has \d+ bytes, its metadata places \d+"),
    (".metadata", r"\.metadata cannot be read \(\w+\)"),
    ("common.pt", r"common\.pt is not a complete torch\.save file"),
    ("metadata.json", r"metadata\.json is not JSON"),
])
def test_a_truncated_file_is_named(written, tmp_path, damaged, reason):
    """What a crash or a full disk leaves: any of the checkpoint's files cut short."""
    from megatron_bridge.weights.dist_checkpoint import CheckpointFilesError, check_complete, damage

    directory = tmp_path / "ckpt"
    shutil.copytree(written[2], directory)
    assert damage(directory) == []
    _truncate(directory / damaged)
    with pytest.raises(CheckpointFilesError, match=f"checkpoint {directory} is incomplete or damaged: {reason}$"):
        check_complete(directory)


def _run_checkpoint(written, directory, step: int):
    """A recipe checkpoint (``recipe.run_dir``'s layout) holding the written actor checkpoint."""
    from recipe.run_dir import ACTOR_DIR, TRAINER_STATE

    path = directory / f"global_step_{step}"
    shutil.copytree(written[2], path / ACTOR_DIR)
    (path / TRAINER_STATE).write_text(json.dumps({"step": step, "sampler": {"epoch": 0, "position": step}}))
    return path


def test_auto_resume_skips_damaged_checkpoints_and_says_why(written, tmp_path):
    """The newest intact checkpoint is resumed from; each newer damaged one is named with its reason.
    resume_from_path at a damaged one is refused naming what is wrong."""
    from megatron_bridge.errors import ConfigError
    from recipe.config import TrainerConfig
    from recipe.run_dir import TRAINER_STATE, resume_point, set_aside

    intact = _run_checkpoint(written, tmp_path, 2)
    cut = _run_checkpoint(written, tmp_path, 4)
    _truncate(cut / "actor" / "__1_0.distcp")
    half_state = _run_checkpoint(written, tmp_path, 6)
    _truncate(half_state / TRAINER_STATE)
    no_state = _run_checkpoint(written, tmp_path, 8)
    (no_state / TRAINER_STATE).unlink()
    resume, skipped = resume_point(TrainerConfig(resume_mode="auto"), tmp_path)
    assert resume == intact
    assert [(p.name, len(why)) for p, why in skipped] == [("global_step_8", 1), ("global_step_6", 1),
                                                          ("global_step_4", 1)]
    assert skipped[0][1] == ["trainer_state.json is missing"]
    assert skipped[1][1] == ["trainer_state.json cannot be read as JSON"]
    assert re.fullmatch(r"actor/__1_0\.distcp has \d+ bytes, its metadata places \d+", skipped[2][1][0])

    with pytest.raises(ConfigError, match=f"trainer.resume_from_path={cut} is not a complete checkpoint: "
                                          r"actor/__1_0\.distcp has \d+ bytes"):
        resume_point(TrainerConfig(resume_mode="resume_path", resume_from_path=str(cut)), tmp_path)
    assert set_aside(cut) == tmp_path / "global_step_4.damaged" and not cut.exists()
    assert resume_point(TrainerConfig(resume_mode="disable"), tmp_path) == (None, [])


def test_auto_resume_skips_an_unfinished_save(written, tmp_path):
    """A save killed before its rename leaves ``.global_step_K.tmp``; auto resume takes the last
    complete checkpoint, and a save of that step again starts from a clean temporary directory."""
    from recipe.config import TrainerConfig
    from recipe.run_dir import checkpoints, remove_stale, to_resume

    complete = _run_checkpoint(written, tmp_path, 2)
    unfinished = _run_checkpoint(written, tmp_path, 4).rename(tmp_path / ".global_step_4.tmp")
    assert checkpoints(tmp_path) == [complete]
    assert to_resume(TrainerConfig(resume_mode="auto"), tmp_path) == complete
    assert to_resume(TrainerConfig(resume_mode="disable"), tmp_path) is None
    assert remove_stale(tmp_path) == [unfinished] and not unfinished.exists()


def _save_and_load_with_a_writer_that_drops_mcore_data(rank, world_size, directory):
    """torch 2.11's FileSystemWriter.finish, which writes a ``dataclasses.replace`` copy of the
    metadata, on top of this torch's; then megatron's save and load of an N-D flattened tensor
    (what the distributed optimizer's state is), as the actor's checkpoint has them."""
    import dataclasses

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    from megatron_bridge.runtime.checkpoint import numpy2_compat
    from megatron_bridge.runtime.megatron_compat import keep_mcore_data

    numpy2_compat()  # as the actor's save and load call it
    covered = _FileSystemWriter.finish

    def finish_as_torch_2_11(self, metadata, results):
        covered(self, dataclasses.replace(metadata, version="1.0.0"), results)

    def state(values):
        return {"moments": ShardedTensor.from_rank_offsets_flat("moments", values.flatten(), (3, 4),
                                                                flattened_range=slice(0, 12))}

    _FileSystemWriter.finish = finish_as_torch_2_11
    for name in ("dropped", "kept"):
        os.makedirs(f"{directory}/{name}")
    dist_checkpointing.save(state(torch.arange(12.0).reshape(3, 4)), f"{directory}/dropped")
    try:
        dist_checkpointing.load(state(torch.zeros(3, 4)), f"{directory}/dropped")
        dropped = "loaded"
    except AttributeError as e:
        dropped = str(e)
    keep_mcore_data(_FileSystemWriter)
    dist_checkpointing.save(state(torch.arange(12.0).reshape(3, 4)), f"{directory}/kept")
    loaded = dist_checkpointing.load(state(torch.zeros(3, 4)), f"{directory}/kept")
    return {"dropped": dropped, "kept": loaded["moments"].tolist()}


def test_a_checkpoint_loads_where_torch_drops_megatrons_metadata(tmp_path):
    """The resume that failed on an H100 with torch 2.11 (docs/bench_device.md), on this torch."""
    result = run_ranks(_save_and_load_with_a_writer_that_drops_mcore_data, 1, tmp_path, str(tmp_path))[0]
    assert "has no attribute 'mcore_data'" in result["dropped"]
    assert result["kept"] == [float(i) for i in range(12)]


def test_torch_adam_steps_on_its_fused_kernel_where_the_device_has_one():
    """megatron's fallback Adam (torch's AdamW) switched to the fused kernel after it was built, with
    steps taken before: the same updates as an AdamW built fused, to rounding; each step a float32
    tensor of its own. Devices without a fused kernel here (the NPU: MindSpeed's optimizer) and
    other optimizers are left as they are."""
    from megatron_bridge.runtime.megatron_compat import fuse_torch_adam
    from megatron_bridge.runtime.kernels import optimizer_path

    def run(switch_after: int | None, fused_from_start: bool = False) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in (1000, 37, 4096)]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused_from_start or None)
        for step in range(6):
            if step == switch_after:
                assert fuse_torch_adam(optimizer) and optimizer_path([optimizer]) == "torch AdamW (fused kernel)"
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            optimizer.step()
        steps = [optimizer.state[p]["step"] for p in params]
        assert [(float(t), t.dtype) for t in steps] == [(6.0, torch.float32)] * 3
        assert len({id(t) for t in steps}) == 3
        return [p.detach() for p in params]

    fused, switched, unfused = run(None, fused_from_start=True), run(2), run(None)
    # the kernel ran: its rounding differs from the multi-tensor path's in some weights
    assert not all(torch.equal(b, c) for b, c in zip(switched, unfused))
    for a, b, c in zip(fused, switched, unfused):
        # the first two steps by the multi-tensor path, the rest fused: between the two (1 ulp a step)
        torch.testing.assert_close(b, a, rtol=0, atol=6 * torch.finfo(torch.float32).eps * float(a.abs().max()))
        torch.testing.assert_close(c, a, rtol=0, atol=6 * torch.finfo(torch.float32).eps * float(a.abs().max()))

    unfused_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert optimizer_path([unfused_optimizer]) == "torch AdamW (not fused)"
    on_meta = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, device="meta"))])
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    assert not fuse_torch_adam(on_meta) and not on_meta.param_groups[0]["fused"]
    assert not fuse_torch_adam(sgd) and not sgd.param_groups[0]["fused"]

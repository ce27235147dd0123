"""HF export of the actor's checkpoint (``python -m recipe.model_merger merge --backend megatron``):
transformers loads the export and gives the trainer's log-probs at that checkpoint; the same
weights checkpointed under three layouts export to the same tensors; bad input is refused by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from megatron_bridge.plan.layout import TrainParallel
from megatron_bridge.tiny_model import save_tiny_checkpoint
from tests.distributed import run_ranks
from tests.numerics import log_prob_tolerance
from tests.test_actor_update import LOSSES, OPTIM, make_batch

REPO = Path(__file__).resolve().parents[1]
WRITER = {"ep": 2, "etp": 1}
READERS = {"pp2": {"pp": 2}, "tp2": {"tp": 2, "sequence_parallel": True}}  # load the writer's, save again


def _checkpoint(rank, world_size, model, batch, train_kwargs, directory, source):
    """Under ``train_kwargs``: one update from the HF model (``source`` None) or the checkpoint at
    ``source`` as loaded; saved to ``directory``. The model's log-probs of the batch's tokens then."""
    from megatron.core import parallel_state as ps

    from loss.megatron_hook import policy_loss_func
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.runtime import checkpoint
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.verify import sharded_log_probs, whole_sequence_batch

    train = TrainParallel(**train_kwargs)
    initialize_parallel(train)
    actor = MegatronActor(load_model_spec(model), train, BuildOptions(params_dtype=torch.float32),
                          OptimConfig(**OPTIM), "cpu")
    actor.load_hf(model)
    if source is None:
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        rows = len(batch["input_ids"]) // dp
        mine = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
        actor.train_step(mine, 2, partial(policy_loss_func, LOSSES["gspo"]), None)
    else:
        checkpoint.load(actor, source)
    checkpoint.save(actor, directory)
    return sharded_log_probs(actor, whole_sequence_batch(batch["input_ids"]))[0].tolist()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny model updated once under EP2 and checkpointed as a recipe step directory
    (``global_step_1/actor`` with ``huggingface/``), then loaded and checkpointed again under PP2
    and under TP2 with sequence parallel; all exported. The first export runs the command line,
    the others the function."""
    from megatron_bridge.weights.hf_export import copy_hf_files
    from recipe.model_merger import merge

    tmp = tmp_path_factory.mktemp("merge")
    model = save_tiny_checkpoint(tmp / "hf", seed=1)
    batch = make_batch(model)
    step = tmp / "global_step_1"
    first = run_ranks(_checkpoint, 2, tmp, model, batch, WRITER, str(step / "actor"), None)
    copy_hf_files(Path(model), step / "actor" / "huggingface")
    for name, layout in READERS.items():
        run_ranks(_checkpoint, 2, tmp, model, batch, layout, str(tmp / name), str(step / "actor"))
    out = subprocess.run([sys.executable, "-m", "recipe.model_merger", "merge", "--backend", "megatron",
                          "--local_dir", str(step), "--target_dir", str(tmp / "hf_ep2")],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    for name in READERS:
        merge(tmp / name, tmp / f"hf_{name}", hf_model_path=Path(model), shard_megabytes=0.5)
    return model, batch, torch.tensor(first[0]), tmp


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load_file(directory / file))
    assert sorted(out) == sorted(index["weight_map"])
    return out


@pytest.mark.slow
@pytest.mark.numerics
def test_export_gives_the_trainers_log_probs(exported):
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.verify import reference

    model, batch, trainer, tmp = exported
    ids = batch["input_ids"]
    got = reference(str(tmp / "hf_ep2"), ids)[0]
    before = reference(model, ids)[0]
    tolerance = log_prob_tolerance(load_model_spec(model), trainer, ids.shape[1])
    torch.testing.assert_close(got, trainer, rtol=0, atol=tolerance)
    assert (before - trainer).abs().max() > tolerance, "the check must tell the export from the base model"
    files = sorted(p.name for p in (tmp / "hf_ep2").iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(files)
    config = json.loads((tmp / "hf_ep2" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"


@pytest.mark.slow
def test_three_layouts_export_the_same_tensors(exported):
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.weights.load import hub_tensor_names

    model, _, _, tmp = exported
    ep2 = _tensors(tmp / "hf_ep2")
    assert sorted(ep2) == sorted(hub_tensor_names(load_model_spec(model)))
    for reader in READERS:
        other = _tensors(tmp / f"hf_{reader}")
        assert ep2.keys() == other.keys(), reader
        for name, tensor in ep2.items():
            assert torch.equal(other[name], tensor), (reader, name)
    shards = json.loads((tmp / "hf_pp2" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) > 1  # cut into shards of at most 0.5 MB


@pytest.mark.slow
def test_bad_input_is_refused_by_name(exported, tmp_path, capsys):
    from recipe.model_merger import main

    _, _, _, tmp = exported

    def refused(local_dir: Path, target_dir: Path) -> str:
        assert main(["merge", "--backend", "megatron", "--local_dir", str(local_dir),
                     "--target_dir", str(target_dir)]) == 2
        return capsys.readouterr().err

    assert f"--local_dir {tmp}: not a checkpoint" in refused(tmp, tmp_path / "a")
    assert f"--target_dir {tmp / 'hf_ep2'} is not empty" in refused(tmp / "global_step_1", tmp / "hf_ep2")
    broken = tmp_path / "broken"
    shutil.copytree(tmp / "global_step_1", broken)
    shard = sorted((broken / "actor").glob("*.distcp"))[0]
    shard.unlink()
    assert (f"checkpoint {broken / 'actor'} is incomplete or damaged: {shard.name} is missing"
            in refused(broken, tmp_path / "b"))
    assert not (tmp_path / "b").exists() and not (tmp_path / ".b.tmp").exists()
    other = tmp_path / "other_model"  # the same names, wider experts
    shutil.copytree(tmp / "global_step_1" / "actor" / "huggingface", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 2 * config["moe_intermediate_size"]}))
    assert main(["merge", "--backend", "megatron", "--local_dir", str(tmp / "global_step_1"), "--hf_model_path",
                 str(other), "--target_dir", str(tmp_path / "c")]) == 2
    assert "model.layers.0.mlp.experts.0.gate_proj.weight has shape" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / ".c.tmp").exists()


@pytest.mark.slow
def test_the_target_never_removes_what_the_export_did_not_write(exported, tmp_path, monkeypatch, capsys):
    """The merger replaces its target: a target that is the working directory, the checkpoint, the
    base model or a folder holding one is refused, as is --overwrite of a folder with the user's own
    files; --overwrite of an earlier export replaces it."""
    from recipe.model_merger import main

    _, _, _, tmp = exported
    step = tmp / "global_step_1"

    def merge_into(target: str, *flags: str) -> int:
        return main(["merge", "--backend", "megatron", "--local_dir", str(step), "--target_dir", target, *flags])

    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for target, says in ((".", f"is the current directory ({work})"), ("..", f"holds the current directory ({work})"),
                         (str(step / "actor"), "is the checkpoint"), (str(step), "holds the checkpoint"),
                         (str(step / "actor" / "huggingface"), "is the base model")):
        assert merge_into(target, "--overwrite") == 2, target
        err = capsys.readouterr().err
        assert f"--target_dir {target} {says}" in err and "name a new directory for the export" in err, err
    assert (work / "notes.txt").read_text() == "mine" and sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    assert (step / "actor" / "metadata.json").is_file() and (step / "actor" / "huggingface" / "config.json").is_file()

    monkeypatch.chdir(tmp_path)
    (work / "data").mkdir()
    assert merge_into(str(work), "--overwrite") == 2
    assert (f"--target_dir {work} holds files an export does not write (data/, notes.txt); --overwrite replaces "
            "only an earlier export" in capsys.readouterr().err)
    assert sorted(p.name for p in work.iterdir()) == ["data", "notes.txt"]

    export = tmp_path / "export"
    assert merge_into(str(export)) == 0
    first = {name: t.clone() for name, t in _tensors(export).items()}  # load_file maps the file
    (export / "model-00001-of-00001.safetensors").write_bytes(b"stale")
    assert merge_into(str(export), "--overwrite") == 0  # an earlier export: replaced
    again = _tensors(export)
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "work"]  # nothing left beside it


def test_help_explains_the_command():
    out = subprocess.run([sys.executable, "-m", "recipe.model_merger", "merge", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0
    for flag in ("--backend", "--local_dir", "--target_dir", "--hf_model_path", "--overwrite"):
        assert flag in out.stdout

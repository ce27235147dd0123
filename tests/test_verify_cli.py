"""``python -m megatron_bridge.verify`` (which starts torchrun itself on one node): exit 0 when the
sharded model matches transformers, 1 when a check fails, 2 for an invalid layout or checkpoint,
with a message that names the problem."""

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.distributed import run_ranks
from megatron_bridge.tiny_model import save_tiny_checkpoint as save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("tiny_hf"), seed=2)


def _verify(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_bridge.verify", "--nproc-per-node", str(nproc),
           "--platform", "cpu", "--seq-len", "16", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _broken(checkpoint: str, tmp_path, edit) -> str:
    target = tmp_path / "broken"
    shutil.copytree(checkpoint, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return str(target)


def test_help():
    out = subprocess.run([sys.executable, "-m", "megatron_bridge.verify", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--hf-dir" in out.stdout and "exit status" in out.stdout


@pytest.mark.slow
def test_matching_layout_passes(checkpoint):
    out = _verify(2, "--hf-dir", checkpoint, "--ep", "2", "--etp", "1", "--tol", "1e-4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PASS" in out.stdout and "max |delta log-prob| vs transformers" in out.stdout


@pytest.mark.slow
def test_failed_check_exits_1(checkpoint):
    # No sharded fp32 computation equals transformers' to the last bit, so a zero tolerance fails.
    out = _verify(2, "--hf-dir", checkpoint, "--tp", "2", "--tol", "0")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "FAIL" in out.stdout


@pytest.mark.slow
def test_invalid_layout_exits_2_with_the_validators_message(checkpoint):
    out = _verify(8, "--hf-dir", checkpoint, "--tp", "8")  # refused before any process starts
    assert out.returncode == 2
    assert "num_query_groups (4) must be a multiple of it; valid TP for this model: 1, 2, 4" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.3.mlp.experts.5.up_proj.weight"), "has no tensor 'model.layers.3.mlp.experts.5.up_proj.weight'"),
        (lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 64)}),
         "tensor 'model.layers.1.self_attn.k_proj.weight' has shape [32, 64], but the model config needs [64, 64]"),
    ],
    ids=["missing", "wrong_shape"],
)
def test_bad_checkpoint_exits_2_naming_the_tensor(checkpoint, tmp_path, edit, message):
    broken = _broken(checkpoint, tmp_path, edit)
    # EP2 x PP2: the broken tensor lives on one rank only, yet every rank stops with its message.
    out = _verify(4, "--hf-dir", broken, "--ep", "2", "--etp", "1", "--pp", "2")
    assert out.returncode == 2, out.stderr[-3000:]
    assert message in out.stderr


def _load_into_model(rank, world_size, directory):
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.errors import ConfigError
    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.plan.model_spec import load_model_spec

    train = TrainParallel()
    initialize_parallel(train)
    actor = MegatronActor(load_model_spec(directory), train, BuildOptions(params_dtype=torch.float32), None, "cpu")
    before = [p.detach().clone() for p in actor.chunks[0].parameters()]
    try:
        actor.load_hf(directory)
        error = None
    except ConfigError as e:
        error = str(e)
    untouched = all(torch.equal(a, b) for a, b in zip(before, actor.chunks[0].parameters()))
    return {"error": error, "untouched": untouched}


@pytest.mark.slow
def test_bad_checkpoint_leaves_the_model_untouched(checkpoint, tmp_path):
    # The last tensor read is wrong; everything before it was readable.
    broken = _broken(checkpoint, tmp_path, lambda t: t.update({"lm_head.weight": torch.zeros(512, 32)}))
    (result,) = run_ranks(_load_into_model, 1, tmp_path, broken)
    assert "lm_head.weight" in result["error"] and result["untouched"]


def test_mbridge_backend_reports_why_it_cannot_run(checkpoint):
    try:
        import mbridge  # noqa: F401

        pytest.skip("mbridge imports here; its backend is checked on machines with Transformer Engine")
    except Exception:
        pass
    out = _verify(1, "--hf-dir", checkpoint, "--backend", "mbridge")
    assert out.returncode == 2
    assert "mbridge cannot be imported here" in out.stderr


def _run_verify(rank, world_size, argv):
    from megatron_bridge.verify import parse_args, run

    return run(parse_args(argv))


@pytest.mark.slow
def test_bf16_log_prob_tolerance_reads_the_tokens_routed_alike(tmp_path):
    """In bf16 near-tied router logits send a few tokens to other experts than transformers' fp32
    top-k; such a token's log-prob comes from other expert weights, so it may differ by far more
    than rounding (this checkpoint and batch: 0.98 on one such token, on this CPU and on an H200
    alike) while the routing check bounds how many there are. The log-prob tolerance applies to
    the tokens routed alike in every layer."""
    checkpoint = save_checkpoint(tmp_path / "hf", seed=0)
    argv = ["--hf-dir", checkpoint, "--platform", "cpu", "--dtype", "bf16", "--seed", "0"]
    (report,) = run_ranks(_run_verify, 1, tmp_path, argv)
    assert report["passed"], report
    assert 0 < report["tokens_routed_alike"] < report["tokens"]
    assert report["max_abs_delta_log_prob"] <= report["tolerance"] == 0.5
    assert report["max_abs_delta_log_prob_all_tokens"] > report["max_abs_delta_log_prob"]
    assert 0 < report["routing"]["slot_frac_differs"] <= report["routing_tolerance"]

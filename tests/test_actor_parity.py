"""The sharded megatron model loaded from a HF checkpoint gives transformers' log-probs and routes
every token to transformers' top-k experts in every layer, in every parallel layout; each rank
reads only its own shard of the checkpoint, and the rollout weight stream gives the checkpoint back
bit for bit (names and shapes included).

Runs ``megatron_bridge.verify`` (the check users run on their cluster) on CPU gloo ranks.
"""

import pytest

from megatron_bridge.plan.model_spec import load_model_spec
from megatron_bridge.verify import parse_args, run
from tests.distributed import run_ranks
from tests.numerics import forward_terms, rounding
from megatron_bridge.tiny_model import save_tiny_checkpoint as save_checkpoint

pytestmark = pytest.mark.numerics  # CI runs these again under another CPU kernel path

SEQ_LEN = 24

LAYOUTS = {
    "tp2_sp": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "ep2": (2, ["--ep", "2", "--etp", "1"]),
    "ep2_pp2": (4, ["--ep", "2", "--pp", "2", "--etp", "1"]),
    "tp2_ep2_etp1": (4, ["--tp", "2", "--ep", "2", "--etp", "1"]),
    "tp2_ep2_etp2": (4, ["--tp", "2", "--ep", "2", "--etp", "2"]),
    "pp2_vpp2": (4, ["--pp", "2", "--vpp", "2"]),
}


def _verify(rank, world_size, argv):
    return run(parse_args(argv))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("tiny_hf"), seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_log_probs_equal_transformers(name, checkpoint, tmp_path):
    world_size, flags = LAYOUTS[name]
    argv = ["--hf-dir", checkpoint, "--platform", "cpu", "--seq-len", str(SEQ_LEN), *flags]
    reports = run_ranks(_verify, world_size, tmp_path, argv)
    report = reports[0]
    assert report["passed"] and all(r["passed"] for r in reports)
    # fp32 on the CPU: summation order only (measured ~1.5e-6 in every layout), tests.numerics
    tolerance = rounding(report["max_abs_log_prob"], forward_terms(load_model_spec(checkpoint), SEQ_LEN))
    assert report["max_abs_delta_log_prob"] < tolerance
    assert report["tokens"] == 2 * (SEQ_LEN - 1) * world_size // _model_parallel(flags)
    # routing captured on the ranks, put together: the same top-k sets as transformers, every token and layer
    routing = report["routing"]
    assert routing["passed"] and routing["slot_frac_differs"] == 0.0 and routing["token_any_frac_differs"] == 0.0
    assert routing["tokens"] == 2 * SEQ_LEN * world_size // _model_parallel(flags)
    # Each rank read exactly the bytes of the parameters it holds (fp32 checkpoint, fp32 model) ...
    assert report["bytes_read_per_rank"] == report["parameter_bytes_per_rank"]
    # ... which is less than the whole model whenever the layout shards it.
    whole = sum(p.numel() * 4 for p in _hf_params(checkpoint))
    assert max(report["bytes_read_per_rank"]) < whole
    # HF checkpoint -> shards -> export stream == the checkpoint, every tensor, bit for bit.
    trip = report["round_trip"]
    assert trip["bit_exact"], trip
    assert trip["tensors"] == len(_hf_params(checkpoint)) == 135


def _model_parallel(flags):
    values = dict(zip(flags[::2], map(int, flags[1::2])))
    return values.get("--tp", 1) * values.get("--pp", 1)


def _hf_params(checkpoint):
    from safetensors import safe_open

    with safe_open(f"{checkpoint}/model.safetensors", framework="pt") as f:
        return [f.get_tensor(k) for k in f.keys()]

"""The rollout weight stream (megatron_bridge.weights.export) on CPU gloo ranks: bit-exact tensors in the
rollout dtype, EP-aware routing (each rollout rank gets exactly its experts), size-bounded buckets,
with either expert layout (grouped experts, megatron's SequentialMLP).
The round trip for every training layout runs inside verify (tests/test_actor_parity.py)."""

import warnings

import pytest
import torch

from megatron_bridge.weights.export import Routing, checkpoint_order
from megatron_bridge.tiny_model import save_tiny_checkpoint
from tests.distributed import run_ranks

EXPERTS, LAYERS, DENSE = 8, 4, 3 + 4 * 9  # tiny model: embed/norm/head + 9 dense tensors per layer
FP32_BYTES = {"embed": 512 * 64 * 4}  # the largest tensors: embedding and head, 128 KiB each


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_hf"), seed=0)


def _export_cases(rank, world_size, checkpoint, train_kwargs):
    from safetensors.torch import load_file

    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.weights.export import WeightExporter
    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.plan.model_spec import load_model_spec

    train = TrainParallel(**train_kwargs)
    initialize_parallel(train)
    spec = load_model_spec(checkpoint)
    actor = MegatronActor(spec, train, BuildOptions(params_dtype=torch.float32), None, "cpu")
    actor.load_hf(checkpoint)
    reference = load_file(f"{checkpoint}/model.safetensors")
    results = {}
    cases = {
        "all_fp32": (1, 512, torch.float32),
        "ep_aware_bf16": (2, 512, torch.bfloat16),
        "small_buckets": (2, 0.15, torch.float32),  # 150 KiB: above the largest tensor
        "oversized": (1, 0.05, torch.float32),  # 50 KiB: embedding and head travel alone
    }
    for case, (rollout_ep, bucket_mb, dtype) in cases.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exporter = WeightExporter(actor.chunks, spec, Routing(world_size, spec.num_experts, rollout_ep), bucket_mb, dtype)
        names, nbytes, unequal = [], 0, []
        for name, tensor in exporter.stream():
            names.append(name)
            nbytes += tensor.numel() * tensor.element_size()
            expected = reference[name].to(dtype)
            if tensor.dtype != dtype or tensor.shape != expected.shape or not torch.equal(tensor, expected):
                unequal.append(name)
        planned = [sum(exporter._bytes(n) for n in b.names) for b in exporter.buckets]
        results[case] = {
            "names": names,
            "bytes": nbytes,
            "unequal": unequal,
            "stats": vars(exporter.stats),
            "planned_bucket_bytes": planned,
            "bucket_limit": exporter.bucket_bytes,
            "oversized": exporter.oversized,
            "warned": [str(w.message) for w in caught],
        }
    # verify's round-trip check sees a changed weight, and names it.
    from megatron_bridge.weights.load import unwrap
    from megatron_bridge.verify import round_trip

    seen, differ, _ = round_trip(actor.chunks, spec, checkpoint, torch.float32)
    results["round_trip_clean"] = differ
    params = dict(unwrap(actor.chunks[0]).named_parameters())
    fc2 = ("layers.1.mlp.experts.fc2_weight", "layers.1.mlp.experts.local_experts.0.linear_fc2.weight")
    name = next(n for n in params if n.endswith(fc2))
    with torch.no_grad():
        params[name].view(-1)[0] += 1.0  # local expert 0's fc2 [0, 0], stacked or alone
    results["round_trip_perturbed"] = round_trip(actor.chunks, spec, checkpoint, torch.float32)[1]
    return results


def _expert_id(name):
    return int(name.split(".mlp.experts.")[1].split(".")[0]) if ".mlp.experts." in name else None


def _check(results, checkpoint, world_size):
    from safetensors.torch import load_file

    reference = load_file(f"{checkpoint}/model.safetensors")
    everything = sorted(reference, key=checkpoint_order)
    for rank, by_case in enumerate(results):
        for case, r in by_case.items():
            assert r["unequal"] == [], (rank, case)
            assert r["stats"]["tensors"] == len(r["names"]) and r["stats"]["bytes_yielded"] == r["bytes"]
        # Every rank gets every tensor, once, in checkpoint order, when rollout has no EP.
        assert by_case["all_fp32"]["names"] == everything
        assert by_case["all_fp32"]["bytes"] == sum(t.numel() * 4 for t in reference.values())
        # EP-aware: dense tensors, plus exactly the experts this rollout rank owns (2 ranks: 4 each).
        owned = {e for e in range(EXPERTS) if e // (EXPERTS // 2) == rank % 2}
        for case in ("ep_aware_bf16", "small_buckets"):
            names = by_case[case]["names"]
            experts = [n for n in names if _expert_id(n) is not None]
            assert {_expert_id(n) for n in experts} == owned
            assert len(experts) == LAYERS * len(owned) * 3
            assert len(names) - len(experts) == DENSE
            itemsize = 2 if case == "ep_aware_bf16" else 4
            assert by_case[case]["bytes"] == sum(reference[n].numel() * itemsize for n in names)
    return results


def _bucket_checks(results):
    for by_case in results:
        small = by_case["small_buckets"]
        limit = small["bucket_limit"]
        assert limit == int(0.15 * 2**20) and small["oversized"] == []
        assert len(small["planned_bucket_bytes"]) > 5
        assert max(small["planned_bucket_bytes"]) <= limit and small["stats"]["max_bucket_bytes"] <= limit
        big = by_case["oversized"]
        assert big["oversized"] == ["model.embed_tokens.weight", "lm_head.weight"]
        # an oversized tensor travels in a bucket of its own, and everything else stays in the limit
        over = [b for b in big["planned_bucket_bytes"] if b > big["bucket_limit"]]
        assert over == [FP32_BYTES["embed"]] * 2
    assert any("larger than the 0.05 MB bucket" in w for w in results[0]["oversized"]["warned"])


EXPERT_LAYOUTS = {"grouped": {}, "sequential": {"grouped_gemm": False}}


@pytest.mark.slow
@pytest.mark.parametrize("experts", list(EXPERT_LAYOUTS))
def test_stream_from_ep2_shards(checkpoint, tmp_path, experts):
    """Train EP2 (experts 0-3 on rank 0, 4-7 on rank 1; dense tensors replicated)."""
    results = run_ranks(_export_cases, 2, tmp_path, checkpoint, {"ep": 2, "etp": 1, **EXPERT_LAYOUTS[experts]})
    round_trips = [(r.pop("round_trip_clean"), r.pop("round_trip_perturbed")) for r in results]
    assert round_trips == [([], ["model.layers.1.mlp.experts.0.down_proj.weight"]),
                           ([], ["model.layers.1.mlp.experts.4.down_proj.weight"])]
    _check(results, checkpoint, 2)
    _bucket_checks(results)
    for by_case in results:
        # EP-aware rollout EP2 matches the training EP2: nothing crosses ranks.
        aware = by_case["ep_aware_bf16"]["stats"]
        assert aware["bytes_sent"] == aware["bytes_received"] == 0
        # Without EP, each rank receives the other rank's 4 experts x 4 layers x 3 tensors.
        full = by_case["all_fp32"]["stats"]
        assert full["bytes_received"] == LAYERS * 4 * 3 * 32 * 64 * 4


@pytest.mark.slow
@pytest.mark.parametrize("experts", list(EXPERT_LAYOUTS))
def test_stream_from_tp2_shards(checkpoint, tmp_path, experts):
    """Train TP2 with sequence parallel (ETP2: every expert split over both ranks)."""
    results = run_ranks(_export_cases, 2, tmp_path, checkpoint,
                        {"tp": 2, "sequence_parallel": True, **EXPERT_LAYOUTS[experts]})
    round_trips = [(r.pop("round_trip_clean"), r.pop("round_trip_perturbed")) for r in results]
    # Both ranks changed their half of expert 0; rank 0 checks experts 0-3, rank 1 experts 4-7.
    assert round_trips == [([], ["model.layers.1.mlp.experts.0.down_proj.weight"]), ([], [])]
    _check(results, checkpoint, 2)
    for by_case in results:
        # Each rank receives the other half of every TP-split tensor it needs (norms are replicated).
        aware = by_case["ep_aware_bf16"]
        split = [n for n in aware["names"] if "norm" not in n and not n.endswith("mlp.gate.weight")]
        reference = {n: s for n, s in _shapes(checkpoint).items()}
        assert aware["stats"]["bytes_received"] == sum(_numel(reference[n]) // 2 * 2 for n in split)


def _shapes(checkpoint):
    from safetensors import safe_open

    with safe_open(f"{checkpoint}/model.safetensors", framework="pt") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys()}


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_routing_owners():
    routing = Routing(world_size=8, num_experts=128, expert_parallel=4)
    assert routing.destinations("model.layers.3.mlp.experts.33.up_proj.weight") == (1, 5)
    assert routing.destinations("model.layers.3.mlp.experts.127.down_proj.weight") == (3, 7)
    assert routing.destinations("model.layers.3.mlp.gate.weight") == tuple(range(8))
    assert Routing(8, 128).destinations("model.layers.0.mlp.experts.5.gate_proj.weight") == tuple(range(8))
    with pytest.raises(ValueError, match="must divide the number of experts"):
        Routing(world_size=6, num_experts=128, expert_parallel=6)
    # a rollout pool of its own: rank 0 takes the whole model and broadcasts it
    to_rank_0 = Routing(8, 128, receivers=1)
    assert to_rank_0.destinations("model.layers.3.mlp.experts.33.up_proj.weight") == (0,)
    assert to_rank_0.destinations("model.embed_tokens.weight") == (0,)


def test_checkpoint_order():
    names = ["lm_head.weight", "model.norm.weight", "model.layers.10.mlp.experts.2.up_proj.weight",
             "model.layers.2.mlp.experts.10.up_proj.weight", "model.layers.2.mlp.experts.9.up_proj.weight",
             "model.layers.2.self_attn.q_proj.weight", "model.embed_tokens.weight"]
    assert sorted(names, key=checkpoint_order) == [
        "model.embed_tokens.weight", "model.layers.2.self_attn.q_proj.weight",
        "model.layers.2.mlp.experts.9.up_proj.weight", "model.layers.2.mlp.experts.10.up_proj.weight",
        "model.layers.10.mlp.experts.2.up_proj.weight", "model.norm.weight", "lm_head.weight"]

"""Weight sync end to end on CPU gloo ranks: a sharded actor whose weights differ from the engine's
streams them into the transformers rollout engine (recipe.rollout.sync), and the engine's sampled
tokens then get the actor's own log-probs; and the weight group that carries the stream to a rollout
pool of its own (recipe.rollout.broadcast), on each device's library."""

import math

import pytest
import torch

from megatron_bridge.tiny_model import save_tiny_checkpoint
from tests.distributed import free_port, run_ranks
from tests.numerics import log_prob_tolerance

pytestmark = pytest.mark.numerics  # CI runs these again under another CPU kernel path

TEMPERATURE = 0.7
PROMPTS = [[5, 17, 33, 102], [9, 4], [300, 301, 302, 303, 304, 305]]
MAX_TOKENS = 10


def engine_batch(prompts: list[list[int]], responses: list[list[int]], response_width: int) -> dict[str, torch.Tensor]:
    """The actor's batch (right-padded prompt + response, response mask) of an engine's responses."""
    length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros(len(prompts), response_width)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        ids[i, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        mask[i, : len(response)] = 1
    return {"input_ids": ids, "prompt_lengths": torch.tensor([len(p) for p in prompts]), "response_mask": mask}


def _sync_and_compare(rank, world_size, actor_checkpoint, engine_checkpoint, train_kwargs):
    from functools import partial

    from loss.megatron_hook import log_prob_func
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.weights.export import Routing, WeightExporter
    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.plan.model_spec import load_model_spec
    from recipe.rollout.base import SamplingParams
    from recipe.rollout.hf_engine import HFEngine
    from recipe.rollout.sync import sync_weights

    train = TrainParallel(**train_kwargs)
    initialize_parallel(train)
    spec = load_model_spec(actor_checkpoint)
    actor = MegatronActor(spec, train, BuildOptions(params_dtype=torch.float32), None, "cpu")
    actor.load_hf(actor_checkpoint)
    engine = HFEngine(engine_checkpoint, load_from_checkpoint=True)  # other weights until the sync
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=7)
    before = engine.generate(PROMPTS, params)

    exporter = WeightExporter(actor.chunks, spec, Routing(world_size, spec.num_experts), bucket_mb=0.2,
                              dtype=torch.float32)
    metrics = sync_weights(exporter, engine)
    after = engine.generate(PROMPTS, params)

    # The actor's log-probs of the engine's responses, through the pipeline schedule.
    rows, width = len(PROMPTS), max(len(r) for r in after.token_ids)
    batch = engine_batch(PROMPTS, after.token_ids, width)
    actor_lp = actor.forward_only(batch, 1, partial(log_prob_func, TEMPERATURE, False))["log_probs"]
    engine_lp = torch.zeros(rows, width)
    for i, lp in enumerate(after.log_probs):
        engine_lp[i, : len(lp)] = torch.tensor(lp)
    return {
        "changed": before.token_ids != after.token_ids,
        "max_delta": float(((actor_lp.float() - engine_lp) * batch["response_mask"]).abs().max()),
        "tolerance": log_prob_tolerance(spec, engine_lp, batch["input_ids"].shape[1]),
        "tokens": int(batch["response_mask"].sum()),
        "metrics": metrics,
    }


@pytest.mark.slow
def test_engine_after_sync_matches_sharded_actor(tmp_path):
    actor_ckpt = save_tiny_checkpoint(tmp_path / "actor", seed=0)
    engine_ckpt = save_tiny_checkpoint(tmp_path / "engine", seed=1)
    results = run_ranks(_sync_and_compare, 2, tmp_path, actor_ckpt, engine_ckpt, {"tp": 2, "ep": 2, "etp": 1,
                                                                                  "sequence_parallel": True})
    for r in results:
        assert r["changed"]  # the sync replaced the engine's weights ...
        assert r["tokens"] >= len(PROMPTS)
        assert r["max_delta"] < r["tolerance"], r  # ... with the actor's: same log-probs (fp32; measured ~1e-6)
        m = r["metrics"]
        assert m["reshard/tensors"] == 135 and m["reshard/bytes"] == 1452800
        assert m["timing_s/reshard"] >= m["reshard/export_s"] > 0
        assert m["reshard/bytes_received"] > 0  # TP2 x EP2: half of every split tensor comes from the peer


# --- the weight group of a rollout pool of its own (recipe.rollout.broadcast) -----------------------


def _carry_buckets(rank, world_size, port, platform_name, setting):
    """Rank 0 broadcasts two buckets packed as ``send`` packs them; the others ``receive`` them."""
    from recipe.rollout.broadcast import SENDER, TransferPlan, WeightGroup, receive, weight_backend

    shapes = {"a.weight": (3, 4), "b.bias": (5,), "c.weight": (2, 2, 2)}
    tensors = {name: torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).to(torch.bfloat16) / 7
               for name, shape in shapes.items()}
    plan = TransferPlan(torch.bfloat16, [[("a.weight", (3, 4)), ("b.bias", (5,))], [("c.weight", (2, 2, 2))]])
    backend, device = weight_backend(platform_name, setting)
    group = WeightGroup("127.0.0.1", port, rank, world_size, 60, backend, device)
    if rank == SENDER:
        for bucket in plan.buckets:
            group.broadcast(torch.cat([tensors[name].reshape(-1) for name, _ in bucket]).to(device))
        return {"backend": group.backend}
    got = [(name, t.device.type, t.clone().cpu()) for name, t in receive(plan, group)]  # views of one buffer
    return {"backend": group.backend, "names": [n for n, _, _ in got], "devices": sorted({d for _, d, _ in got}),
            "equal": all(torch.equal(t, tensors[n]) for n, _, t in got)}


@pytest.mark.parametrize("platform_name, setting, backend, device", [
    ("cpu", "auto", "gloo", "cpu"),
    pytest.param("cuda", "auto", "nccl", "cuda", marks=pytest.mark.gpu),  # two GPUs: NCCL refuses two ranks on one
    pytest.param("cuda", "gloo", "gloo", "cpu", marks=pytest.mark.gpu),
])
def test_the_weight_group_carries_the_buckets_on_the_devices_library(tmp_path, platform_name, setting, backend, device):
    if platform_name == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    results = run_ranks(_carry_buckets, 2, tmp_path, free_port(), platform_name, setting, platform_name=platform_name)
    assert {r["backend"] for r in results} == {backend}
    for receiver in results[1:]:
        assert receiver == {"backend": backend, "names": ["a.weight", "b.bias", "c.weight"], "devices": [device],
                            "equal": True}

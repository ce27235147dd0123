"""Weight sync end to end on CPU gloo ranks: a sharded actor whose weights differ from the engine's
streams them into the transformers rollout engine (recipe.rollout.sync), and the engine's sampled
tokens then get the actor's own log-probs."""

import pytest
import torch

from megatron_bridge.tiny_model import save_tiny_checkpoint
from tests.distributed import run_ranks
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

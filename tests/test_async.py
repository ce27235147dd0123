"""async_training.mode=one_step_off: its config, the weight sync to a rollout pool of its own
across processes, and its schedule end to end (real Ray, megatron-core on gloo ranks, the
transformers engine in processes of its own)."""

from __future__ import annotations

import pytest

from megatron_bridge.errors import ConfigError
from recipe.config import load_config
from tests.test_recipe_e2e import TINY, VOLATILE, _trainer

ONE_STEP_OFF = ["async_training.mode=one_step_off", "actor_rollout_ref.hybrid_engine=false",
                "actor_rollout_ref.rollout.n_gpus_per_node=2"]


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, says", [
    (["async_training.mode=fully_async"], "fully asynchronous mode .* is not implemented yet; use one_step_off"),
    (["async_training.mode=one_step_off"], "one_step_off generates on the rollout's own devices: set "
                                           "actor_rollout_ref.hybrid_engine=false"),
    (["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.n_gpus_per_node=2"],
     "hybrid_engine=false .* runs with async_training.mode=one_step_off"),
    (["async_training.mode=one_step_off", "actor_rollout_ref.hybrid_engine=false"],
     "needs the rollout's own devices: set actor_rollout_ref.rollout.n_gpus_per_node"),
    (["actor_rollout_ref.rollout.n_gpus_per_node=4"], "with actor_rollout_ref.hybrid_engine=true the rollout is "
                                                      "colocated"),
    ([*ONE_STEP_OFF, "actor_rollout_ref.rollout.data_parallel_size=1"],
     r"rollout TP\*DP = 1\*1 = 1 must equal the rollout's device count 2 \(its own pool\)"),
    ([*ONE_STEP_OFF, "actor_rollout_ref.rollout.expert_parallel_size=4"], "expert_parallel_size=4"),
    ([*ONE_STEP_OFF, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
     "filter_groups .* not implemented with async_training.mode=one_step_off"),
    ([*ONE_STEP_OFF, "actor_rollout_ref.actor.megatron.router_replay.mode=R3"], "R3 with .* not implemented"),
    (["async_training.staleness_threshold=0.5"], "fully asynchronous trainer, not implemented here"),
    (["rollout.total_rollout_steps=10"], "only rollout.nnodes and rollout.n_gpus_per_node apply here"),
])
def test_async_config_is_checked(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(TINY["gspo"], overrides)


def test_one_step_off_config():
    cfg = load_config(TINY["gspo"], ["async_training.mode=one_step_off", "actor_rollout_ref.hybrid_engine=false",
                                     "rollout.nnodes=1", "rollout.n_gpus_per_node=1"])  # verl's recipe spelling
    assert cfg.layout.separate_rollout and cfg.layout.rollout_world_size == 1 and cfg.layout.rollout.dp == 1
    assert cfg.algorithm.rollout_correction.rollout_is == "token"  # on by default in the asynchronous modes
    off = load_config(TINY["gspo"], [*ONE_STEP_OFF, "algorithm.rollout_correction.rollout_is=null"])
    assert off.algorithm.rollout_correction.rollout_is is None  # ... unless the recipe says otherwise
    sync = load_config(TINY["gspo"], ["actor_rollout_ref.rollout.n_gpus_per_node=2"])  # verl's colocated mirror
    assert sync.async_training.mode == "sync" and not sync.algorithm.rollout_correction.rollout_is
    assert sync.layout.rollout_world_size == 2


# --- end to end --------------------------------------------------------------------------------


@pytest.fixture
def fresh_ray():
    """Each run starts its own local Ray, sized for its pools (a Ray left up keeps its CPU count)."""
    import ray

    ray.shutdown()
    yield ray
    ray.shutdown()


def _after_step_one(trainer) -> tuple[dict, list, list]:
    """Step 1's metrics, then greedy responses to fixed prompts and the engines' log-probs of them."""
    metrics = trainer.train_step(1)
    trainer.step = 1
    prompts = [trainer.val_data[i] for i in range(4)]
    probe = trainer.dispatch.generate(prompts, 2, trainer.sampling_params(1, validation=True))
    return metrics, probe.response_ids, probe.log_probs


@pytest.mark.slow
def test_one_step_off_runs_a_step_ahead_and_step_one_is_the_sync_run(tmp_path, fresh_ray):
    """Same seeds and initial weights: step 1 is the synchronous run's step 1 (its batch is made
    first, under the initial weights), and after its update the rollout pool's engines, in other
    processes, hold exactly the weights the colocated engines got in-process: the same greedy
    tokens and bit-equal log-probs. Steps 2 and 3 train on batches one version old."""
    from transformers import AutoModelForCausalLM

    both = ["algorithm.rollout_correction.rollout_is=token"]  # the sync run with one_step_off's default
    sync = _trainer(tmp_path, "sync", both)
    try:
        expected, tokens, log_probs = _after_step_one(sync)
    finally:
        sync.close()
    fresh_ray.shutdown()
    trainer = _trainer(tmp_path, "one_step_off", ONE_STEP_OFF + ["trainer.total_training_steps=3"])
    try:
        assert trainer.rollout_workers.world_size == 2 and trainer.workers.world_size == 2
        got, got_tokens, got_log_probs = _after_step_one(trainer)
        later = [trainer.train_step(step) for step in (2, 3)]
    finally:
        trainer.close()
    assert got_tokens == tokens and got_log_probs == log_probs
    # reshard/* describe the transport (rank 0 now takes the whole model), not the computation
    shared = sorted(k for k in expected if not k.startswith((*VOLATILE, "reshard/")))
    assert {k: got[k] for k in shared} == {k: expected[k] for k in shared}
    assert any(k.startswith("rollout_corr/") for k in got)  # the correction ran (its values are VOLATILE)
    assert [m["async/staleness_mean"] for m in (got, *later)] == [0.0, 1.0, 1.0]
    assert [m["async/staleness_max"] for m in (got, *later)] == [0.0, 1.0, 1.0]
    model_bytes = 4 * sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(trainer.model_dir).parameters())
    for m in (got, *later):
        assert m["reshard/broadcast_bytes"] == model_bytes and m["reshard/broadcast_gb_per_s"] > 0
        assert m["timing_s/gen"] > 0 and m["timing_s/wait_rollout"] >= 0 and m["timing_s/reshard"] > 0
    # later steps draw new prompts: the batch made ahead is step 2's, not step 1's again
    assert later[0]["data/prompt_hash"] != got["data/prompt_hash"]


@pytest.mark.slow
def test_a_dead_rollout_worker_is_named(tmp_path, fresh_ray):
    from recipe.workers.group import WorkerDiedError

    trainer = _trainer(tmp_path, "dead_rollout", ["async_training.mode=one_step_off",
                                                   "actor_rollout_ref.hybrid_engine=false",
                                                   "actor_rollout_ref.rollout.n_gpus_per_node=1"])
    try:
        fresh_ray.kill(trainer.rollout_workers.workers[0])
        with pytest.raises(WorkerDiedError, match="rollout worker rank 0 died during generation") as info:
            trainer.fit()
        assert "\n" not in str(info.value)
    finally:
        trainer.close()

"""async_training.mode=one_step_off and fully_async: their config, the weight sync to a rollout pool
of its own across processes, and their schedule end to end (real Ray, megatron-core on gloo ranks,
the transformers engine in processes of its own)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import re

import pytest
import torch

from megatron_bridge.errors import ConfigError
from recipe.config import load_config
from recipe.data.dataset import BatchSampler
from recipe.driver.async_schedule import AsyncSchedule
from recipe.driver.dispatch import PendingRollout
from recipe.driver.rollouts import Rollout
from recipe.driver.trainer import prompt_hash
from recipe.tracking.loggers import read_jsonl
from tests.distributed import free_port, run_ranks
from tests.recipe_runs import ONE_TRAIN_RANK, TINY, VOLATILE, start_trainer

ONE_STEP_OFF = ["async_training.mode=one_step_off", "actor_rollout_ref.hybrid_engine=false",
                "actor_rollout_ref.rollout.n_gpus_per_node=2"]
FULLY_ASYNC = ["async_training.mode=fully_async", "actor_rollout_ref.hybrid_engine=false",
               "actor_rollout_ref.rollout.n_gpus_per_node=2"]


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, says", [
    (["async_training.mode=fully_async"], "fully_async generates on the rollout's own devices: set "
                                          "actor_rollout_ref.hybrid_engine=false"),
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
    (["async_training.staleness_threshold=0.5"], "async_training.staleness_threshold=0.5 applies with "
                                                 "async_training.mode=fully_async only, not sync"),
    ([*ONE_STEP_OFF, "async_training.trigger_parameter_sync_step=1"], "trigger_parameter_sync_step=1 applies with "
                                                                     "async_training.mode=fully_async only, not "
                                                                     "one_step_off"),
    ([*FULLY_ASYNC, "async_training.require_batches=3"], r"require_batches=3: the step's data.train_batch_size "
                                                        r"\(16\) prompts .* set it to one of 1, 2, 4, 8, 16$"),
    ([*FULLY_ASYNC, "async_training.require_batches=16", "actor_rollout_ref.rollout.n=1"],
     r"require_batches x actor_rollout_ref.rollout.n = 16 / 16 x 1 = 1 responses per generation batch must split "
     r"over the rollout's "
     r"data_parallel_size \(2\)"),
    ([*FULLY_ASYNC, "async_training.require_batches=0"], "require_batches=0: must be >= 1"),
    ([*FULLY_ASYNC, "data.gen_batch_size=1"], "generates batches of data.train_batch_size / "
                                             "async_training.require_batches prompts .* drop the key$"),
    (["data.train_batch_size=0"], "data.train_batch_size=0: must be >= 1"),  # verl's fully-async 0 needs that mode
    ([*ONE_STEP_OFF, "async_training.require_batches=2"], "require_batches=2 applies with "
                                                         "async_training.mode=fully_async only"),
    ([*ONE_STEP_OFF, "async_training.partial_rollout=true"], "async_training.partial_rollout=True applies with "
                                                            "async_training.mode=fully_async only, not one_step_off"),
    ([*FULLY_ASYNC, "async_training.staleness_threshold=-0.1"], "staleness_threshold=-0.1: must be >= 0"),
    ([*FULLY_ASYNC, "async_training.trigger_parameter_sync_step=0"], "trigger_parameter_sync_step=0: must be >= 1"),
    ([*FULLY_ASYNC, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
     "filter_groups .* not implemented with async_training.mode=fully_async"),
    (["rollout.total_rollout_steps=10"], "only rollout.nnodes and rollout.n_gpus_per_node apply here"),
    ([*ONE_STEP_OFF, "async_training.weight_sync_backend=nccl"], "'nccl' is not a valid choice; choose from auto, gloo"),
])
def test_async_config_is_checked(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(TINY["gspo"], overrides)


def test_verls_fully_async_batch_of_zero_is_require_batches_mini_batches():
    """verl's fully-async scripts set data.train_batch_size=0: its trainer takes require_batches x
    ppo_mini_batch_size prompts a step."""
    cfg = load_config(TINY["gspo"], [*FULLY_ASYNC, "data.train_batch_size=0", "async_training.require_batches=2",
                                     "actor_rollout_ref.actor.ppo_mini_batch_size=8"])
    assert (cfg.data.train_batch_size, cfg.generation_batch_size) == (16, 8)
    cfg = load_config(TINY["gspo"], [*FULLY_ASYNC, "data.train_batch_size=0"])  # the recipe's mini-batch: 16
    assert (cfg.data.train_batch_size, cfg.generation_batch_size) == (16, 16)


def test_asynchronous_modes_config():
    cfg = load_config(TINY["gspo"], ["async_training.mode=one_step_off", "actor_rollout_ref.hybrid_engine=false",
                                     "rollout.nnodes=1", "rollout.n_gpus_per_node=1"])  # verl's recipe spelling
    assert cfg.layout.separate_rollout and cfg.layout.rollout_world_size == 1 and cfg.layout.rollout.dp == 1
    assert cfg.algorithm.rollout_correction.rollout_is == "token"  # on by default in the asynchronous modes
    assert (cfg.async_training.sync_every, cfg.async_training.max_staleness) == (1, 1)  # push every step, 1 behind
    fully = load_config(TINY["gspo"], FULLY_ASYNC)
    assert fully.algorithm.rollout_correction.rollout_is == "token" and fully.layout.rollout_world_size == 2
    assert not fully.async_training.partial_rollout  # ours; verl's default is true
    assert load_config(TINY["gspo"], [*FULLY_ASYNC, "async_training.partial_rollout=true"]).async_training.partial_rollout
    off = load_config(TINY["gspo"], [*ONE_STEP_OFF, "algorithm.rollout_correction.rollout_is=null"])
    assert off.algorithm.rollout_correction.rollout_is is None  # ... unless the recipe says otherwise
    sync = load_config(TINY["gspo"], ["actor_rollout_ref.rollout.n_gpus_per_node=2"])  # verl's colocated mirror
    assert sync.async_training.mode == "sync" and not sync.algorithm.rollout_correction.rollout_is
    assert sync.layout.rollout_world_size == 2


def test_vllm_generates_in_a_pool_of_its_own():
    """The 30B recipes (vLLM-Ascend) take the split: vLLM's ranks are the rollout pool's, TP x DP its
    devices, with partial rollout too (the engine votes on a pause between its steps), but not with
    the routes reported as well (the pausable step loop does not gather them)."""
    split = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.nnodes=2",
             "actor_rollout_ref.rollout.n_gpus_per_node=16"]
    cfg = load_config("qwen3_30b_a3b_gspo", [*split, "async_training.mode=one_step_off"])
    rollout = cfg.layout.rollout
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.layout.rollout_world_size == 32 == rollout.tp * rollout.dp
    assert load_config("qwen3_30b_a3b_gspo", [*split, "async_training.mode=fully_async"]).async_training.sync_every == 4
    partial = load_config("qwen3_30b_a3b_gspo", [*split, "async_training.mode=fully_async",
                                                 "async_training.partial_rollout=true"])
    assert partial.async_training.partial_rollout and partial.actor_rollout_ref.rollout.name == "vllm"
    with pytest.raises(ConfigError, match=r"partial_rollout=true with rollout.name=vllm and "
                                          r"rollout.enable_rollout_routing_replay=true is not implemented"):
        load_config("qwen3_30b_a3b_gspo", [*split, "async_training.mode=fully_async", "async_training.partial_rollout=true",
                                           "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"])


@pytest.mark.parametrize("overrides, sync_every, max_staleness", [
    ([], 4, 3),  # verl's defaults: T=4, staleness_threshold=0.1 (floor(0.4) = 0 batches beyond the interval)
    (["async_training.trigger_parameter_sync_step=2", "async_training.staleness_threshold=0.5"], 2, 2),
    (["async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=0"], 1, 0),
    (["async_training.trigger_parameter_sync_step=10", "async_training.staleness_threshold=0.3"], 10, 12),  # not 11
])
def test_fully_async_bounds_staleness_by_the_sync_interval_and_the_threshold(overrides, sync_every, max_staleness):
    a = load_config(TINY["gspo"], [*FULLY_ASYNC, *overrides]).async_training
    assert (a.sync_every, a.max_staleness) == (sync_every, max_staleness)


def float32_rollout():
    """A rollout rank's settings from the tiny GSPO recipe, its engine in float32."""
    from recipe.workers.settings import RankSettings

    return RankSettings.of(load_config(TINY["gspo"], ["actor_rollout_ref.rollout.dtype=float32"]))


# --- the schedule alone, with a rollout pool that answers at once or later ----------------------


def _response(tokens: int, reason: str) -> Rollout:
    return Rollout(samples=[None], groups=torch.zeros(1), response_ids=[[0] * tokens], log_probs=[[0.0] * tokens],
                   finish_reasons=[reason])


class _Pool:
    """Dispatch's generation calls: a generation is done when ``finished`` says so at the first poll
    that asks (collect always gets it); records each send's step and the version the engines held.
    Each generation is one response; a pause adds a token to the first in flight (it was running)
    and holds the rest where they are (queued behind it); its end adds one more."""

    def __init__(self, finished):
        self.finished, self.sent, self.rounds, self.schedule = finished, [], [], None

    def request(self, step, index):
        """Records (generation batch number over the run, the engines' version)."""
        self.sent.append(((step - 1) * self.schedule.per_step + index + 1, self.schedule.pushed))
        return self.sent[-1][0]

    def start_generation(self, requests):
        """The batches sent together, as one round of the rollout ranks."""
        self.rounds.append(requests)
        return [PendingRollout([None], 1, refs=[0], key=batch) for batch in requests]  # refs[0]: its tokens so far

    def done(self, pending):
        return next(self.finished)

    def pause(self, pending, timeout_s):
        pending[0].refs[0] += 1
        return [(_response(p.refs[0], "paused" if i == 0 else "held"), p) for i, p in enumerate(pending)]

    def resume(self, pending):
        return pending

    def collect(self, pending, timeout_s):
        return _response(pending.refs[0] + 1, "stop")


def _schedule(sync_every, max_staleness, steps, validated, finished, resumed=0, partial_rollout=False, per_step=1,
              ahead=None):
    """Run the schedule as the trainer does, from step ``resumed`` on; each step's metrics and the
    pool's sends. ``ahead``: E, by default the K - (T - 1) of one generation batch per step."""
    pool = _Pool(finished)
    ahead = max_staleness - sync_every + 1 if ahead is None else ahead
    schedule = pool.schedule = AsyncSchedule(pool, pool.request, steps, sync_every, ahead, step=resumed,
                                             wait_timeout_s=60, partial_rollout=partial_rollout, per_step=per_step)
    metrics = []
    for step in range(resumed + 1, steps + 1):
        metrics.append(schedule.metrics(step, schedule.batch(step), step_seconds=1.0))
        schedule.after_update(step, dict, validates=step in validated)
    return metrics, pool.sent


def _staleness(*args, **kwargs):
    """The staleness of each step's batch (one version per batch without partial rollout), and the sends."""
    metrics, sent = _schedule(*args, **kwargs)
    return [m["async/staleness_max"] for m in metrics], sent


@pytest.mark.parametrize("sync_every, max_staleness, validated", [
    (1, 1, ()), (1, 0, ()), (1, 3, ()), (4, 3, ()), (2, 2, ()), (2, 2, (3,)), (3, 5, (4, 5)),
])
def test_each_batch_comes_from_the_first_pushed_version_that_keeps_it_within_the_bound(sync_every, max_staleness,
                                                                                      validated):
    """Whether the rollout keeps up or not (every poll finds the generation done, none does, or some
    do), batch b is generated under the first pushed version p with b - 1 - p <= K, never under a
    version past the bound, and every batch is sent once, in step order."""
    import random

    steps = 12
    pushes = sorted({0, *range(sync_every, steps + 1, sync_every), *validated})
    expected = [b - 1 - min(p for p in pushes if b - 1 - p <= max_staleness) for b in range(1, steps + 1)]
    rng = random.Random(0)
    for finished in (itertools.repeat(True), itertools.repeat(False), iter(lambda: rng.random() < 0.5, None)):
        behind, sent = _staleness(sync_every, max_staleness, steps, validated, finished)
        assert behind == expected
        assert [step for step, _ in sent] == list(range(1, steps + 1))
        assert all(step - 1 - version <= max_staleness for step, version in sent)
    assert max(expected) == max_staleness or steps <= max_staleness


@pytest.mark.parametrize("sync_every, per_step, staleness_threshold, validated", [
    (1, 2, 0.0, ()), (1, 2, 0.5, ()), (2, 3, 0.5, (3,)), (4, 2, 0.1, ()), (4, 4, 0.1, (6,)), (2, 2, 1.0, ()),
])
def test_require_batches_each_generation_batch_comes_from_the_first_version_that_allows_it(
        sync_every, per_step, staleness_threshold, validated):
    """R generation batches per step: batch g (numbered over the run) is made under the first pushed
    version p with g <= R (p + T) + E, E = floor(staleness_threshold x T x R); no step's tokens are
    more than K = T - 1 + ceil(E / R) versions behind (as the config derives it), and each reaches
    K somewhere; every batch is sent once, in order, whether the rollout keeps up or not."""
    import random

    cfg = load_config(TINY["gspo"], [*FULLY_ASYNC, f"async_training.trigger_parameter_sync_step={sync_every}",
                             f"async_training.require_batches={per_step}", "data.train_batch_size=48",
                             f"async_training.staleness_threshold={staleness_threshold}"]).async_training
    ahead, bound = cfg.batches_ahead, cfg.max_staleness
    assert (cfg.sync_every, cfg.generation_batches) == (sync_every, per_step)
    steps = 12
    pushes = sorted({0, *range(sync_every, steps + 1, sync_every), *validated})
    made_by = {g: min(p for p in pushes if g <= per_step * (p + sync_every) + ahead)
               for g in range(1, steps * per_step + 1)}
    rng = random.Random(0)
    for finished in (itertools.repeat(True), itertools.repeat(False), iter(lambda: rng.random() < 0.5, None)):
        metrics, sent = _schedule(sync_every, bound, steps, validated, finished, per_step=per_step, ahead=ahead)
        assert sent == list(made_by.items())
        behind = [step - 1 - min(made_by[g] for g in range((step - 1) * per_step + 1, step * per_step + 1))
                  for step in range(1, steps + 1)]
        assert [m["async/staleness_max"] for m in metrics] == behind
    assert max(behind) == bound


def test_batches_the_bound_allows_are_all_sent_at_once():
    """K = 3 (T = 4): while step 1 trains, batches 2-4 wait on the rollout ranks, not one at a time,
    with partial rollout too (a push pauses the one running and holds the others). They go as one
    round, which the ranks generate as one engine call, after batch 1, which the step waits for and
    which goes first, alone; the same after step 4's push, which allows batches 5-8."""
    for partial_rollout in (False, True):
        pool = _Pool(itertools.repeat(False))
        schedule = pool.schedule = AsyncSchedule(pool, pool.request, 8, 4, 0, step=0, wait_timeout_s=60,
                                                 partial_rollout=partial_rollout)
        schedule.batch(1)
        assert pool.sent == [(1, 0), (2, 0), (3, 0), (4, 0)]
        assert pool.rounds == [[1], [2, 3, 4]]
        for step in range(2, 5):
            schedule.batch(step)
        schedule.push(4, dict)
        schedule.batch(5)
        assert pool.rounds == [[1], [2, 3, 4], [5], [6, 7, 8]]


def test_one_step_off_and_the_synchronous_bound_stalenesses():
    ready = itertools.repeat(True)
    assert _staleness(1, 1, 4, (), ready)[0] == [0, 1, 1, 1]  # one_step_off: T = 1, K = 1
    assert _staleness(1, 0, 4, (), ready)[0] == [0, 0, 0, 0]  # staleness_threshold=0, T = 1: on-policy
    assert _staleness(4, 3, 8, (), ready)[0] == [0, 1, 2, 3, 0, 1, 2, 3]  # verl's defaults: T = 4, K = 3


def test_a_resumed_schedule_starts_from_the_resumed_weights():
    """Resumed after step 3 (T = 2, K = 2): the engines hold v3, so batches 4-6 come from it (0, 1, 2
    behind), batch 7 from step 4's push; the uninterrupted run's were 1, 2, 1, 2 behind."""
    ready = itertools.repeat(True)
    assert _staleness(2, 2, 8, (), ready)[0] == [0, 1, 2, 1, 2, 1, 2, 1]
    behind, sent = _staleness(2, 2, 8, (), ready, resumed=3)
    assert behind == [0, 1, 2, 2, 1]
    assert sent == [(4, 3), (5, 3), (6, 3), (7, 4), (8, 6)]


@pytest.mark.parametrize("sync_every, max_staleness, validated", [(1, 1, ()), (2, 2, (3,)), (3, 5, (4,))])
def test_partial_rollout_keeps_every_token_within_the_bound(sync_every, max_staleness, validated):
    """A push pauses the batch in flight, which goes on under the new weights: its tokens span two
    versions, none more than K behind; batches are still sent once each, in step order. (With K >= T
    a batch is in flight at a push; with K = T - 1 none is, partial rollout or not.)"""
    steps = 12
    for finished in (itertools.repeat(True), itertools.repeat(False)):
        metrics, sent = _schedule(sync_every, max_staleness, steps, validated, finished, partial_rollout=True)
        assert [step for step, _ in sent] == list(range(1, steps + 1))
        assert all(m["async/staleness_max"] <= max_staleness for m in metrics)
        spanning = [m for m in metrics if m["async/partial_rollout_resumes"]]
        assert spanning and all(m["async/staleness_mean"] < m["async/staleness_max"] for m in spanning)
    no_partial, _ = _schedule(sync_every, max_staleness, steps, validated, itertools.repeat(False))
    assert not any(m["async/partial_rollout_resumes"] for m in no_partial)


# --- partial rollout in the engine -----------------------------------------------------------------


def test_a_paused_and_continued_generation_is_the_uninterrupted_one(tmp_path):
    """Paused after 6 tokens (one response already stopped) and continued with the same weights: the
    same tokens, drawn from the same per-request samplers, and the same routes; the log-probs before
    the pause bit-equal, those after it up to the rounding of the continuation's prefill of the
    prompt and tokens so far (one pass instead of one per token)."""
    from megatron_bridge.tiny_model import save_tiny_checkpoint
    from recipe.rollout.base import SamplingParams
    from recipe.rollout.hf_engine import HFEngine
    from recipe.rollout.partial import resume
    from tests.numerics import log_prob_tolerance
    from tests.test_rollout_hf import PROMPTS, TINY as TINY_SPEC

    engine = HFEngine(save_tiny_checkpoint(tmp_path, 0), load_from_checkpoint=True, return_routed_experts=True)
    ids, tokens_before = [4, 5, 6], 6
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=3)
    stop = engine.generate(PROMPTS, params, request_ids=ids).token_ids[2][2]  # ends the last response early
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=3, stop_token_ids=(stop,))
    whole = engine.generate(PROMPTS, params, request_ids=ids)
    assert whole.finish_reasons == ["length", "length", "stop"] and len(whole.token_ids[2]) < tokens_before

    calls = itertools.count(1)

    def pause_in_the_last_forward(*_):  # the forward that gives token ``tokens_before``
        if next(calls) == tokens_before:
            engine.pause()

    hook = engine.model.register_forward_pre_hook(pause_in_the_last_forward)
    paused = engine.generate(PROMPTS, params, request_ids=ids)
    hook.remove()
    assert paused.finish_reasons == ["paused", "paused", "stop"]
    assert [len(t) for t in paused.token_ids[:2]] == [tokens_before] * 2

    assert paused.paused and not whole.paused
    continued = resume(engine, PROMPTS, ids, params, paused)
    assert continued.token_ids == whole.token_ids and continued.finish_reasons == whole.finish_reasons
    assert not continued.paused
    assert all(torch.equal(a, b) for a, b in zip(continued.routed_experts, whole.routed_experts))
    assert continued.log_probs[2] == whole.log_probs[2]
    for got, expected, prompt in zip(continued.log_probs[:2], whole.log_probs, PROMPTS):
        assert got[:tokens_before] == expected[:tokens_before]
        expected = torch.tensor(expected[tokens_before:])
        torch.testing.assert_close(torch.tensor(got[tokens_before:]), expected, rtol=0,
                                   atol=log_prob_tolerance(TINY_SPEC, expected, len(prompt) + len(got)))


def test_token_budgets_per_request_cut_the_responses_where_they_end(tmp_path):
    """``max_tokens`` per prompt (a continued request's rest of its budget): each response is the
    uniform run's up to its own budget, "length" there, unless a stop token came first."""
    from megatron_bridge.tiny_model import save_tiny_checkpoint
    from recipe.rollout.base import SamplingParams
    from recipe.rollout.hf_engine import HFEngine
    from tests.test_rollout_hf import PROMPTS

    engine = HFEngine(save_tiny_checkpoint(tmp_path, 0), load_from_checkpoint=True)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=5)
    whole = engine.generate(PROMPTS, params, request_ids=[0, 1, 2])
    cut = engine.generate(PROMPTS, params, request_ids=[0, 1, 2], max_tokens=[3, 12, 7])
    for budget, full, got, reason, full_reason in zip([3, 12, 7], whole.token_ids, cut.token_ids, cut.finish_reasons,
                                                      whole.finish_reasons):
        assert got == full[:budget]
        assert reason == ("stop" if full_reason == "stop" and len(full) <= budget else "length")
    assert [len(t) for t in cut.token_ids] == [min(b, len(t)) for b, t in zip([3, 12, 7], whole.token_ids)]
    with pytest.raises(ValueError, match="2 token budgets for 3 prompts"):
        engine.generate(PROMPTS, params, max_tokens=[3, 4])
    with pytest.raises(ValueError, match="a prompt's max_tokens must be >= 1, got 0"):
        engine.generate(PROMPTS, params, max_tokens=[3, 0, 4])


def test_responses_paused_at_different_tokens_continue_without_their_samplers(tmp_path):
    """vLLM's case: its steps do not keep every request at the same token, and it keeps no sampler
    across requests. Rows paused after 2 and 5 tokens continue with the rest of their own budgets;
    greedy, they end exactly as the uninterrupted responses. Sampled, each continues from a seed of
    its own (the call's seed and the tokens so far): the same on every resume, and the engine's
    generation of prompt + tokens so far with that seed."""
    from megatron_bridge.tiny_model import save_tiny_checkpoint
    from recipe.rollout.base import Generation, SamplingParams, request_seed
    from recipe.rollout.hf_engine import HFEngine
    from recipe.rollout.partial import RESUMED, resume
    from tests.test_rollout_hf import PROMPTS

    engine = HFEngine(save_tiny_checkpoint(tmp_path, 0), load_from_checkpoint=True)
    ids, at = [7, 8, 9], [2, 5]

    def paused_at(whole: Generation) -> Generation:  # rows 0 and 1 paused at ``at``, row 2 as it ended
        return Generation(token_ids=[t[:n] for t, n in zip(whole.token_ids, at)] + whole.token_ids[2:],
                          log_probs=[p[:n] for p, n in zip(whole.log_probs, at)] + whole.log_probs[2:],
                          finish_reasons=["paused", "paused", whole.finish_reasons[2]], paused=True)

    greedy = SamplingParams(temperature=0, max_tokens=10)
    whole = engine.generate(PROMPTS, greedy, request_ids=ids)
    continued = resume(engine, PROMPTS, ids, greedy, paused_at(whole))
    assert continued.token_ids == whole.token_ids and continued.finish_reasons == whole.finish_reasons
    assert [len(t) for t in continued.token_ids[:2]] == [10, 10] and not continued.paused

    sampled = SamplingParams(temperature=1.0, max_tokens=10, seed=11)
    whole = engine.generate(PROMPTS, sampled, request_ids=ids)
    paused = paused_at(whole)
    continued = resume(engine, PROMPTS, ids, sampled, paused)
    assert continued == resume(engine, PROMPTS, ids, sampled, paused)
    seed = request_seed(11, sum(at), stream=RESUMED)
    for i, n in enumerate(at):
        rest = engine.generate([PROMPTS[i] + whole.token_ids[i][:n]], dataclasses.replace(sampled, seed=seed),
                               request_ids=[ids[i]], max_tokens=[10 - n])
        assert continued.token_ids[i] == whole.token_ids[i][:n] + rest.token_ids[0]
        assert continued.log_probs[i][:n] == whole.log_probs[i][:n]
        assert continued.finish_reasons[i] == rest.finish_reasons[0]
    assert continued.token_ids[2] == whole.token_ids[2]


@pytest.mark.numerics
def test_a_rank_joins_the_calls_sent_together_and_answers_each_when_it_is_done(tmp_path):
    """A rollout rank's worker runs the calls the driver sent together (a round) with the same
    sampling (a step's generation batches) as one engine call: each gets what it gets alone (tokens
    exactly, log-probs up to rounding); its answer can be taken while the engine is still busy with
    the others; the calls' seconds add up to the round's. Calls of another sampling (another
    step's seed) run as engine calls of their own, and an error reaches every call of the round
    instead of the run."""
    import threading
    import time

    from megatron_bridge.tiny_model import save_tiny_checkpoint
    from recipe.rollout.base import SamplingParams
    from recipe.workers.rollout import GenerationCall, RolloutWorker
    from tests.test_rollout_hf import PROMPTS, close

    worker = RolloutWorker(float32_rollout(), save_tiny_checkpoint(tmp_path, 0), "cpu")
    step = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    alone = [worker.generate(PROMPTS[:2], [0, 1], step)[0], worker.generate(PROMPTS, [2, 3, 4], step)[0]]

    engine_calls, taken = [], threading.Event()
    generate = worker.engine.generate

    def held_after_the_first_answer(prompts, params, on_part, **kwargs):
        def part(i, out):
            on_part(i, out)
            if i == 0:
                assert taken.wait(60)
        engine_calls.append(len(prompts))
        return generate(prompts, params, on_part=part, **kwargs)

    worker.engine.generate = held_after_the_first_answer
    calls = [GenerationCall(PROMPTS[:2], [0, 1], step, key=1), GenerationCall(PROMPTS, [2, 3, 4], step, key=2)]
    start = time.perf_counter()
    runner = threading.Thread(target=worker.run, args=(calls,))
    runner.start()
    first, first_s = worker.result(1)
    assert not calls[1].answer.done()  # the engine is still at the second call
    taken.set()
    second, second_s = worker.result(2)
    runner.join(60)
    took = time.perf_counter() - start
    assert engine_calls == [5] and worker.calls == {} and worker.paused == {}
    for got, expected, prompts in ((first, alone[0], PROMPTS[:2]), (second, alone[1], PROMPTS)):
        assert got.token_ids == expected.token_ids and got.finish_reasons == expected.finish_reasons
        for prompt, a, b in zip(prompts, got.log_probs, expected.log_probs):
            close(a, torch.tensor(b), len(prompt) + len(a))
    assert 0 < first_s and 0 < second_s and first_s + second_s <= took

    engine_calls.clear()
    next_step = dataclasses.replace(step, seed=4)
    bad = [GenerationCall(PROMPTS, [0, 1, 2], next_step, key=3), GenerationCall([[512]], [0], step, key=4),
           GenerationCall(PROMPTS, [1, 2, 3], step, key=5)]
    worker.run(bad)  # answers every call, raises nothing
    assert engine_calls == [3, 4]  # the other step's alone, then the two of one step joined
    assert worker.result(3)[0].token_ids == worker.generate(PROMPTS, [0, 1, 2], next_step)[0].token_ids
    for key in (4, 5):
        with pytest.raises(ValueError, match=r"prompt 0 has token id 512 outside the vocabulary"):
            worker.result(key)


def test_a_pause_holds_the_generation_queued_behind_the_running_one(tmp_path):
    """A rollout rank's worker (the transformers engine): a pause stops the generation running after
    its current token and holds the one that starts next (it comes back empty, finish reason "held",
    without touching the engine); after the weights are in, both go on in the order sent, the paused
    one from its tokens so far, the held one from the start, and give what uninterrupted generations
    of the same requests give."""
    from megatron_bridge.tiny_model import save_tiny_checkpoint
    from recipe.rollout.base import SamplingParams
    from recipe.rollout.partial import paused_rows
    from recipe.workers.rollout import RolloutWorker
    from tests.test_rollout_hf import PROMPTS

    worker = RolloutWorker(float32_rollout(), save_tiny_checkpoint(tmp_path, 0), "cpu")
    params, tokens_before = SamplingParams(temperature=1.0, max_tokens=12, seed=3), 4
    requests = {1: [0, 1, 2], 2: [3, 4, 5]}
    whole = {key: worker.generate(PROMPTS, ids, params)[0] for key, ids in requests.items()}
    assert worker.paused == {}  # without a key nothing is kept

    calls = itertools.count(1)
    hook = worker.engine.model.register_forward_pre_hook(
        lambda *_: worker.pause() if next(calls) == tokens_before else None)
    running, _ = worker.generate(PROMPTS, requests[1], params, key=1)
    hook.remove()
    queued, seconds = worker.generate(PROMPTS, requests[2], params, key=2)
    assert paused_rows(running) and all(len(t) <= tokens_before for t in running.token_ids)
    assert all(whole[1].token_ids[i][:len(t)] == t for i, t in enumerate(running.token_ids))
    assert queued.finish_reasons == ["held"] * 3 and queued.token_ids == [[], [], []] and seconds == 0.0

    worker.release()
    assert worker.resume(3) is None  # nothing of call 3 waits here
    for key in requests:
        continued, _ = worker.resume(key)
        assert continued.token_ids == whole[key].token_ids
        assert continued.finish_reasons == whole[key].finish_reasons
    assert worker.paused == {} and worker.generate(PROMPTS, requests[2], params, key=4)[0].token_ids == whole[2].token_ids


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


@pytest.fixture(scope="module")
def one_step_off_run(tmp_path_factory):
    """Three one_step_off steps, with greedy responses probed after step 1 (``_after_step_one``):
    (the three steps' metrics, the probe's tokens and log-probs, the model's fp32 bytes). Two tests
    read it; the probe changes none of the later steps (per-request seeds, no push)."""
    import ray
    from transformers import AutoModelForCausalLM

    ray.shutdown()
    trainer = start_trainer(tmp_path_factory.mktemp("runs"), "one_step_off", ONE_STEP_OFF + ["trainer.total_training_steps=3"])
    try:
        assert trainer.rollout_workers.world_size == 2 and trainer.workers.world_size == 2
        # the rollout ranks' torch.distributed world of their own (vLLM's external launcher runs in it)
        assert [(i.rank, i.dp_rank, i.dp_size, i.tp_rank) for i in trainer.rollout_workers.infos] == [(0, 0, 2, 0),
                                                                                                 (1, 1, 2, 0)]
        first, tokens, log_probs = _after_step_one(trainer)
        metrics = [first, *(trainer.train_step(step) for step in (2, 3))]
        model_bytes = 4 * sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(trainer.model_dir).parameters())
    finally:
        trainer.close()
        ray.shutdown()
    return metrics, tokens, log_probs, model_bytes


@pytest.mark.slow
def test_one_step_off_runs_a_step_ahead_and_step_one_is_the_sync_run(tmp_path, fresh_ray, one_step_off_run):
    """Same seeds and initial weights: step 1 is the synchronous run's step 1 (its batch is made
    first, under the initial weights), and after its update the rollout pool's engines, in other
    processes, hold exactly the weights the colocated engines got in-process: the same greedy
    tokens and bit-equal log-probs. Steps 2 and 3 train on batches one version old."""
    both = ["algorithm.rollout_correction.rollout_is=token"]  # the sync run with one_step_off's default
    sync = start_trainer(tmp_path, "sync", both)
    try:
        expected, tokens, log_probs = _after_step_one(sync)
    finally:
        sync.close()
    (got, *later), got_tokens, got_log_probs, model_bytes = one_step_off_run
    assert got_tokens == tokens and got_log_probs == log_probs
    # reshard/* describe the transport (rank 0 now takes the whole model), not the computation
    shared = sorted(k for k in expected if not k.startswith((*VOLATILE, "reshard/")))
    assert {k: got[k] for k in shared} == {k: expected[k] for k in shared}
    assert any(k.startswith("rollout_corr/") for k in got)  # the correction ran (its values are VOLATILE)
    assert [m["async/staleness_mean"] for m in (got, *later)] == [0.0, 1.0, 1.0]
    assert [m["async/staleness_max"] for m in (got, *later)] == [0.0, 1.0, 1.0]
    for m in (got, *later):
        assert m["reshard/broadcast_bytes"] == model_bytes and m["reshard/broadcast_gb_per_s"] > 0
        assert m["timing_s/gen"] > 0 and m["timing_s/wait_rollout"] >= 0 and m["timing_s/reshard"] > 0
        # the trainer's wait and the rollout's time without generation, as shares of the step
        assert m["async/idle_ratio_trainer"] == pytest.approx(min(1.0, m["timing_s/wait_rollout"] / m["timing_s/step"]))
        assert 0.0 <= m["async/idle_ratio_rollout"] <= 1.0
        # the rollout pool's wait for the trainer: the step's seconds it did not generate
        assert m["timing_s/wait_train"] == pytest.approx(m["async/idle_ratio_rollout"] * m["timing_s/step"])
        # tokens per second per device of both pools: 2 training + 2 rollout ranks
        assert m["perf/throughput"] == pytest.approx(m["perf/total_num_tokens"] / (4 * m["timing_s/step"]))
    # steps 1 and 2 collect a batch (the next step's) at their push; step 3, the run's last, has none left
    assert [m["async/idle_ratio_rollout"] < 1.0 for m in (got, *later)] == [True, True, False]
    # later steps draw new prompts: the batch made ahead is step 2's, not step 1's again
    assert later[0]["data/prompt_hash"] != got["data/prompt_hash"]


@pytest.mark.slow
def test_fully_async_pushing_every_step_with_one_batch_ahead_is_one_step_off(tmp_path, fresh_ray, one_step_off_run):
    """trigger_parameter_sync_step=1 and staleness_threshold=1 (K = 0 + floor(1 x 1) = 1) is one_step_off's
    schedule: the same batches made under the same versions, so three steps log the same numbers."""
    one_batch_ahead = ["async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1"]
    trainer = start_trainer(tmp_path, "fully_async", FULLY_ASYNC + one_batch_ahead + ["trainer.total_training_steps=3"])
    try:
        fully_async = [trainer.train_step(step) for step in (1, 2, 3)]
    finally:
        trainer.close()
    timed = ("timing_s/", "perf/", "reshard/export_s", "reshard/broadcast_gb_per_s", "async/idle_ratio_")
    off, fully = ([{k: v for k, v in m.items() if not k.startswith(timed)} for m in run]
                  for run in (one_step_off_run[0], fully_async))
    assert fully == off
    assert [m["async/staleness_max"] for m in fully] == [0.0, 1.0, 1.0]
    assert [m["async/weight_pushes"] for m in fully] == [1.0, 1.0, 1.0]


@pytest.mark.slow
def test_r3_one_step_off_replays_the_routes_chosen_at_generation_time(tmp_path, fresh_ray):
    """R3 across versions: step 1's batch is routed by the engines under v0, the trainer's v0 agrees
    (fp32 on both sides: no mismatch, nothing overridden); step 2's batch was routed under v0 too,
    while the trainer holds v1, so the trainer's own routing disagrees on some slots and the replay
    overrides them with the generation-time routes."""
    r3 = ["actor_rollout_ref.actor.megatron.router_replay.mode=R3",
          "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
    trainer = start_trainer(tmp_path, "r3", [*ONE_STEP_OFF, *r3, "trainer.total_training_steps=2"])
    try:
        first, second = (trainer.train_step(step) for step in (1, 2))
    finally:
        trainer.close()
    assert [m["async/staleness_max"] for m in (first, second)] == [0.0, 1.0]
    assert first["moe/rollout_routing_mismatch/slot_frac"] == 0.0
    assert first["moe/replay_override/slot_frac"] == 0.0
    assert second["moe/rollout_routing_mismatch/slot_frac"] > 0.0
    assert second["moe/replay_override/slot_frac"] > 0.0


@pytest.mark.slow
def test_fully_async_holds_generation_back_to_the_staleness_bound(tmp_path, fresh_ray):
    """T=2, staleness_threshold=0.5: K = 2 - 1 + floor(0.5 x 2) = 2. With a rollout rank a second slower
    per generation, each batch still comes from the first pushed version that keeps it within K of the
    policy that trains on it: batch 4 is held back from v0 (it would be 3 behind) until step 2's push.
    A validation (test_freq=3: steps 3 and 4) pushes the weights first."""
    sync_every, max_staleness = 2, 2
    run = [*FULLY_ASYNC, f"async_training.trigger_parameter_sync_step={sync_every}",
           "async_training.staleness_threshold=0.5", "trainer.total_training_steps=4", "trainer.test_freq=3"]
    trainer = start_trainer(tmp_path, "bounded", run)
    try:
        _plant(trainer.rollout_workers.workers[0], "rollout.run", 1, "slow")
        trainer.fit()
    finally:
        trainer.close()
    logged = read_jsonl(str(tmp_path / "bounded" / "metrics.jsonl"))
    steps = [1, 2, 3, 4]
    pushed_after = [0, 2, 3]  # the initial weights, every T steps, before each validation (step 4's is the last)
    version = [min(p for p in pushed_after if step <= p + max_staleness + 1) for step in steps]
    assert [m["async/staleness_max"] for m in logged] == [step - 1 - v for step, v in zip(steps, version)] \
        == [0.0, 1.0, 2.0, 1.0]
    assert max(m["async/staleness_max"] for m in logged) == max_staleness
    assert [m["async/weight_pushes"] for m in logged] == [0.0, 1.0, 1.0, 1.0]
    assert [("val/score/mean" in m, "reshard/broadcast_bytes" in m) for m in logged] == [
        (False, False), (False, True), (True, True), (True, True)]
    assert logged[0]["timing_s/wait_rollout"] >= 1.0  # batch 1, slowed, waited for in full


@pytest.mark.slow
def test_fully_async_require_batches_trains_each_step_on_two_generation_batches_half_a_step_ahead(tmp_path, fresh_ray):
    """require_batches=2, T = 1, staleness_threshold=0.5: E = floor(0.5 x 1 x 2) = 1 generation batch
    ahead, K = 0 + ceil(1 / 2) = 1. Step t trains on generation batches 2t-1 and 2t, joined: the
    sampler's prompts of one step, in order, all rows; under v0 the engines may make batches 1-3, so
    step 2 trains on batch 3 (v0, one behind) and batch 4 (v1, on-policy), and so on: every later
    step's tokens are a mix, at most one version behind."""
    run = [*FULLY_ASYNC, "async_training.require_batches=2", "async_training.trigger_parameter_sync_step=1",
           "async_training.staleness_threshold=0.5", "trainer.total_training_steps=3"]
    trainer = start_trainer(tmp_path, "halves", run)
    try:
        assert trainer.sampler.batch_size == 8  # train_batch_size 16 in two generation batches
        metrics = [trainer.train_step(step) for step in (1, 2, 3)]
        s = trainer.sampler
        fresh = BatchSampler(s.size, 16, shuffle=s.shuffle, seed=s.seed, drop_last=s.drop_last)
        expected = [prompt_hash([trainer.train_data[i] for i in fresh.next_batch()]) for _ in range(3)]
    finally:
        trainer.close()
    assert [m["data/prompt_hash"] for m in metrics] == expected
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0]
    assert metrics[0]["async/staleness_mean"] == 0.0 and all(0.0 < m["async/staleness_mean"] < 1.0 for m in metrics[1:])
    assert all(m["async/weight_pushes"] == 1.0 for m in metrics)
    for m in metrics:  # every row of both halves trained: 16 prompts x rollout.n 8
        rows = m["perf/total_num_tokens"] / (m["prompt_length/mean"] + m["response_length/mean"])
        assert rows == pytest.approx(16 * 8)


@pytest.mark.slow
def test_fully_async_partial_rollout_continues_the_batches_in_flight_under_the_pushed_weights(tmp_path, fresh_ray):
    """T = 1, K = 2 (staleness_threshold 2) with partial_rollout and R3: rollout rank 0 decodes
    slowly (0.25 s a token) and not at all while the trainer trains (from the moment a step has its
    batch until a push pauses it), so each push finds two batches in flight on it, one generating
    and one queued, however slow the trainer. The push pauses the first and holds the second, the
    weights go out and both go on under them: steps 2-4 train on batches whose tokens come from
    several versions (a mean strictly below the max), none more than K behind, K reached, and the
    routes recorded across the swaps replay (the run completes)."""
    run = [*FULLY_ASYNC, "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=2",
           "async_training.partial_rollout=true", "actor_rollout_ref.actor.megatron.router_replay.mode=R3",
           "actor_rollout_ref.rollout.enable_rollout_routing_replay=true", "trainer.total_training_steps=4"]
    trainer = start_trainer(tmp_path, "partial", run)
    hold = tmp_path / "hold"
    try:
        assert trainer.cfg.async_training.max_staleness == 2
        _plant(trainer.rollout_workers.workers[0], "rollout.engine.model.forward", 1, "slow", seconds=0.25)
        _hold_decoding_while(trainer.rollout_workers.workers[0], hold)
        schedule = trainer.generation
        batch, push = schedule.batch, schedule.push

        def batch_then_hold(step, index=0):
            rollout = batch(step, index)
            hold.touch()
            return rollout

        def push_then_release(step, sync):
            result = push(step, sync)
            hold.unlink()
            return result

        schedule.batch, schedule.push = batch_then_hold, push_then_release
        metrics = [trainer.train_step(step) for step in (1, 2, 3, 4)]
    finally:
        hold.unlink(missing_ok=True)
        trainer.close()
    assert [m["async/weight_pushes"] for m in metrics] == [1.0] * 4
    assert metrics[0]["async/staleness_max"] == 0.0 and metrics[0]["async/partial_rollout_resumes"] == 0.0
    for m in metrics[1:]:
        assert m["async/partial_rollout_resumes"] > 0
        assert 0.0 < m["async/staleness_mean"] < m["async/staleness_max"] <= 2.0
        assert m["moe/replay_override/slot_frac"] > 0.0  # the replayed routes include those of older versions
    assert max(m["async/staleness_max"] for m in metrics) == 2.0


# --- faults: each one line naming what failed, no hang, the checkpoint resumable ---------------------


def _plant(actor, attribute: str, call: int, fault: str, seconds: float = 1.0) -> None:
    """Plant a fault in a worker's process, as a crash or a hang would strike it there: ``attribute``
    (a dotted path from the Ray actor's instance to a method) works as before until its ``call``-th
    call from now, which ends the process (``fault="exit"``), never returns (``"stall"``) or, with
    every later call, takes ``seconds`` longer (``"slow"``)."""
    import ray

    def plant(instance):
        import functools
        import itertools
        import os
        import time

        *path, name = attribute.split(".")
        owner = functools.reduce(getattr, path, instance)
        original, calls = getattr(owner, name), itertools.count(1)

        def planted(*args, **kwargs):
            count = next(calls)
            if count == call and fault == "exit":
                os._exit(1)
            if count >= call and fault != "exit":
                time.sleep(seconds if fault == "slow" else 3600)
            return original(*args, **kwargs)

        setattr(owner, name, planted)

    ray.get(actor.__ray_call__.remote(plant))


def _hold_decoding_while(actor, hold) -> None:
    """A rollout rank's engine decodes no token while the file ``hold`` exists, unless a pause is
    asked for: then the token in progress ends and the pause takes the responses so far."""
    import ray

    def plant(instance):
        import time

        engine = instance.rollout.engine
        forward = engine.model.forward

        def held(*args, **kwargs):
            while hold.exists() and not engine._pause.is_set():
                time.sleep(0.01)
            return forward(*args, **kwargs)

        engine.model.forward = held

    ray.get(actor.__ray_call__.remote(plant))


def _failed_run(tmp_path, name: str, overrides: list[str], fault) -> tuple[int, list[str], str]:
    """Start a run, ``fault(trainer)``, train it as ``recipe.main`` would end it: its exit status, the
    lines of its error message (the error, then its notes) and the node the ranks ran on. The faults
    are the rollout pool's and the weight sync's, so their runs train on one rank (``ONE_TRAIN_RANK``
    in their overrides)."""
    import ray

    from recipe.main import run_reporting

    def body():
        trainer = start_trainer(tmp_path, name, overrides)
        try:
            fault(trainer)
            trainer.fit()
        finally:
            trainer.close()

    with open(tmp_path / f"{name}.err", "w+") as err:
        with contextlib.redirect_stderr(err):  # Ray's log lines come here too
            status = run_reporting(body)
        err.seek(0)
        lines = err.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    message = [lines[start]] + [line for line in lines[start + 1:] if line.startswith("  (")]
    return status, message, ray.util.get_node_ip_address()


@pytest.mark.slow
def test_a_rollout_rank_that_dies_in_generation_is_named_and_the_run_resumes(tmp_path, fresh_ray):
    """Rollout rank 1 ends (os._exit) while it generates step 3's batch, sent off during step 2: the
    run ends at step 2's wait for that batch with one line naming the rank and its node, exit status 1,
    and the same command resumes from step 1's checkpoint to the end."""
    run = [*ONE_TRAIN_RANK, *ONE_STEP_OFF, "trainer.total_training_steps=3", "trainer.save_freq=1"]
    # generations from the start: 1 is step 1's batch, 2 step 2's (sent during step 1), 3 step 3's
    status, message, node = _failed_run(tmp_path, "dies", run, lambda trainer: _plant(
        trainer.rollout_workers.workers[1], "rollout.run", 3, "exit"))
    assert status == 1
    assert re.fullmatch(rf"error: rollout worker rank 1 on node {re.escape(node)} died during generation: \w+",
                        message[0]), message
    checkpoint = tmp_path / "dies" / "checkpoints" / "global_step_1"
    assert message[1:] == [f"  (in step 2; last completed step: 1; a re-run resumes from {checkpoint} (step 1))"]
    resumed = start_trainer(tmp_path, "dies", run)
    try:
        assert resumed.step == 1
        resumed.fit()
    finally:
        resumed.close()
    logged = {m["step"]: m for m in read_jsonl(str(tmp_path / "dies" / "metrics.jsonl"))}
    assert sorted(logged) == [1, 2, 3]
    # the resumed run makes its first batch afresh (step 2: current weights), then runs a step ahead
    assert [logged[step]["async/staleness_max"] for step in (1, 2, 3)] == [0.0, 0.0, 1.0]
    # step 2's batch, made ahead during step 1 and lost with the rank, is drawn again, not skipped:
    # steps 1-3 trained the sampler's first three batches, as an uninterrupted run does
    s = resumed.sampler
    fresh = BatchSampler(s.size, s.batch_size, shuffle=s.shuffle, seed=s.seed, drop_last=s.drop_last)
    expected = [prompt_hash([resumed.train_data[i] for i in fresh.next_batch()]) for _ in range(3)]
    assert [logged[step]["data/prompt_hash"] for step in (1, 2, 3)] == expected


@pytest.mark.slow
def test_a_rollout_rank_that_hangs_in_generation_fails_the_wait_for_its_batch(tmp_path, fresh_ray):
    """Rollout rank 1 never answers step 3's generation (sent off during step 2): the wait for that
    batch ends after async_training.wait_rollout_timeout_s with one line naming the rank, exit 1, and
    the last checkpoint stays the one to resume from."""
    run = [*ONE_TRAIN_RANK, *ONE_STEP_OFF, "trainer.total_training_steps=3", "trainer.save_freq=1",
           "async_training.wait_rollout_timeout_s=10"]
    status, message, node = _failed_run(tmp_path, "hangs", run, lambda trainer: _plant(
        trainer.rollout_workers.workers[1], "rollout.run", 3, "stall"))
    assert status == 1
    assert message[0] == (f"error: no batch from the rollout pool within async_training.wait_rollout_timeout_s=10 s: "
                          f"rollout worker rank 1 on node {node} did not answer generation within 10 s (hung, or "
                          "generating slower than that: then raise it)"), message
    checkpoint = tmp_path / "hangs" / "checkpoints" / "global_step_1"
    assert message[1:] == [f"  (in step 2; last completed step: 1; a re-run resumes from {checkpoint} (step 1))"]


ONE_ROLLOUT_RANK = [*ONE_TRAIN_RANK, "async_training.mode=one_step_off", "actor_rollout_ref.hybrid_engine=false",
                    "actor_rollout_ref.rollout.n_gpus_per_node=1", "async_training.weight_sync_timeout_s=3"]


@pytest.mark.slow
def test_a_rollout_rank_that_dies_in_the_weight_broadcast_is_named(tmp_path, fresh_ray):
    """The rollout rank ends (os._exit) in step 1's weight broadcast, having received nothing: one line
    naming it, its node and the weight sync, before any timeout could end the wait."""
    status, message, node = _failed_run(tmp_path, "dies_in_sync", ONE_ROLLOUT_RANK, lambda trainer: _plant(
        trainer.rollout_workers.workers[0], "weights.broadcast", 1, "exit"))
    assert status == 1
    assert re.fullmatch(rf"error: rollout worker rank 0 on node {re.escape(node)} died during weight sync: \w+",
                        message[0]), message
    assert message[1:] == [f"  (in step 1; last completed step: 0; a re-run starts fresh (no checkpoint in "
                           f"{tmp_path / 'dies_in_sync' / 'checkpoints'}))"]


@pytest.mark.slow
def test_a_death_is_found_within_the_notice_and_a_live_or_finished_worker_is_not_dead(fresh_ray):
    """``any_died``, which lets sync_weights name a rollout rank that died even where the send
    failed first: a worker whose process ended is reported dead; one still running is not, after
    the notice; one that finished is not, at once."""
    import os
    import time

    from recipe.workers.group import any_died, init_ray

    init_ray("cpu", 2)

    @fresh_ray.remote
    class Worker:
        def exit(self):
            os._exit(1)

        def wait(self, seconds):
            time.sleep(seconds)
            return seconds

    ending, waiting, finishing = Worker.remote(), Worker.remote(), Worker.remote()
    done = finishing.wait.remote(0)
    assert any_died([done, ending.exit.remote()], 30)
    start = time.monotonic()
    assert not any_died([waiting.wait.remote(60)], 1) and time.monotonic() - start < 10
    start = time.monotonic()
    assert not any_died([done], 30) and time.monotonic() - start < 5


@pytest.mark.slow
def test_a_rollout_rank_that_stalls_in_the_weight_broadcast_fails_the_send_in_time(tmp_path, fresh_ray):
    """The rollout rank stops answering in step 1's weight broadcast (as a stopped process would):
    the send gives up after async_training.weight_sync_timeout_s and the run ends with one line
    naming the weight sync and training rank 0, not a wait without end on the stalled rank."""
    status, message, node = _failed_run(tmp_path, "rollout_stalls", ONE_ROLLOUT_RANK, lambda trainer: _plant(
        trainer.rollout_workers.workers[0], "weights.broadcast", 1, "stall"))
    assert status == 1
    assert re.fullmatch(r"error: weight sync to the rollout pool over gloo failed in the broadcast from training rank 0: "
                        r".*\(each rank waits async_training.weight_sync_timeout_s=3 s for the others: raise it if the "
                        r"export is that slow, else a peer died or stalled\)", message[0]), message
    assert message[1] == f"  (raised by worker rank 0 on node {node} during weight sync)", message


@pytest.mark.slow
def test_a_weight_broadcast_that_times_out_is_one_error_naming_the_weight_sync(tmp_path, fresh_ray):
    """Training rank 0 stalls before step 1's broadcast (as it would behind a hung export): the rollout
    rank gives up after async_training.weight_sync_timeout_s, and the run ends with one line saying the
    weight sync failed, why and which key bounds the wait, the rank that raised it in a note."""
    status, message, node = _failed_run(tmp_path, "stalls", ONE_ROLLOUT_RANK, lambda trainer: _plant(
        trainer.workers.workers[0], "weights.broadcast", 1, "stall"))
    assert status == 1
    assert message == [
        "error: weight sync to the rollout pool over gloo failed in the broadcast from training rank 0: Timed out waiting "
        "3000ms for recv operation to complete (each rank waits async_training.weight_sync_timeout_s=3 s for the "
        "others: raise it if the export is that slow, else a peer died or stalled)",
        f"  (raised by rollout worker rank 0 on node {node} during weight sync)",
        f"  (in step 1; last completed step: 0; a re-run starts fresh (no checkpoint in "
        f"{tmp_path / 'stalls' / 'checkpoints'}))",
    ]


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

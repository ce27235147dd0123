"""Every layout the validator accepts runs: for the tiny model on 2 and on 4 CPU gloo ranks, each
accepted layout loads the checkpoint, gives transformers' log-probs and takes a GSPO step with the
loss and gradient norm of plain data parallel. A layout that passes ``plan check`` and then crashes
or computes something else is a validator bug.

One process group per world size runs all of its layouts: megatron's parallel state is torn down
and built again between them (spawning ranks costs more than a layout).
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import product

import pytest

from megatron_bridge.plan.layout import Cluster, Layout, RolloutParallel, TrainParallel
from megatron_bridge.plan.model_spec import load_model_spec
from megatron_bridge.plan.validate import divisors, validate
from megatron_bridge.tiny_model import save_tiny_checkpoint
from tests.distributed import reset_parallel_state, run_ranks
from tests.numerics import log_prob_tolerance
from tests.test_actor_update import LOSSES, make_batch, max_grad, tolerances

TINY = load_model_spec("tiny_qwen3_moe")
WORLD_SIZES = (2, 4)
SEQ_LEN = 16  # what the SP / CP rules are checked against; the batch is shorter, padded to TP
MICRO_BATCH = 2  # 1 to 4 micro-batches per DP rank, at least PP (the interleaved schedule needs it)
RECOMPUTE = (  # one representative layout per setting
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective"),
)


def layout(train: TrainParallel, world_size: int) -> Layout:
    return Layout("sweep", train=train, rollout=RolloutParallel(tp=1, dp=world_size),
                  cluster=Cluster(nnodes=1, devices_per_node=world_size, device="cpu"))


def candidates(world_size: int):
    """Every combination of the parallel settings on this world size; sequence parallel as TP
    needs it (the other choice breaks a rule whatever the rest). Context parallel splits sequences,
    not layers: CP > 1 goes with the default pipeline split only (the split's variants run at CP 1)."""
    sizes = divisors(world_size)
    stage_layers = (None, *range(1, TINY.num_layers))
    for tp, pp, cp, ep, etp in product(sizes, repeat=5):
        splits = product((None, *range(2, TINY.num_layers + 1)), stage_layers, stage_layers, (False, True),
                         (False, True)) if cp == 1 else [(None, None, None, False, False)]
        for vpp, first, last, embedding, loss in splits:
            yield TrainParallel(
                tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, sequence_parallel=tp > 1,
                first_stage_layers=first, last_stage_layers=last,
                account_for_embedding_in_pipeline_split=embedding, account_for_loss_in_pipeline_split=loss,
            )


def accepted(world_size: int) -> list[TrainParallel]:
    """The accepted candidates, plain data parallel first (the reference), then the recompute
    settings on the most split of them."""
    ok = lambda t: not validate(TINY, layout(t, world_size), SEQ_LEN)  # noqa: E731
    valid = [t for t in candidates(world_size) if ok(t)]
    most_split = max(valid, key=lambda t: (t.tp * t.pp * t.ep, t.vpp or 1))
    return valid + [t for t in (replace(most_split, **r) for r in RECOMPUTE) if ok(t)]


def name(t: TrainParallel) -> str:
    parts = [f"tp{t.tp}", f"pp{t.pp}", f"ep{t.ep}", f"etp{t.expert_tp}"] + ([f"cp{t.cp}"] if t.cp > 1 else [])
    parts += [f"vpp{t.vpp}"] if t.vpp else []
    parts += [f"first{t.first_stage_layers}"] if t.first_stage_layers else []
    parts += [f"last{t.last_stage_layers}"] if t.last_stage_layers else []
    parts += ["emb"] if t.account_for_embedding_in_pipeline_split else []
    parts += ["loss"] if t.account_for_loss_in_pipeline_split else []
    parts += [f"recompute_{t.recompute_granularity}_{t.recompute_method}"] if t.recompute_granularity else []
    return "_".join(parts)


# ---- the enumeration (fast) ----------------------------------------------------------------


def test_the_sweep_enumerates_every_setting_and_drops_what_megatron_breaks_on():
    for w in WORLD_SIZES:
        layouts = accepted(w)
        assert layouts[0] == TrainParallel(etp=1)
        assert {t.tp for t in layouts} == {t.pp for t in layouts} == {t.ep for t in layouts} == set(divisors(w))
        assert {t.expert_tp for t in layouts} == {t.cp for t in layouts} == set(divisors(w))
        assert w == 2 or any(t.cp > 1 and t.tp > 1 for t in layouts) and any(t.cp > 1 and t.ep > 1 for t in layouts)
        assert {t.vpp for t in layouts} == {None, 2, 3}  # VPP3: 4 layers + embedding + loss on PP2
        assert any(t.first_stage_layers for t in layouts) and any(t.last_stage_layers for t in layouts)
        assert any(t.account_for_embedding_in_pipeline_split and t.pp > 1 for t in layouts)
        assert {t.recompute_granularity for t in layouts} == {None, "full", "selective"}
    # Enumerated, and rejected (see test_plan_validate for the messages).
    known_bad = [
        TrainParallel(tp=2, etp=1, sequence_parallel=True),  # issue 16: the first forward fails
        TrainParallel(etp=2),  # a wrong gradient
        TrainParallel(pp=2, etp=1, first_stage_layers=1, last_stage_layers=3),  # ZeroDivisionError
        TrainParallel(pp=2, vpp=2, etp=1, last_stage_layers=2),  # layers built twice: wrong log-probs
    ]
    two = set(candidates(2))
    assert all(t in two for t in known_bad) and not set(known_bad) & set(accepted(2))


# ---- every accepted layout runs (slow) -----------------------------------------------------


def _run_layout(train: TrainParallel, checkpoint: str, batch: dict, reference) -> dict:
    from functools import partial

    import torch
    from megatron.core import parallel_state as ps

    from loss.megatron_hook import policy_loss_func
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.optim import OptimConfig
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.verify import sharded_log_probs, whole_sequence_batch

    initialize_parallel(train)
    actor = MegatronActor(TINY, train, BuildOptions(params_dtype=torch.float32), OptimConfig(lr=1e-3), "cpu")
    actor.load_hf(checkpoint)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(dp_rank * len(reference) // dp, (dp_rank + 1) * len(reference) // dp)
    log_probs, _ = sharded_log_probs(actor, whole_sequence_batch(batch["input_ids"][rows]), MICRO_BATCH)
    metrics = actor.train_step({k: v[rows] for k, v in batch.items()}, MICRO_BATCH,
                               partial(policy_loss_func, LOSSES["gspo"]))
    return {"max_delta": float((log_probs - reference[rows]).abs().max()), "max_grad": max_grad(actor), **metrics}


def _sweep(rank, world_size, layouts, checkpoint, batch, reference):
    results = {}
    for train in layouts:
        try:
            results[name(train)] = _run_layout(train, checkpoint, batch, reference)
        except Exception as e:  # name the layout; the other ranks fail with it in their collectives
            raise RuntimeError(f"layout {name(train)} on {world_size} ranks: {e}") from e
        reset_parallel_state()
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_bridge.verify import reference

    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_hf"), seed=1)
    batch = make_batch(checkpoint)
    return checkpoint, batch, reference(checkpoint, batch["input_ids"])[0]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_accepted_layout_runs_a_forward_and_a_train_step(setup, world_size, tmp_path):
    checkpoint, batch, reference = setup
    layouts = accepted(world_size)
    per_rank = run_ranks(_sweep, world_size, tmp_path, layouts, checkpoint, batch, reference)
    dp = per_rank[0][name(layouts[0])]
    assert dp["actor/skipped"] == 0 and 0 < dp["actor/pg_clipfrac"] < 1
    log_prob = log_prob_tolerance(TINY, reference, batch["input_ids"].shape[1])
    tolerance = tolerances(checkpoint, batch, {**dp, "max_grad": max(r[name(layouts[0])]["max_grad"] for r in per_rank)})
    for t in layouts:
        for rank, results in enumerate(per_rank):
            got, where = results[name(t)], f"{name(t)}, rank {rank}"
            assert got["max_delta"] < log_prob, where
            assert got["actor/skipped"] == 0 and math.isfinite(got["actor/grad_norm"]), where
            # the same mini-batch: the same loss and gradient in every layout
            for key in ("actor/pg_loss", "actor/grad_norm"):
                assert got[key] == pytest.approx(dp[key], rel=0, abs=tolerance[key]), where

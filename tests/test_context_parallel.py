"""Context parallel (CP) on CPU gloo ranks: each rank holds megatron's load-balanced chunks of every
sequence, attends over the CP group's whole K/V, and scores the tokens it holds; the rows' log-probs
are summed over CP before the loss. So one update under CP2 is the update under CP1 -- loss,
gradient norm, every metric and the optimizer step -- within the rounding of its sums, for GSPO,
GSPO-token and GRPO under every aggregation mode, with dynamic batch size, packed, and beside TP
(sequence parallel), EP or PP on 4 ranks."""

import pytest
import torch

from loss import PolicyLossSettings
from loss.aggregation import LOSS_AGG_MODES
from loss.megatron_hook import ActorLossConfig
from megatron_bridge.runtime import context_parallel
from tests.test_actor_update import assert_same_update, checkpoint_and_batch, run_splits

# clip ranges where the batch has clipped and unclipped tokens (sequences, for GSPO)
CLIP = {"gspo": dict(clip_ratio_low=0.2, clip_ratio_high=0.2), "gspo_token": dict(clip_ratio_low=0.2, clip_ratio_high=0.2),
        "vanilla": dict(clip_ratio_low=0.2, clip_ratio_high=0.28)}
# GRPO as the recipe's preset runs it: KL loss and an entropy bonus beside the clipped ratio
GRPO_TERMS = dict(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
LOSSES = {
    f"{mode}:{agg}": ActorLossConfig(loss_mode=mode, policy=PolicyLossSettings(**CLIP[mode], loss_agg_mode=agg),
                                     **(GRPO_TERMS if mode == "vanilla" else {}))
    for mode in ("gspo", "gspo_token", "vanilla") for agg in LOSS_AGG_MODES
}
# beside TP and EP, one loss per algorithm, each with the aggregation its recipe uses
DEFAULTS = {name: LOSSES[name] for name in ("gspo:seq-mean-token-mean", "gspo_token:seq-mean-token-mean",
                                            "vanilla:token-mean")}
SPLITS = {  # name: (ranks, layout, micro-batch rows, token budget per CP group, losses)
    "cp1_mb4": (1, {}, 4, None, LOSSES),
    # dynamic batch size: micro-batches of the rows that fit 24 tokens, each padded to its own longest
    "cp2_tokens24": (2, {"cp": 2}, 1, 24, LOSSES),
    # packed: each row padded to a multiple of 2 x CP, then split on its own
    "cp2_mb4_packed": (2, {"cp": 2, "pack": True}, 4, None, DEFAULTS),
    "tp2_sp_cp2_tokens24": (4, {"tp": 2, "sequence_parallel": True, "cp": 2}, 1, 24, DEFAULTS),
    # EP2 over the CP ranks, DP2
    "ep2_cp2_tokens24": (4, {"ep": 2, "etp": 1, "cp": 2}, 1, 24, DEFAULTS),
    # the pipeline sends each rank's 1/CP of the hidden states
    "pp2_cp2_mb2": (4, {"pp": 2, "cp": 2}, 2, None, DEFAULTS),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return checkpoint_and_batch(tmp_path_factory)


@pytest.fixture(scope="module")
def updates(setup, tmp_path_factory):
    return run_splits(setup, SPLITS, LOSSES, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("split", [s for s in SPLITS if s != "cp1_mb4"])
def test_cp_update_equals_cp1(setup, updates, split):
    losses = SPLITS[split][-1]
    for name, loss in losses.items():
        assert_same_update(setup, updates["cp1_mb4"], updates[split], name, loss)


def test_each_rank_holds_the_load_balanced_chunks():
    # 16 tokens, CP 2: chunks of 4; rank 0 holds the first and the last, rank 1 the middle two
    assert context_parallel.held(16, cp=2, rank=0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context_parallel.held(16, cp=2, rank=1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # packed: each sequence (8 and 4 tokens) split on its own
    bounds = torch.tensor([0, 8, 12])
    assert context_parallel.held(12, bounds, cp=2, rank=0).tolist() == [0, 1, 6, 7, 8, 11]
    assert context_parallel.held(12, bounds, cp=2, rank=1).tolist() == [2, 3, 4, 5, 9, 10]
    # every position held exactly once
    everyone = torch.cat([context_parallel.held(24, cp=3, rank=r) for r in range(3)])
    assert sorted(everyone.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="does not split into 4 equal chunks for CP = 2"):
        context_parallel.held(10, cp=2, rank=0)


def test_mindspeeds_ulysses_and_hybrid_splits():
    # Ulysses: one contiguous 1/CP slice each
    assert [context_parallel.held(8, cp=2, rank=r, ulysses=2).tolist() for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # hybrid, CP 4 with a Ulysses degree of 2: two ring ranks hold the load-balanced halves (chunks 0
    # and 3, chunks 1 and 2), each cut in two contiguous parts
    assert [context_parallel.held(16, cp=4, rank=r, ulysses=2).tolist() for r in range(4)] == [
        [0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]

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


def _chunk_by_chunk(bounds: list[int], cp: int, rank: int, ulysses: int) -> list[int]:
    """The split as it is defined: every part cut into 2 x ring chunks (ring = CP / ulysses; one
    chunk without a ring), the ring rank's two chunks joined, the rank's contiguous cut of them."""
    ring = cp // ulysses
    chunks = 2 * ring if ring > 1 else 1
    held = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        size = (end - start) // chunks
        share = [start + c * size + i for c in ([rank // ulysses, chunks - 1 - rank // ulysses] if ring > 1 else [0])
                 for i in range(size)]
        cut = len(share) // ulysses
        held += share[rank % ulysses * cut:(rank % ulysses + 1) * cut]
    return held


@pytest.mark.parametrize("cp,ulysses", [(2, 1), (3, 1), (4, 1), (2, 2), (4, 2), (8, 4), (6, 3)])
def test_the_split_computed_at_once_is_the_chunk_by_chunk_one(cp, ulysses):
    unit = (2 * (cp // ulysses) if cp > ulysses else 1) * ulysses
    gen = torch.Generator().manual_seed(cp * 10 + ulysses)
    for _ in range(20):
        parts = (torch.randint(0, 4, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen) * unit).tolist()
        parts[0] += unit  # empty parts (anywhere else) included
        bounds = [0] + torch.tensor(parts).cumsum(0).tolist()
        for rank in range(cp):
            want = _chunk_by_chunk(bounds, cp, rank, ulysses)
            assert context_parallel.held(bounds[-1], torch.tensor(bounds), cp, rank, ulysses=ulysses).tolist() == want
            if len(parts) == 1:
                assert context_parallel.held(bounds[-1], None, cp, rank, ulysses=ulysses).tolist() == want


def test_the_split_reads_nothing_from_boundaries_on_a_device():
    """The layers (the K/V gather, the rotary cover) split by the micro-batch's boundaries on the
    device: computed there without a read (a tensor on the meta device has no values to read; the
    check that each part splits evenly runs where the boundaries are on the host)."""
    bounds = torch.tensor([0, 8, 8, 20], device="meta")
    assert context_parallel.held(20, bounds, cp=2, rank=1).shape == (10,)
    assert context_parallel.held(32, torch.tensor([0, 16, 32], device="meta"), cp=4, rank=3, ulysses=2).shape == (8,)
    assert context_parallel.held(16, cp=2, rank=0, device=torch.device("meta")).shape == (8,)  # one sequence
    with pytest.raises(ValueError, match="a sequence of 6 tokens does not split into 4 equal chunks"):
        context_parallel.held(14, torch.tensor([0, 8, 14]), cp=2, rank=0)

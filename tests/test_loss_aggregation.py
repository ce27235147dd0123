"""agg_loss: hand values per mode, masking/empty edge cases, and the micro-batch / DP sharding contract."""

import pytest
import torch

from loss import LOSS_AGG_MODES, Normalization, PolicyLossSettings, agg_loss, compute_policy_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
# Valid tokens: row 0 -> 1+2+3 = 6 (3 tokens), row 1 -> 5+6 = 11 (2 tokens), row 2 empty
# (its 7 is masked). 5 valid tokens, 2 non-empty rows, horizon = width = 4.
EXPECTED = {
    "token-sum": 17.0,
    "token-mean": 17.0 / 5,
    "seq-mean-token-sum": (6.0 + 11.0) / 2,
    "seq-mean-token-mean": (6.0 / 3 + 11.0 / 2) / 2,
    "seq-mean-token-sum-norm": (6.0 / 4 + 11.0 / 4) / 2,
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_hand_values_and_dp_scaling(mode):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(EXPECTED[mode])
    # DDP averages gradients over ranks, so every mode is pre-multiplied by dp_size.
    assert agg_loss(LOSS, MASK, mode, dp_size=4).item() == pytest.approx(4 * EXPECTED[mode])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_mask_dtype_does_not_matter(mode):
    expected = agg_loss(LOSS, MASK, mode)
    for mask in (MASK.bool(), MASK.float(), MASK.to(torch.bfloat16)):
        assert torch.equal(agg_loss(LOSS, mask, mode), expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_entries_are_never_read(mode):
    poisoned = LOSS.masked_fill(MASK == 0, float("nan"))
    poisoned[0, 3] = float("inf")
    assert agg_loss(poisoned, MASK, mode).item() == pytest.approx(EXPECTED[mode])


def test_explicit_global_counts_replace_local_ones():
    assert agg_loss(LOSS, MASK, "token-mean", batch_num_tokens=10).item() == pytest.approx(1.7)
    assert agg_loss(LOSS, MASK, "token-mean", batch_num_tokens=torch.tensor(10)).item() == pytest.approx(1.7)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", global_batch_size=4).item() == pytest.approx(17.0 / 4)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean", global_batch_size=5).item() == pytest.approx(7.5 / 5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fully_masked_batch_gives_zero_and_zero_grad(mode):
    loss_mat = LOSS.clone().requires_grad_(True)
    loss = agg_loss(loss_mat, torch.zeros_like(MASK), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(loss_mat.grad, torch.zeros_like(LOSS))


def test_unknown_mode_names_it_and_lists_valid_modes():
    with pytest.raises(ValueError, match="token-median") as err:
        agg_loss(LOSS, MASK, "token-median")
    assert all(mode in str(err.value) for mode in LOSS_AGG_MODES)


# --- sharding contract ---------------------------------------------------------------
# 8 rows of varied length (row 3 is a zero-length response) split over 2 DP ranks x 2
# micro-batches of 2 rows: rank 0 gets rows 0-3, rank 1 rows 4-7.
LENGTHS = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])
WIDTH = 6
DP_SIZE = 2
SHARDS = [torch.arange(start, start + 2) for start in range(0, 8, 2)]
SHARD_MASK = torch.arange(WIDTH) < LENGTHS[:, None]
GLOBAL_COUNTS = {
    "batch_num_tokens": SHARD_MASK.sum(),  # 27
    "global_batch_size": SHARD_MASK.any(-1).sum(),  # 7
}


def _agg_of_nonlinear_loss(leaf, rows, mode, **agg_kwargs):
    loss_mat = torch.sin(leaf[rows]) * (1.0 + torch.arange(WIDTH, dtype=leaf.dtype))
    return agg_loss(loss_mat, SHARD_MASK[rows], mode, **agg_kwargs)


def _policy_loss(loss_mode):
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(8, WIDTH, generator=gen, dtype=torch.float64)
    delta = 0.3 * torch.randn(8, WIDTH, generator=gen, dtype=torch.float64)
    adv = torch.randn(8, WIDTH, generator=gen, dtype=torch.float64)

    def fn(leaf, rows, mode, **agg_kwargs):
        loss, _ = compute_policy_loss(
            loss_mode, old[rows], old[rows] + delta[rows] + leaf[rows], adv[rows], SHARD_MASK[rows],
            PolicyLossSettings(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode), Normalization(**agg_kwargs),
        )  # fmt: skip
        return loss

    return fn


LOSS_FNS = {
    "agg_loss": _agg_of_nonlinear_loss,
    "vanilla": _policy_loss("vanilla"),
    "gspo": _policy_loss("gspo"),
    "gspo_token": _policy_loss("gspo_token"),
}


def _whole_and_sharded(loss_fn, mode, **shard_counts):
    """(loss, grad) of the whole batch with dp_size=1, and of the DP/micro-batch shards."""
    leaf = torch.linspace(-1.0, 1.0, 8 * WIDTH, dtype=torch.float64).reshape(8, WIDTH).requires_grad_(True)
    whole = loss_fn(leaf, torch.arange(8), mode)
    (whole_grad,) = torch.autograd.grad(whole, leaf)
    # Per rank: sum of micro-batch losses (gradient accumulation); DDP then averages ranks.
    sharded = sum(loss_fn(leaf, rows, mode, dp_size=DP_SIZE, **shard_counts) for rows in SHARDS) / DP_SIZE
    (sharded_grad,) = torch.autograd.grad(sharded, leaf)
    return whole, whole_grad, sharded, sharded_grad


@pytest.mark.filterwarnings("ignore:policy loss 'gspo")
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_fn", LOSS_FNS.values(), ids=LOSS_FNS.keys())
def test_sharded_with_global_counts_equals_whole_batch(loss_fn, mode):
    whole, whole_grad, sharded, sharded_grad = _whole_and_sharded(loss_fn, mode, **GLOBAL_COUNTS)
    assert whole.abs().item() > 1e-3  # a vacuous all-zero loss would prove nothing
    torch.testing.assert_close(sharded, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sharded_grad, whole_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_sharded_with_local_counts_is_not_whole_batch(mode):
    # Unequal shard lengths (7 vs 3 vs 11 vs 6 tokens; one shard with an empty row):
    # local denominators weight shards wrongly, which is why the global counts exist.
    whole, whole_grad, sharded, sharded_grad = _whole_and_sharded(_agg_of_nonlinear_loss, mode)
    assert abs(sharded.item() - whole.item()) > 1e-2
    assert not torch.allclose(sharded_grad, whole_grad)

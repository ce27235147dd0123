"""Train-rollout mismatch metrics and rollout correction: hand values for every metric, the zero and a
planted gap, IS weights and rejection masks by hand, config validation, and IS weights in the policy loss."""

import math
import statistics

import pytest
import torch

import loss.registry as registry_module
from loss import (
    LOSS_AGG_MODES,
    RolloutCorrectionConfig,
    agg_loss,
    PolicyLossSettings,
    compute_policy_loss,
    register_policy_loss,
    rollout_correction,
    rollout_mismatch_metrics,
)
from loss.rollout_correction import RS_OPTIONS, RsCriterion
from tests.test_loss_policy import BUILT_IN_MODES, CLIP, random_batch, run

NAN = float("nan")


def log_probs(rows: list[list[float]], width: int) -> torch.Tensor:
    """float64 log-probs of per-row probability lists, right-padded with NaN (padding is never read)."""
    return torch.tensor([[math.log(p) for p in row] + [NAN] * (width - len(row)) for row in rows], dtype=torch.float64)


def mask_of(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width) < torch.tensor(lengths)[:, None]).long()


# --- mismatch metrics -------------------------------------------------------------------------
# Row 0: 2 tokens, ratios p_old / p_rollout = [2.5, 1]; row 1: 3 tokens, ratios [1, 2/3, 1];
# row 2 is empty. Only the 2.5 token is extreme (max(r, 1/r) > 2; 2/3 gives 1.5).
P_OLD = [[0.5, 0.25], [0.1, 0.2, 0.4], []]
P_ROLLOUT = [[0.2, 0.25], [0.1, 0.3, 0.4], []]


def expected_mismatch() -> dict[str, float]:
    old, rollout = [p for row in P_OLD for p in row], [p for row in P_ROLLOUT for p in row]
    lr = [math.log(a / b) for a, b in zip(old, rollout)]
    diffs = [abs(a - b) for a, b in zip(old, rollout)]
    rows = [(o, r) for o, r in zip(P_OLD, P_ROLLOUT) if o]
    m_old = [sum(map(math.log, o)) / len(o) for o, _ in rows]
    m_rollout = [sum(map(math.log, r)) / len(r) for _, r in rows]
    d = [b - a for a, b in zip(m_old, m_rollout)]
    seq_lr = [sum(math.log(a / b) for a, b in zip(o, r)) for o, r in rows]
    mean = statistics.fmean
    return {
        "training/rollout_probs_diff_mean": mean(diffs),
        "training/rollout_probs_diff_max": max(diffs),
        "training/rollout_probs_diff_std": statistics.stdev(diffs),
        "training/rollout_actor_probs_pearson_corr": statistics.correlation(old, rollout),
        "rollout_corr/kl": mean(-x for x in lr),
        "rollout_corr/k3_kl": mean(math.exp(x) - x - 1 for x in lr),
        "rollout_corr/training_ppl": mean(math.exp(-m) for m in m_old),
        "rollout_corr/training_log_ppl": mean(-m for m in m_old),
        "rollout_corr/rollout_ppl": mean(math.exp(-m) for m in m_rollout),
        "rollout_corr/rollout_log_ppl": mean(-m for m in m_rollout),
        "rollout_corr/log_ppl_diff": mean(d),
        "rollout_corr/log_ppl_abs_diff": mean(map(abs, d)),
        "rollout_corr/log_ppl_diff_max": max(d),
        "rollout_corr/log_ppl_diff_min": min(d),
        "rollout_corr/ppl_ratio": mean(map(math.exp, d)),
        "rollout_corr/chi2_token": mean(math.exp(x) ** 2 for x in lr) - 1,
        "rollout_corr/chi2_seq": mean(math.exp(2 * s) for s in seq_lr) - 1,
        "rollout_corr/seq_log_ratio_abs_mean": mean(map(abs, seq_lr)),
        "rollout_corr/seq_log_ratio_abs_max": max(map(abs, seq_lr)),
        "rollout_corr/extreme_token_frac": 1 / 5,
    }


def test_mismatch_metrics_hand_values():
    metrics = rollout_mismatch_metrics(log_probs(P_OLD, 4), log_probs(P_ROLLOUT, 4), mask_of([2, 3, 0], 4))
    expected = expected_mismatch()
    assert set(metrics) == set(expected)
    assert all(type(v) is float for v in metrics.values())
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


def test_mismatch_metrics_are_at_their_no_gap_values_when_the_policies_agree():
    gen = torch.Generator().manual_seed(0)
    same = -3 * torch.rand(4, 6, generator=gen)
    metrics = rollout_mismatch_metrics(same, same.clone(), mask_of([6, 2, 0, 5], 6))
    zero = [f"training/rollout_probs_diff_{n}" for n in ("mean", "max", "std")] + [
        f"rollout_corr/{n}"
        for n in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max",
                  "log_ppl_diff_min", "seq_log_ratio_abs_mean", "seq_log_ratio_abs_max", "extreme_token_frac")
    ]  # fmt: skip
    assert {name: metrics[name] for name in zero} == dict.fromkeys(zero, 0.0)
    assert metrics["rollout_corr/ppl_ratio"] == 1.0
    assert metrics["rollout_corr/training_ppl"] == metrics["rollout_corr/rollout_ppl"] > 1.0
    assert metrics["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0, abs=1e-12)


def test_mismatch_metrics_measure_a_planted_gap():
    # The engine gives one token (row 1, of 3 rows and 9 tokens) 4x the trainer's probability.
    gen = torch.Generator().manual_seed(1)
    old = -3 * torch.rand(3, 4, generator=gen, dtype=torch.float64)
    mask = mask_of([4, 2, 3], 4)
    rollout = old.clone()
    rollout[1, 1] += math.log(4.0)
    metrics = rollout_mismatch_metrics(old, rollout, mask)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(3 * old[1, 1].exp().item(), rel=1e-12)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(3 * old[1, 1].exp().item() / 9, rel=1e-12)
    assert metrics["rollout_corr/kl"] == pytest.approx(math.log(4) / 9, rel=1e-12)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx((0.25 + math.log(4) - 1) / 9, rel=1e-12)
    assert metrics["rollout_corr/chi2_token"] == pytest.approx((1 / 16 - 1) / 9, rel=1e-12)
    assert metrics["rollout_corr/chi2_seq"] == pytest.approx((1 / 16 - 1) / 3, rel=1e-12)
    # Row 1 has 2 tokens: its mean log-prob moves by log(4) / 2, so its ppl ratio is 2.
    assert metrics["rollout_corr/log_ppl_diff"] == pytest.approx(math.log(4) / 2 / 3, rel=1e-12)
    assert metrics["rollout_corr/ppl_ratio"] == pytest.approx((1 + 2 + 1) / 3, rel=1e-12)
    assert metrics["rollout_corr/seq_log_ratio_abs_mean"] == pytest.approx(math.log(4) / 3, rel=1e-12)
    assert metrics["rollout_corr/seq_log_ratio_abs_max"] == pytest.approx(math.log(4), rel=1e-12)
    assert metrics["rollout_corr/extreme_token_frac"] == pytest.approx(1 / 9)


def test_mismatch_metrics_of_a_single_token():
    one = torch.tensor([[-1.0, 5.0]])
    metrics = rollout_mismatch_metrics(one, one - 0.5, torch.tensor([[1, 0]]))
    assert metrics["training/rollout_probs_diff_std"] == 0.0
    assert math.isnan(metrics["training/rollout_actor_probs_pearson_corr"])


# --- IS weights -------------------------------------------------------------------------------
# pi_old / pi_rollout per token: row 0 [3, 0.55], row 1 [1.5, 1.2, 0.25], row 2 empty. Sequence
# ratios: row 0 1.65, row 1 1.5 * 1.2 * 0.25 = 0.45. No ratio sits on a threshold used below.
RATIOS = [[3.0, 0.55], [1.5, 1.2, 0.25], []]
WIDTH = 4


def ratio_batch(dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rollout = log_probs([[0.1, 0.1], [0.15, 0.1, 0.8], []], WIDTH)
    old = rollout + torch.tensor([[math.log(r) for r in row] + [0.0] * (WIDTH - len(row)) for row in RATIOS])
    return old.to(dtype), rollout.to(dtype), mask_of([2, 3, 0], WIDTH)


def padded(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([row + [0.0] * (WIDTH - len(row)) for row in rows], dtype=torch.float64)


def correct(**cfg) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    return rollout_correction(*ratio_batch(), RolloutCorrectionConfig(**cfg))


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=1e-6, atol=1e-7)


def test_token_truncated_weights_and_metrics():
    weights, mask, metrics = correct(rollout_is="token", rollout_is_threshold=2.0)
    close(weights, padded([[2.0, 0.55], [1.5, 1.2, 0.25], []]))
    assert weights.dtype == torch.float32 and not weights.requires_grad
    assert torch.equal(mask, mask_of([2, 3, 0], WIDTH))
    w = [2.0, 0.55, 1.5, 1.2, 0.25]
    mean, second = sum(w) / 5, sum(x * x for x in w) / 5
    row_means = [1.275, 2.95 / 3]
    expected = {
        "rollout_is_mean": mean,
        "rollout_is_max": 2.0,
        "rollout_is_min": 0.25,
        "rollout_is_std": math.sqrt(second - mean**2),
        "rollout_is_eff_sample_size": mean**2 / second,
        "rollout_is_ratio_fraction_high": 1 / 5,  # 3 > 2
        "rollout_is_ratio_fraction_low": 1 / 5,  # 0.25 < 1/2
        "rollout_is_seq_mean": sum(row_means) / 2,
        "rollout_is_seq_std": statistics.stdev(row_means),
        "rollout_is_seq_max": 1.275,
        "rollout_is_seq_min": 2.95 / 3,
        "rollout_is_seq_max_deviation": 0.275,
        "rollout_is_seq_fraction_high": 0.0,  # raw row means 1.775 and 0.983
        "rollout_is_seq_fraction_low": 0.0,
    }
    assert metrics == pytest.approx({f"rollout_corr/{k}": v for k, v in expected.items()}, rel=1e-6)


def test_token_weights_masked_outside_lower_upper():
    weights, mask, metrics = correct(rollout_is="token", rollout_is_threshold="0.4_2.0")
    close(weights, padded([[0.0, 0.55], [1.5, 1.2, 0.0], []]))
    assert torch.equal(mask, mask_of([2, 3, 0], WIDTH))  # zeroed weights, not rejected tokens
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 5)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(3.25 / 5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 5)  # 0.25 < 0.4


def test_sequence_weights_truncated_and_masked():
    weights, _, metrics = correct(rollout_is="sequence", rollout_is_threshold=1.2)
    close(weights, padded([[1.2, 1.2], [0.45, 0.45, 0.45], []]))
    # max / min from the untruncated sequence ratios; thresholds 1.2 and 1/1.2 per sequence.
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(1.65, rel=1e-6)
    assert metrics["rollout_corr/rollout_is_min"] == pytest.approx(0.45, rel=1e-6)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] == 0.5
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx((2 * 1.2 + 3 * 0.45) / 5, rel=1e-6)
    assert metrics["rollout_corr/rollout_is_seq_mean"] == pytest.approx((1.2 + 0.45) / 2, rel=1e-6)

    weights, _, metrics = correct(rollout_is="sequence", rollout_is_threshold="0.4_1.2")
    close(weights, padded([[0.0, 0.0], [0.45, 0.45, 0.45], []]))
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 5)


@pytest.mark.parametrize(
    "level, threshold, unnormalised, mean",
    [
        ("token", 2.0, [[2.0, 0.55], [1.5, 1.2, 0.25]], 5.5 / 5),  # over tokens
        ("sequence", 2.0, [[1.65, 1.65], [0.45, 0.45, 0.45]], (1.65 + 0.45) / 2),  # over sequences
    ],
)
def test_batch_normalised_weights(level, threshold, unnormalised, mean):
    weights, _, metrics = correct(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=True)
    close(weights, padded([[w / mean for w in row] for row in unnormalised] + [[]]))
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean, rel=1e-6)
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(5.5 / 5 if level == "token" else 4.65 / 5, rel=1e-6)


def test_all_weights_out_of_bounds_stay_zero_under_batch_normalisation():
    weights, _, metrics = correct(rollout_is="token", rollout_is_threshold="4.0_5.0", rollout_is_batch_normalize=True)
    assert torch.equal(weights, torch.zeros_like(weights))
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == 1.0
    assert metrics["rollout_corr/rollout_is_eff_sample_size"] == 0.0


def test_weights_are_bounded_by_exp_20():
    old = torch.tensor([[30.0, -30.0, 0.0]])
    weights, _, _ = rollout_correction(
        old, torch.zeros_like(old), torch.ones_like(old), RolloutCorrectionConfig("token", "1e-12_1e12")
    )
    close(weights, torch.tensor([[math.exp(20), math.exp(-20), 1.0]], dtype=torch.float64))


def test_no_correction_returns_no_weights_an_unchanged_mask_and_no_metrics():
    old, rollout, mask = ratio_batch()
    weights, new_mask, metrics = rollout_correction(old, rollout, mask, RolloutCorrectionConfig())
    assert weights is None and metrics == {}
    assert torch.equal(new_mask, mask) and new_mask is not mask


# --- rejection sampling -----------------------------------------------------------------------
# Kept rows of each token, by option, for RATIOS (r = pi_old / pi_rollout).
REJECTION_CASES = [
    # k1 bounds act on 1/r (verl's k1 statistic is -log r): 1/r in [0.5, 5] <=> r in [0.2, 2].
    ("token_k1", "0.5_5.0", [[0, 1], [1, 1, 1]]),
    ("token_k1", 2.1, [[0, 1], [1, 1, 0]]),  # one bound u means [1/u, u]
    ("token_k2", 0.1, [[0, 0], [1, 1, 0]]),  # 0.5 log^2 r <= 0.1 <=> r in [0.64, 1.56]
    ("seq_sum_k1", "0.5_2.0", [[1, 1], [0, 0, 0]]),  # 1/1.65 kept, 1/0.45 = 2.22 rejected
    # row means of r - 1 - log r: 0.525 and 0.250
    ("seq_mean_k3", 0.3, [[0, 0], [1, 1, 1]]),
    # row max of 0.5 log^2 r: 0.603 (r = 3) and 0.961 (r = 0.25)
    ("seq_max_k2", 0.7, [[1, 1], [0, 0, 0]]),
    ("token_k1,seq_mean_k3", "2.1,0.3", [[0, 0], [1, 1, 0]]),  # every option must keep a token
]


@pytest.mark.parametrize("rollout_rs, threshold, kept", REJECTION_CASES)
def test_rejection_masks_by_hand(rollout_rs, threshold, kept):
    weights, mask, metrics = correct(rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    assert weights is None
    expected = torch.tensor([row + [0] * (WIDTH - len(row)) for row in kept + [[]]])
    assert torch.equal(mask, expected) and mask.dtype == torch.long
    rejected = 5 - sum(map(sum, kept))
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected / 5)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == sum(0 in row for row in kept) / 2


def test_rejection_metrics_of_one_option_by_hand():
    _, _, metrics = correct(rollout_rs="seq_max_k2", rollout_rs_threshold=0.7)
    row_max = [0.5 * math.log(3) ** 2, 0.5 * math.log(0.25) ** 2]
    expected = {
        "mean": (2 * row_max[0] + 3 * row_max[1]) / 5,  # token-weighted, as verl
        "max": row_max[1],
        "min": row_max[0],
        "fraction_high": 0.5,
        "fraction_low": 0.0,  # k2 has no lower bound
        "masked_fraction": 3 / 5,
        "seq_masked_fraction": 0.5,
    }
    prefix = "rollout_corr/rollout_rs_seq_max_k2_"
    assert {k: metrics[prefix + k] for k in expected} == pytest.approx(expected, rel=1e-6)
    # k1: the statistic is -log r; bounds are reported in log space.
    _, _, metrics = correct(rollout_rs="token_k1", rollout_rs_threshold="0.5_5.0")
    assert metrics["rollout_corr/rollout_rs_token_k1_max"] == pytest.approx(math.log(4), rel=1e-6)
    assert metrics["rollout_corr/rollout_rs_token_k1_fraction_low"] == pytest.approx(1 / 5)  # r = 3


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.int32])
def test_rejection_keeps_the_mask_dtype_and_is_combined_with_weights(dtype):
    old, rollout, mask = ratio_batch()
    cfg = RolloutCorrectionConfig("token", 2.0, rollout_rs="token_k1", rollout_rs_threshold=2.1)
    weights, new_mask, metrics = rollout_correction(old, rollout, mask.to(dtype), cfg)
    assert new_mask.dtype == dtype
    assert torch.equal(new_mask.long(), torch.tensor([[0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]))
    # IS weights are computed on the mask before rejection, as verl does.
    close(weights, padded([[2.0, 0.55], [1.5, 1.2, 0.25], []]))
    assert "rollout_corr/rollout_is_mean" in metrics and "rollout_corr/rollout_rs_masked_fraction" in metrics


def test_empty_mask_and_shape_mismatch_are_rejected():
    old, rollout, mask = ratio_batch()
    with pytest.raises(ValueError, match="no valid token"):
        rollout_mismatch_metrics(old, rollout, torch.zeros_like(mask))
    with pytest.raises(ValueError, match=r"rollout_log_probs=\(3, 3\)"):
        rollout_correction(old, rollout[:, :3], mask, RolloutCorrectionConfig("token"))


# --- config -----------------------------------------------------------------------------------
def test_config_defaults_are_verls_yaml_and_frozen():
    cfg = RolloutCorrectionConfig()
    assert (cfg.rollout_is, cfg.rollout_is_threshold) == (None, 2.0)
    assert (cfg.rollout_rs, cfg.rollout_rs_threshold) == (None, None)
    assert (cfg.bypass_mode, cfg.loss_type, cfg.rollout_is_batch_normalize) == (False, "ppo_clip", False)
    assert cfg.is_bounds == (None, 2.0) and cfg.rs_criteria == ()
    with pytest.raises(AttributeError):
        cfg.rollout_is = "token"


def test_config_parses_thresholds_like_verl():
    assert RolloutCorrectionConfig(rollout_is_threshold=" 0.5_5 ").is_bounds == (0.5, 5.0)
    assert RolloutCorrectionConfig(rollout_is_threshold="3").is_bounds == (None, 3.0)
    cfg = RolloutCorrectionConfig(rollout_rs="token_k1, seq_mean_k3,token_k1", rollout_rs_threshold="4.0, 0.1")
    assert cfg.rs_criteria == (RsCriterion("token_k1", 4.0, 0.25), RsCriterion("seq_mean_k3", 0.1))
    cfg = RolloutCorrectionConfig(rollout_rs="seq_sum_k1,seq_max_k3", rollout_rs_threshold=2)
    assert cfg.rs_criteria == (RsCriterion("seq_sum_k1", 2.0, 0.5), RsCriterion("seq_max_k3", 2.0))
    for option in RS_OPTIONS:
        RolloutCorrectionConfig(rollout_rs=option, rollout_rs_threshold=1.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bypass_mode": True}, "bypass_mode=True .* set bypass_mode=False"),
        ({"loss_type": "reinforce"}, "loss_type='reinforce' .* use loss_type='ppo_clip'"),
        ({"rollout_is": "geometric"}, "rollout_is='geometric' is unknown; valid: None, token, sequence"),
        ({"rollout_is_threshold": True}, "rollout_is_threshold must be a positive number or a 'lower_upper'"),
        ({"rollout_is_threshold": None}, "rollout_is_threshold must be"),
        ({"rollout_is_threshold": "2_1"}, "rollout_is_threshold='2_1': bounds must be positive with lower <= upper"),
        ({"rollout_is_threshold": -1.0}, "rollout_is_threshold=-1.0: bounds must be positive"),
        ({"rollout_is_threshold": "0.5_x"}, "rollout_is_threshold: 'x' is not a number"),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, "unknown or no option; valid options: token_k1"),
        ({"rollout_rs": " , ", "rollout_rs_threshold": 2.0}, "unknown or no option"),
        ({"rollout_rs": "token_k1"}, "needs rollout_rs_threshold"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2.0"}, "pair is only for k1 options"),
        ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "1,2,3"}, "3 entries for 2 rollout_rs options"),
        ({"rollout_rs": "token_k3", "rollout_rs_threshold": "0"}, "for token_k3='0': bounds must be positive"),
    ],
)
def test_config_rejects_bad_settings_naming_key_and_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrectionConfig(**kwargs)


# --- IS weights in the policy loss ------------------------------------------------------------
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", BUILT_IN_MODES)
def test_unit_weights_give_exactly_the_uncorrected_loss_and_gradient(loss_mode, loss_agg_mode):
    batch = random_batch()
    base = run(loss_mode, *batch, loss_agg_mode)
    ones = run(loss_mode, *batch, loss_agg_mode, rollout_is_weights=torch.ones(6, 7))
    assert torch.equal(ones[0], base[0]) and torch.equal(ones[1], base[1]) and ones[2] == base[2]


@pytest.fixture(scope="module")
def per_token_losses() -> dict[str, dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]]:
    """Per mode, each valid token's loss L_rt and d L_rt / d log_prob: a token-sum run weighted one-hot."""
    old, log_prob, adv, mask = random_batch()
    losses = {}
    for loss_mode in BUILT_IN_MODES:
        losses[loss_mode] = {}
        for r, t in mask.nonzero().tolist():
            one_hot = torch.zeros(mask.shape, dtype=torch.float64)
            one_hot[r, t] = 1.0
            loss, grad, _ = run(loss_mode, old, log_prob, adv, mask, "token-sum", rollout_is_weights=one_hot)
            losses[loss_mode][r, t] = (loss, grad)
    return losses


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", BUILT_IN_MODES)
def test_weights_scale_each_token_loss_before_aggregation(per_token_losses, loss_mode, loss_agg_mode):
    old, log_prob, adv, mask = random_batch()
    weights = 2 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    base = run(loss_mode, old, log_prob, adv, mask, loss_agg_mode)
    weighted = run(
        loss_mode, old, log_prob, adv, mask, loss_agg_mode, rollout_is_weights=weights.masked_fill(~mask, NAN)
    )
    # Expected: the aggregate of w_rt * L_rt, i.e. sum over tokens of (the mode's coefficient of
    # token rt, read off agg_loss on a one-hot matrix) * w_rt * L_rt; the same for the gradient.
    expected_loss = torch.zeros((), dtype=torch.float64)
    expected_grad = torch.zeros_like(base[1])
    for (r, t), (token_loss, token_grad) in per_token_losses[loss_mode].items():
        one_hot = torch.zeros(mask.shape, dtype=torch.float64)
        one_hot[r, t] = 1.0
        coefficient = agg_loss(one_hot, mask, loss_agg_mode) * weights[r, t]
        expected_loss += coefficient * token_loss
        expected_grad += coefficient * token_grad
    torch.testing.assert_close(weighted[0], expected_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(weighted[1], expected_grad, rtol=1e-12, atol=1e-14)
    assert not torch.equal(weighted[0], base[0])
    assert weighted[2] == base[2]  # clip fractions and ppo_kl are not weighted


def test_weights_get_no_gradient():
    old, log_prob, adv, mask = random_batch()
    weights = torch.rand(mask.shape, dtype=torch.float64, requires_grad=True)
    log_prob.requires_grad_()
    loss, _ = compute_policy_loss(
        "vanilla", old, log_prob, adv, mask, PolicyLossSettings(**CLIP), rollout_is_weights=weights
    )
    assert torch.autograd.grad(loss, [log_prob, weights], allow_unused=True)[1] is None


def test_vanilla_weighted_hand_case():
    # Per-token losses of test_loss_policy's vanilla hand case: [-1, -1.28, 0.8, 1.1], gradients
    # [-1, 0, 0, 1.1] / 4 (token-mean); weights [2, 1, 0.5, 0] scale both token by token.
    ratio = torch.tensor([[1.0, 1.5, 0.5, 1.1]], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    weights = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    loss, grad, _ = run(
        "vanilla", old, old + ratio.log(), adv, torch.ones_like(ratio), "token-mean", rollout_is_weights=weights
    )
    assert loss.item() == pytest.approx((-2.0 - 1.28 + 0.4 + 0.0) / 4, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-2.0, 0.0, 0.0, 0.0]], dtype=torch.float64) / 4)


def test_gspo_weighted_hand_case():
    # test_loss_policy's GSPO hand case: L_0 = -e^0.2 (2 tokens), L_1 = 0.8 (3 tokens, clipped).
    # seq-mean-token-mean with weights: row i contributes L_i * mean_t(w_it).
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    log_ratio = torch.tensor([[0.1, 0.3, 9.0, 9.0], [-0.5, -0.4, -0.6, 9.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 5.0, 5.0], [-1.0, -1.0, -1.0, 5.0]], dtype=torch.float64)
    old = torch.full_like(log_ratio, -2.0)
    weights = torch.tensor([[1.0, 3.0, NAN, NAN], [0.5, 0.5, 0.5, NAN]])
    loss, _, _ = run("gspo", old, old + log_ratio, adv, mask, "seq-mean-token-mean", rollout_is_weights=weights)
    assert loss.item() == pytest.approx((-math.exp(0.2) * 2.0 + 0.8 * 0.5) / 2, abs=1e-12)


def test_weight_shape_is_checked():
    old, log_prob, adv, mask = random_batch()
    with pytest.raises(ValueError, match=r"rollout_is_weights=\(6, 1\)"):
        compute_policy_loss(
            "vanilla", old, log_prob, adv, mask, PolicyLossSettings(**CLIP), rollout_is_weights=torch.ones(6, 1)
        )


def test_user_mode_without_the_weights_parameter_is_told_how_to_add_it(monkeypatch):
    monkeypatch.setattr(registry_module, "_POLICY_LOSSES", dict(registry_module._POLICY_LOSSES))
    received = {}

    @register_policy_loss("test_kwargs_mode")
    def kwargs_mode(old_log_prob, log_prob, advantages, response_mask, settings, norm, **kwargs):
        received.update(kwargs)
        return log_prob.sum(), {}

    @register_policy_loss("test_strict_mode")
    def strict_mode(old_log_prob, log_prob, advantages, response_mask, settings, norm):
        return log_prob.sum(), {}

    old, log_prob, adv, mask = random_batch()
    weights = torch.full(mask.shape, 0.5, dtype=torch.float64)
    settings = PolicyLossSettings(**CLIP, loss_agg_mode="token-sum")
    compute_policy_loss("test_kwargs_mode", old, log_prob, adv, mask, settings, rollout_is_weights=weights)
    assert received["rollout_is_weights"] is weights
    with pytest.raises(ValueError, match="'test_strict_mode' does not take rollout_is_weights: give it a keyword"):
        compute_policy_loss("test_strict_mode", old, log_prob, adv, mask, settings, rollout_is_weights=weights)
    compute_policy_loss("test_strict_mode", old, log_prob, adv, mask, settings)  # fine without weights


def test_correction_output_feeds_the_loss():
    # End to end: sequence IS weights and a rejection mask from rollout_correction into GSPO.
    old, log_prob, adv, mask = random_batch()
    rollout = old - 0.2 * torch.sin(torch.arange(42, dtype=torch.float64)).reshape(6, 7)
    cfg = RolloutCorrectionConfig("sequence", 2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01)
    weights, new_mask, _ = rollout_correction(old, rollout, mask, cfg)
    assert 0 < new_mask.sum() < mask.sum()
    loss, grad, _ = run(
        "gspo", old, log_prob, adv, new_mask, "seq-mean-token-mean", rollout_is_weights=weights
    )
    assert loss.isfinite() and grad[~new_mask.bool()].eq(0).all()

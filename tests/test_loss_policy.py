"""Policy losses: vanilla/GSPO hand cases, GSPO gradients and equivalences, robustness, registry, validation."""

import math
import warnings

import pytest
import torch

import loss.gspo as gspo_module
import loss.registry as registry_module
from loss import (LOSS_AGG_MODES, Normalization, PolicyLossSettings, compute_policy_loss, get_policy_loss_fn,
                  policy_loss_modes, register_policy_loss)

BUILT_IN_MODES = ("vanilla", "gspo", "gspo_token")
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}  # clip range [0.8, 1.28]
METRIC_KEYS = {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}


def run(loss_mode, old, log_prob, adv, mask, loss_agg_mode="token-mean", rollout_is_weights=None, **settings):
    """Loss, d loss / d log_prob and metrics for one call (settings: the clip range's, over CLIP)."""
    log_prob = log_prob.detach().clone().requires_grad_(True)
    weights = {} if rollout_is_weights is None else {"rollout_is_weights": rollout_is_weights}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the GSPO aggregation warning has its own test
        loss, metrics = compute_policy_loss(
            loss_mode, old, log_prob, adv, mask,
            PolicyLossSettings(**{**CLIP, **settings}, loss_agg_mode=loss_agg_mode), **weights,
        )
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert set(metrics) == METRIC_KEYS and all(type(v) is float for v in metrics.values())
    return loss.detach(), grad, metrics


def random_batch(dtype=torch.float64, seed=0):
    """6 rows x 7 tokens, lengths incl. a zero-length row; per-row drifts make some sequences clip."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(7) < torch.tensor([7, 3, 0, 5, 1, 6])[:, None]
    old = -3 * torch.rand(6, 7, generator=gen, dtype=dtype)
    drift = torch.tensor([0.05, 0.4, 0.0, -0.1, -0.5, 0.3], dtype=dtype)[:, None]
    log_prob = old + drift + 0.3 * torch.randn(6, 7, generator=gen, dtype=dtype)
    adv = torch.randn(6, 7, generator=gen, dtype=dtype)
    return old, log_prob, adv, mask


# --- vanilla ----------------------------------------------------------------------------
def test_vanilla_hand_case():
    # ratio r = [1.0, 1.5, 0.5, 1.1], A = [+1, +1, -1, -1], clip range [0.8, 1.28]:
    #   t0: l1 = -1.0,  l2 = -1.0            -> -1.0, not clipped, d/dlogp = -A*r = -1.0
    #   t1: l1 = -1.5,  l2 = -1.28 (> l1)    -> -1.28, clipped,    d/dlogp = 0
    #   t2: l1 = 0.5,   l2 = 0.8 (> l1)      -> 0.8 (< l3 = 3),    clipped, d/dlogp = 0
    #   t3: l1 = 1.1,   l2 = 1.1             -> 1.1, not clipped,  d/dlogp = -A*r = 1.1
    # token-mean: (-1 - 1.28 + 0.8 + 1.1) / 4 = -0.095; clipfrac 2/4; nothing dual-clipped.
    ratio = torch.tensor([[1.0, 1.5, 0.5, 1.1]], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    loss, grad, metrics = run("vanilla", old, old + ratio.log(), adv, torch.ones_like(ratio))
    assert loss.item() == pytest.approx(-0.095, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.0, 0.0, 1.1]], dtype=torch.float64) / 4)
    assert metrics["actor/pg_clipfrac"] == 0.5
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(1.5 * 0.5 * 1.1) / 4, abs=1e-12)


def test_vanilla_dual_clip_hand_case():
    # r = [4, 2, 4], A = [-1, -1, +1], clip_ratio_c = 3 (l3 = -A*3):
    #   t0: l1 = 4, l2 = 1.28, c1 = 4 > l3 = 3  -> dual-clipped to 3 (constant, grad 0), counts as lower
    #   t1: l1 = 2, l2 = 1.28, c1 = 2 < 3       -> 2, grad -A*r = 2
    #   t2: l1 = -4, l2 = -1.28 (> l1)          -> -1.28 clipped (A > 0: never dual-clipped), grad 0
    # token-mean: (3 + 2 - 1.28) / 3 = 1.24; clipfrac 1/3 (t2); clipfrac_lower 1/3 (t0).
    ratio = torch.tensor([[4.0, 2.0, 4.0]], dtype=torch.float64)
    old = torch.zeros_like(ratio)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    loss, grad, metrics = run("vanilla", old, ratio.log(), adv, torch.ones_like(ratio), clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(1.24, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2.0, 0.0]], dtype=torch.float64) / 3)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("clip_ratio_c", [1.0, 0.5])
def test_vanilla_rejects_dual_clip_ratio_not_above_one(clip_ratio_c):
    old, log_prob, adv, mask = random_batch()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        run("vanilla", old, log_prob, adv, mask, clip_ratio_c=clip_ratio_c)


# --- gspo -------------------------------------------------------------------------------
def test_gspo_hand_case_and_token_weighted_clipfrac():
    # row 0: 2 tokens, log ratios [0.1, 0.3] -> s = e^0.2 = 1.2214 (inside [0.8, 1.28]), A = +1
    #        L0 = -e^0.2, not clipped.
    # row 1: 3 valid tokens, log ratios [-0.5, -0.4, -0.6] -> s = e^-0.5 = 0.6065, A = -1
    #        l1 = 0.6065 < l2 = 0.8 -> L1 = 0.8, clipped.
    # seq-mean-token-mean: (-e^0.2 + 0.8) / 2; clipfrac weighted by tokens: 3 / (2 + 3).
    # ppo_kl = mean over the 5 tokens of -(log ratio) = -(0.4 - 1.5) / 5 = 0.22.
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    log_ratio = torch.tensor([[0.1, 0.3, 9.0, 9.0], [-0.5, -0.4, -0.6, 9.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 5.0, 5.0], [-1.0, -1.0, -1.0, 5.0]], dtype=torch.float64)
    old = torch.full_like(log_ratio, -2.0)
    loss, _, metrics = run("gspo", old, old + log_ratio, adv, mask, "seq-mean-token-mean")
    assert loss.item() == pytest.approx((-math.exp(0.2) + 0.8) / 2, abs=1e-12)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(3 / 5)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(0.22, abs=1e-12)


def test_gspo_gradient_matches_paper_objective():
    # Per row: (length, mean log ratio, A). s = e^mean; clip range [0.8, 1.28].
    rows = [
        (5, 0.1, 1.5),  # s = 1.105 inside the range            -> gradient
        (2, 0.5, 1.0),  # s = 1.649 > 1.28 and A > 0: clip binds -> 0
        (3, -0.5, -2.0),  # s = 0.607 < 0.8 and A < 0: clip binds -> 0
        (4, -0.5, 0.7),  # s < 0.8 but A > 0: clip does not bind -> gradient
        (1, 0.5, -1.0),  # s > 1.28 but A < 0: clip does not bind -> gradient
        (0, 0.0, 3.0),  # zero-length response                   -> excluded, 0
    ]
    width, n_valid = 6, 5
    gen = torch.Generator().manual_seed(1)
    mask = torch.arange(width) < torch.tensor([r[0] for r in rows])[:, None]
    noise = torch.randn(len(rows), width, generator=gen, dtype=torch.float64).masked_fill(~mask, 0)
    noise = noise - (noise.sum(-1) / mask.sum(-1).clamp(min=1))[:, None]  # zero mean over valid tokens
    mean = torch.tensor([r[1] for r in rows], dtype=torch.float64)[:, None]
    log_ratio = torch.where(mask, mean + noise, 7.0)  # padding holds junk on purpose
    adv = torch.where(mask, torch.tensor([r[2] for r in rows], dtype=torch.float64)[:, None], -4.0)
    old = -torch.rand(len(rows), width, generator=gen, dtype=torch.float64)

    loss, grad, metrics = run("gspo", old, old + log_ratio, adv, mask, "seq-mean-token-mean")

    expected_grad = torch.zeros_like(grad)
    expected_loss = 0.0
    for i, (length, mean_i, a) in enumerate(rows[:n_valid]):
        s = math.exp(mean_i)
        binds = (a > 0 and s > 1.28) or (a < 0 and s < 0.8)
        expected_loss += -a * min(max(s, 0.8), 1.28) if binds else -a * s
        if not binds:  # d(-s_i A_i / N) / d logp_it = -A_i s_i / |y_i| / N on valid tokens
            expected_grad[i, :length] = -a * s / length / n_valid
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    assert loss.item() == pytest.approx(expected_loss / n_valid, abs=1e-12)
    assert metrics["actor/pg_clipfrac"] == pytest.approx((2 + 3) / 15)  # clipped rows' tokens / all tokens


def test_gspo_and_gspo_token_agree_for_sequence_level_advantages():
    old, log_prob, adv, mask = random_batch()
    adv = adv[:, :1].expand_as(adv)  # one advantage per sequence
    loss_seq, grad_seq, metrics_seq = run("gspo", old, log_prob, adv, mask, "seq-mean-token-mean")
    loss_tok, grad_tok, metrics_tok = run("gspo_token", old, log_prob, adv, mask, "seq-mean-token-mean")
    assert 0 < metrics_seq["actor/pg_clipfrac"] < 1  # both clipped and unclipped rows are exercised
    torch.testing.assert_close(loss_tok, loss_seq, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_tok, grad_seq, rtol=1e-12, atol=1e-14)
    assert metrics_tok == pytest.approx(metrics_seq, abs=1e-12)


def test_gspo_token_gradient_uses_token_advantages():
    # Paper: d s_it / d logp_t = s_i, so for a token whose clip does not bind
    # d loss / d logp_it = -A_it * s_i / |y_i| / N (seq-mean-token-mean), and 0 where it binds.
    old, log_prob, adv, mask = random_batch()
    loss, grad, metrics = run("gspo_token", old, log_prob, adv, mask, "seq-mean-token-mean")
    lengths = mask.sum(-1)
    s = torch.exp(torch.where(mask, log_prob - old, 0).sum(-1) / lengths.clamp(min=1))[:, None].expand_as(adv)
    binds = ((adv > 0) & (s > 1.28)) | ((adv < 0) & (s < 0.8))
    assert binds[mask].any() and not binds[mask].all()
    n_valid = int((lengths > 0).sum())
    expected = torch.where(mask & ~binds, -adv * s / lengths.clamp(min=1)[:, None] / n_valid, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    assert metrics["actor/pg_clipfrac"] == pytest.approx((binds & mask).sum().item() / mask.sum().item())


@pytest.mark.parametrize("token_log_ratio", [0.1, 0.3, -0.4])  # inside, above and below the range
@pytest.mark.parametrize("loss_mode", ["gspo", "gspo_token"])
def test_gspo_is_invariant_to_response_length(loss_mode, token_log_ratio):
    # Same per-token log ratio r: s_i = exp(r) whatever the length, so L_i = max(-A e^r, -A clip(e^r)).
    a = -1.0 if token_log_ratio < 0 else 1.0
    s = math.exp(token_log_ratio)
    expected = max(-a * s, -a * min(max(s, 0.8), 1.28))
    for length in (3, 9):
        mask = torch.ones(1, length)
        old = torch.full((1, length), -1.0, dtype=torch.float64)
        adv = torch.full_like(old, a)
        loss, _, _ = run(loss_mode, old, old + token_log_ratio, adv, mask, "seq-mean-token-mean")
        assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_gspo_caps_the_sequence_log_ratio():
    # mean log ratio 50 would give s = e^50; it is capped at e^10, and the cap stops the gradient.
    old = torch.zeros(1, 3, dtype=torch.float64)
    loss, grad, _ = run("gspo", old, old + 50.0, -torch.ones_like(old), torch.ones(1, 3), "seq-mean-token-mean")
    assert loss.item() == pytest.approx(math.exp(10.0))
    assert torch.equal(grad, torch.zeros_like(grad))


def test_gspo_warns_once_per_mode_and_non_paper_aggregation(monkeypatch):
    monkeypatch.setattr(gspo_module, "_warned_agg_modes", set())
    old, log_prob, adv, mask = random_batch()
    calls = [("gspo", "token-mean")] * 3 + [("gspo_token", "token-mean")] * 2 + [("gspo", "seq-mean-token-mean")] * 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the once-only behaviour must come from the library
        for loss_mode, agg in calls:
            compute_policy_loss(loss_mode, old, log_prob, adv, mask, PolicyLossSettings(**CLIP, loss_agg_mode=agg))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "'gspo'" in messages[0] and "'gspo_token'" in messages[1]
    assert all("'token-mean'" in m and "'seq-mean-token-mean'" in m for m in messages)
    assert caught[0].filename == __file__  # attributed to the caller of compute_policy_loss


def test_gspo_does_not_warn_with_paper_aggregation(monkeypatch):
    monkeypatch.setattr(gspo_module, "_warned_agg_modes", set())
    old, log_prob, adv, mask = random_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for loss_mode in ("gspo", "gspo_token"):
            settings = PolicyLossSettings(**CLIP, loss_agg_mode="seq-mean-token-mean")
            compute_policy_loss(loss_mode, old, log_prob, adv, mask, settings)
    assert caught == []


# --- properties of every mode x aggregation ---------------------------------------------
ALL_MODES = pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
ALL_LOSSES = pytest.mark.parametrize("loss_mode", BUILT_IN_MODES)


@ALL_LOSSES
@ALL_MODES
def test_masked_positions_have_no_effect(loss_mode, loss_agg_mode):
    old, log_prob, adv, mask = random_batch(dtype=torch.float32)
    base = run(loss_mode, old, log_prob, adv, mask, loss_agg_mode)
    pad = ~mask
    # float32 overflows to inf long before 1e30 * e^20; padding must never get that far.
    junk = run(
        loss_mode, old.masked_fill(pad, -1e30), log_prob.masked_fill(pad, 1e30), adv.masked_fill(pad, -1e30),
        mask, loss_agg_mode,
    )  # fmt: skip
    assert base[0].item() != 0.0
    assert torch.equal(junk[0], base[0])
    assert torch.equal(junk[1], base[1])
    assert junk[2] == base[2]
    assert torch.equal(base[1][pad], torch.zeros(int(pad.sum())))


@ALL_LOSSES
@ALL_MODES
def test_edge_cases_stay_finite(loss_mode, loss_agg_mode):
    old, log_prob, adv, mask = random_batch(dtype=torch.float32)
    log_prob[0] = old[0] + 1e4  # extreme positive log ratio
    log_prob[1] = old[1] - 1e4  # extreme negative log ratio
    log_prob[3, ::2] = old[3, ::2] + 1e4  # mixed extremes within one row
    log_prob[3, 1::2] = old[3, 1::2] - 1e4
    adv[5] = 0.0  # all-equal rewards in a group -> zero advantages
    # row 2 is a zero-length response
    loss, grad, metrics = run(loss_mode, old, log_prob, adv, mask, loss_agg_mode)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


@ALL_LOSSES
@ALL_MODES
def test_zero_advantages_give_zero_loss_and_gradient(loss_mode, loss_agg_mode):
    old, log_prob, adv, mask = random_batch()
    loss, grad, _ = run(loss_mode, old, log_prob, torch.zeros_like(adv), mask, loss_agg_mode)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


@ALL_LOSSES
@ALL_MODES
def test_fully_masked_batch_gives_zero_loss_and_metrics(loss_mode, loss_agg_mode):
    old, log_prob, adv, mask = random_batch()
    loss, grad, metrics = run(loss_mode, old, log_prob, adv, torch.zeros_like(mask), loss_agg_mode)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    assert metrics == dict.fromkeys(METRIC_KEYS, 0.0)


# --- registry and validation ------------------------------------------------------------
@pytest.fixture
def scratch_registry(monkeypatch):
    """A copy of the registry so modes registered by a test vanish after it."""
    monkeypatch.setattr(registry_module, "_POLICY_LOSSES", dict(registry_module._POLICY_LOSSES))


def test_user_registered_mode_is_dispatched_by_name(scratch_registry):
    received = {}

    @register_policy_loss("test_user_mode")
    def user_loss(old_log_prob, log_prob, advantages, response_mask, settings, norm):
        received.update(settings=settings, norm=norm)
        return (log_prob * advantages).sum(), {"actor/pg_clipfrac": 0.25}

    assert "test_user_mode" in policy_loss_modes()
    assert get_policy_loss_fn("test_user_mode") is user_loss
    old, log_prob, adv, mask = random_batch()
    settings = PolicyLossSettings(**CLIP, loss_agg_mode="token-sum")
    norm = Normalization(dp_size=4, batch_num_tokens=99)
    out, metrics = compute_policy_loss("test_user_mode", old, log_prob, adv, mask, settings, norm)
    assert out.item() == pytest.approx((log_prob * adv).sum().item())
    assert metrics == {"actor/pg_clipfrac": 0.25}
    assert received == {"settings": settings, "norm": norm}  # passed whole
    compute_policy_loss("test_user_mode", old, log_prob, adv, mask, settings)
    assert received["norm"] == Normalization(dp_size=1, batch_num_tokens=None, global_batch_size=None)  # whole batch


def test_registering_a_taken_name_fails(scratch_registry):
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(lambda *args, **kwargs: None)
    assert get_policy_loss_fn("vanilla").__name__ == "compute_policy_loss_vanilla"


def test_unknown_mode_lists_registered_names():
    assert set(BUILT_IN_MODES) <= set(policy_loss_modes())
    old, log_prob, adv, mask = random_batch()
    with pytest.raises(ValueError, match="'ppo_typo'") as err:
        compute_policy_loss("ppo_typo", old, log_prob, adv, mask, PolicyLossSettings(**CLIP, loss_agg_mode="token-mean"))
    assert all(name in str(err.value) for name in BUILT_IN_MODES)


def test_shape_mismatch_names_the_tensors():
    old, log_prob, adv, mask = random_batch()
    with pytest.raises(ValueError, match=r"log_prob=\(6, 6\).*advantages=\(6, 7\)"):
        compute_policy_loss("vanilla", old, log_prob[:, :6], adv, mask, PolicyLossSettings(**CLIP, loss_agg_mode="token-mean"))
    with pytest.raises(ValueError, match=r"response_mask=\(6, 7, 1\)"):
        compute_policy_loss("vanilla", old, log_prob, adv, mask[..., None], PolicyLossSettings(**CLIP, loss_agg_mode="token-mean"))


def test_unknown_aggregation_is_rejected_when_the_settings_are_made():
    with pytest.raises(ValueError, match="loss_agg_mode='token-median': 'token-median' is not a valid choice") as info:
        PolicyLossSettings(**CLIP, loss_agg_mode="token-median")
    assert all(mode in str(info.value) for mode in LOSS_AGG_MODES)

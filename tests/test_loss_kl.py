"""kl_penalty estimators and entropy_from_logits on hand inputs."""

import math

import pytest
import torch

from loss import KL_PENALTY_TYPES, entropy_from_logits, kl_penalty

LOG_PROB = torch.tensor([0.0, -1.0, -2.0], dtype=torch.float64)
REF_LOG_PROB = torch.tensor([-1.0, -1.0, 0.0], dtype=torch.float64)
# log_prob - ref = [1, 0, -2]; for k3, kl = ref - log_prob = [-1, 0, 2] and k3 = e^kl - kl - 1.
EXPECTED = {
    "k1": [1.0, 0.0, -2.0],
    "abs": [1.0, 0.0, 2.0],
    "k2": [0.5, 0.0, 2.0],
    "k3": [math.exp(-1.0), 0.0, math.exp(2.0) - 3.0],
}
ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


@pytest.mark.parametrize("kl_type", ALIASES)
def test_hand_values(kl_type):
    expected = torch.tensor(EXPECTED[ALIASES[kl_type]], dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(LOG_PROB, REF_LOG_PROB, kl_type), expected, rtol=1e-12, atol=1e-12)


def test_every_type_is_covered():
    assert set(KL_PENALTY_TYPES) == set(ALIASES)


@pytest.mark.parametrize("kl_type", ["k3", "low_var_kl"])
def test_low_var_kl_is_clamped(kl_type):
    # kl = ref - logp: 3 -> e^3 - 4 = 16.09 > 10; -12 -> e^-12 + 11 > 10; +-1e4 would overflow exp
    # without the [-20, 20] clamp on kl; all end at the [-10, 10] clamp on the estimate.
    ref = torch.tensor([3.0, -12.0, 1e4, -1e4, 0.5], dtype=torch.float64)
    log_prob = torch.zeros_like(ref, requires_grad=True)
    kld = kl_penalty(log_prob, ref, kl_type)
    torch.testing.assert_close(kld, torch.tensor([10.0, 10.0, 10.0, 10.0, math.exp(0.5) - 1.5], dtype=torch.float64))
    kld.sum().backward()
    assert torch.isfinite(log_prob.grad).all()
    assert log_prob.grad[-1].item() == pytest.approx(1 - math.exp(0.5))  # d/dlogp (e^kl - kl - 1), kl = ref - logp


def test_unknown_kl_type_lists_valid_types():
    with pytest.raises(ValueError, match="'k4'") as err:
        kl_penalty(LOG_PROB, REF_LOG_PROB, "k4")
    assert all(kl_type in str(err.value) for kl_type in KL_PENALTY_TYPES)


def test_entropy_matches_explicit_definition():
    logits = torch.randn(4, 5, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p = torch.softmax(logits, dim=-1)
    expected = -(p * p.log()).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), expected, rtol=1e-12, atol=1e-12)


def test_entropy_of_uniform_logits_is_log_vocab():
    torch.testing.assert_close(entropy_from_logits(torch.full((2, 7), 3.5)), torch.full((2,), math.log(7)))


def test_entropy_is_stable_and_float32_for_low_precision_input():
    # exp(1000) overflows; a naive -sum p log p would also hit log(0) for the two tiny entries.
    assert entropy_from_logits(torch.tensor([1000.0, 0.0, -1000.0])).item() == pytest.approx(0.0, abs=1e-6)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    entropy = entropy_from_logits(logits.to(torch.bfloat16))
    assert entropy.dtype == torch.float32
    torch.testing.assert_close(entropy, entropy_from_logits(logits.to(torch.bfloat16).double()).float())

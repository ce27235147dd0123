"""GRPO advantages against hand computations, degenerate groups, and the token broadcast."""

import math

import pytest
import torch

from recipe.driver.advantage import grpo_advantages, token_advantages

EPS = 1e-6


def test_grpo_advantages_match_a_hand_computation():
    # group 7: scores 1, 0, 0, 0 -> mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5
    # group 3: scores 2, 4, 9    -> mean 5, unbiased std sqrt((9 + 1 + 16) / 2) = sqrt(13)
    scores = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0, 9.0, 0.0])
    groups = torch.tensor([7, 3, 7, 3, 7, 3, 7])
    advantages = grpo_advantages(scores, groups)
    std7, std3 = 0.5 + EPS, math.sqrt(13) + EPS
    expected = [0.75 / std7, -3 / std3, -0.25 / std7, -1 / std3, -0.25 / std7, 4 / std3, -0.25 / std7]
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, torch.tensor(expected), rtol=1e-6, atol=1e-7)


def test_grpo_matches_torch_mean_and_std_per_group():
    torch.manual_seed(0)
    scores = torch.randn(64)
    groups = torch.arange(8).repeat_interleave(8)[torch.randperm(64)]
    advantages = grpo_advantages(scores, groups, epsilon=1e-4)
    for g in range(8):
        members = scores[groups == g]
        torch.testing.assert_close(advantages[groups == g], (members - members.mean()) / (members.std() + 1e-4))


def test_without_std_normalisation_only_the_mean_is_removed():
    scores = torch.tensor([1.0, -1.0, -1.0, 0.5, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    expected = torch.tensor([4 / 3, -2 / 3, -2 / 3, 0.25, -0.25])
    torch.testing.assert_close(grpo_advantages(scores, groups, norm_by_std=False), expected)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_all_equal_and_singleton_groups_are_exactly_zero(norm_by_std):
    # 0.1 * 3 / 3 != 0.1 in floating point: the mean of equal values is not always exact
    scores = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 5.0, -1.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    advantages = grpo_advantages(scores, groups, norm_by_std=norm_by_std)
    assert torch.isfinite(advantages).all()
    assert advantages[:6].tolist() == [0.0] * 6
    assert advantages[6].item() == pytest.approx(-1 / (math.sqrt(2) + EPS) if norm_by_std else -1.0)


def test_a_batch_of_singletons_is_all_zero():
    assert grpo_advantages(torch.tensor([3.0, -2.0, 0.5]), torch.tensor([0, 1, 2])).tolist() == [0.0, 0.0, 0.0]


def test_group_ids_need_not_be_contiguous_or_sorted():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    a = grpo_advantages(scores, torch.tensor([1000, -5, 1000, -5]))
    b = grpo_advantages(scores, torch.tensor([0, 1, 0, 1]))
    assert torch.equal(a, b)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="same length"):
        grpo_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        grpo_advantages(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match=r"scores\[2\] is nan"):
        grpo_advantages(torch.tensor([0.0, 1.0, math.nan]), torch.zeros(3, dtype=torch.long))


def test_token_advantages_broadcast_over_the_response_mask():
    advantages = torch.tensor([0.5, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    expected = torch.tensor([[0.5, 0.5, 0.5, 0.0], [-2.0, 0.0, 0.0, 0.0]])
    result = token_advantages(advantages, mask)
    assert result.dtype == torch.float32
    assert torch.equal(result, expected)


def test_token_advantages_shape_mismatch():
    with pytest.raises(ValueError, match=r"advantages \(3,\) must be \[B\].*\(2, 5\)"):
        token_advantages(torch.zeros(3), torch.ones(2, 5))


# --- KL in the reward (verl's apply_kl_penalty) and DAPO's group filter ----------------------------


def test_fixed_and_adaptive_kl_controllers_by_hand():
    from recipe.driver.advantage import KLController

    fixed = KLController("fixed", 0.1, target_kl=0.05, horizon=100)
    fixed.update(kl=1.0, n=10)
    assert fixed.value == 0.1
    adaptive = KLController("adaptive", 0.1, target_kl=0.05, horizon=100)
    adaptive.update(kl=0.06, n=10)  # error = 0.06 / 0.05 - 1 = 0.2 -> beta *= 1 + 0.2 * 10 / 100
    assert adaptive.value == pytest.approx(0.1 * 1.02)
    adaptive.update(kl=1.0, n=10)  # the error is clipped to 0.2
    assert adaptive.value == pytest.approx(0.1 * 1.02 * 1.02)
    adaptive.update(kl=0.0, n=50)  # -1 clipped to -0.2
    assert adaptive.value == pytest.approx(0.1 * 1.02 * 1.02 * 0.9)
    with pytest.raises(ValueError, match="fixed or adaptive"):
        KLController("pid", 0.1, 0.05, 100)


def test_kl_in_reward_by_hand():
    from recipe.driver.advantage import KLController, kl_in_reward

    scores = torch.tensor([1.0, -1.0])
    log_probs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 9.0], [-0.5, 0.0, 0.0]])  # padding may hold anything
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    controller = KLController("adaptive", 0.5, target_kl=0.1, horizon=10)
    rewards, metrics = kl_in_reward(scores, log_probs, ref, mask, controller, "kl")
    # k1 = log_prob - ref: row 0: 0.5 - 1.0 = -0.5 summed; row 1: 0
    assert rewards.tolist() == pytest.approx([1.0 - 0.5 * -0.5, -1.0])
    # mean over sequences of the per-token mean: (-0.25 + 0) / 2
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(-0.125), "actor/reward_kl_penalty_coeff": 0.5}
    assert controller.value == pytest.approx(0.5 * (1 - 0.2 * 2 / 10))  # beta before this step was used


def test_varying_groups_keeps_groups_that_differ_or_have_one_sample():
    from recipe.driver.advantage import varying_groups

    values = torch.tensor([1.0, 1.0, 1.0, 0.0, 5.0, -1.0, -1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 3, 3])
    assert varying_groups(values, groups).tolist() == [False, True, True, False]


def test_run_length_and_warmup_from_ratio():
    import dataclasses

    from recipe.config import load_config
    from recipe.driver.trainer import run_length, with_warmup_from_ratio

    assert run_length(10, None, 7) == 10
    assert run_length(None, 3, 7) == 21
    assert run_length(100, 2, 7) == 14  # whichever ends sooner, as verl
    cfg = load_config("configs/recipe/tiny_stability.yaml", ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"])
    # 16 prompts / mini-batches of 4 = 4 optimizer steps per RL step; 40 steps -> 160; 10 % of that
    assert with_warmup_from_ratio(cfg, 40).actor_rollout_ref.actor.optim.lr_warmup_steps == 16
    explicit = dataclasses.replace(cfg.actor_rollout_ref.actor.optim, lr_warmup_steps=3)
    pinned = dataclasses.replace(cfg, actor_rollout_ref=dataclasses.replace(
        cfg.actor_rollout_ref, actor=dataclasses.replace(cfg.actor_rollout_ref.actor, optim=explicit)))
    assert with_warmup_from_ratio(pinned, 40) is pinned  # lr_warmup_steps given: the ratio is not used

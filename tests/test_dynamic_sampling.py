"""DAPO's dynamic sampling on the driver (recipe/driver/dynamic_sampling.py), without workers: the
prompt groups whose responses differ are kept across generation batches, in order, with every field
of their rows, until the step has its prompts."""

import pytest
import torch

from recipe.config import FilterGroupsConfig
from recipe.data.dataset import DataError
from recipe.driver.dynamic_sampling import sample
from recipe.driver.rollouts import Rollout
from recipe.reward import RewardOutput

N = 2  # responses per prompt


def _batch(index: int, scores: list[float]) -> tuple[Rollout, RewardOutput]:
    """A generation batch of len(scores) // N prompts; row r's token is 100 * index + r."""
    rows = len(scores)
    rollout = Rollout(samples=[f"prompt {index}.{r // N}" for r in range(rows)],
                      groups=torch.arange(rows // N).repeat_interleave(N),
                      response_ids=[[100 * index + r] for r in range(rows)], log_probs=[[-0.5 * r] for r in range(rows)],
                      finish_reasons=["stop"] * rows, routed_experts=[torch.full((1, 1, 1), r) for r in range(rows)],
                      gen_seconds=1.5)
    return rollout, RewardOutput(scores=scores, acc=[float(s > 0) for s in scores], overlong_penalty=[0.0] * rows,
                                 extra={"pred": [f"p{index}.{r}" for r in range(rows)]})


# batch 0: groups 0 (varies) and 1 (all right); batch 1: groups 0 (all wrong) and 1 (varies)
BATCHES = [_batch(0, [1.0, -1.0, 1.0, 1.0]), _batch(1, [-1.0, -1.0, -1.0, 1.0])]


def test_the_varying_groups_of_two_batches_make_the_step():
    rollout, rewards, used = sample(lambda i: BATCHES[i], N, 2, FilterGroupsConfig(enable=True, metric="score"), 1)
    assert used == 2
    assert rollout.samples == ["prompt 0.0", "prompt 0.0", "prompt 1.1", "prompt 1.1"]
    assert rollout.groups.tolist() == [0, 0, 1, 1]
    assert rollout.response_ids == [[0], [1], [102], [103]]
    assert rollout.log_probs == [[0.0], [-0.5], [-1.0], [-1.5]]
    assert [int(r) for r in rollout.routed_experts] == [0, 1, 2, 3]
    assert rollout.gen_seconds == 3.0  # both batches were generated for this step
    assert rewards.scores == [1.0, -1.0, -1.0, 1.0] and rewards.extra["pred"] == ["p0.0", "p0.1", "p1.2", "p1.3"]


def test_without_the_filter_the_first_batch_is_the_step():
    rollout, rewards, used = sample(lambda i: BATCHES[i], N, 2, FilterGroupsConfig(enable=False), 1)
    assert (rollout, rewards, used) == (*BATCHES[0], 1)


def test_too_few_varying_groups_within_the_limit_is_one_error_naming_the_key():
    groups = FilterGroupsConfig(enable=True, metric="score", max_num_gen_batches=1)
    with pytest.raises(DataError, match=r"step 3: after 1 generation batches only 1 of 2 prompts .*"
                                        r"algorithm.filter_groups.max_num_gen_batches=1"):
        sample(lambda i: BATCHES[i], N, 2, groups, 3)

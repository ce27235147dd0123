"""A step's samples, with DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): batches of
``data.gen_batch_size`` prompts are generated until ``data.train_batch_size`` prompts have a group
whose metric varies (a group that all scored alike has zero advantage and teaches nothing); the
surplus is dropped, as in verl. Without it, one batch as generated.
"""

from __future__ import annotations

from typing import Callable

import torch

from recipe.config import FilterGroupsConfig
from recipe.data.dataset import DataError
from recipe.driver.advantage import varying_groups
from recipe.driver.rollouts import Rollout
from recipe.reward import RewardOutput

Batch = tuple[Rollout, RewardOutput]


def sample(generate: Callable[[int], Batch], n: int, want: int, groups: FilterGroupsConfig,
           step: int) -> tuple[Rollout, RewardOutput, int]:
    """The step's rollout and rewards, and how many generation batches it took. ``generate(i)``
    draws the next prompts and returns the i-th generation batch of the step with its rewards;
    ``n`` responses per prompt, ``want`` prompts kept."""
    batches: list[Batch] = []
    kept: list[int] = []  # prompt groups numbered across the generation batches
    while True:
        rollout, rewards = generate(len(batches))
        if not groups.enable:
            return rollout, rewards, 1
        metric = rewards.acc if groups.metric == "acc" else rewards.scores
        varying = varying_groups(torch.tensor(metric, dtype=torch.float64), rollout.groups)
        kept += (varying.nonzero().flatten() + len(batches) * (len(rollout.samples) // n)).tolist()
        batches.append((rollout, rewards))
        if len(kept) >= want:
            return (*_select_groups(batches, kept[:want], n), len(batches))
        gen_batches, count = len(batches), len(kept)
        if 0 < groups.max_num_gen_batches <= gen_batches:
            raise DataError(
                f"step {step}: after {gen_batches} generation batches only {count} of {want} prompts had responses "
                f"whose {groups.metric} differed (algorithm.filter_groups.max_num_gen_batches="
                f"{groups.max_num_gen_batches}): the prompts are too easy or too hard for the model; raise the "
                "limit (<= 0: no limit) or change the data")


def _select_groups(batches: list[Batch], groups: list[int], n: int) -> Batch:
    """The given prompt groups (numbered across the generation ``batches``, ``n`` rows each) as one
    rollout and its rewards, groups renumbered in that order."""
    rows = [g * n + i for g in groups for i in range(n)]
    whole = Rollout.concat([b[0] for b in batches])
    rewards = [b[1] for b in batches]

    def pick(values: list | None) -> list | None:
        return None if values is None else [values[r] for r in rows]

    def pick_joined(parts: list[list]) -> list:
        return pick([v for part in parts for v in part])

    return (Rollout(samples=pick(whole.samples), groups=torch.arange(len(groups)).repeat_interleave(n),
                    response_ids=pick(whole.response_ids), log_probs=pick(whole.log_probs),
                    finish_reasons=pick(whole.finish_reasons), routed_experts=pick(whole.routed_experts),
                    gen_seconds=whole.gen_seconds),
            RewardOutput(scores=pick_joined([r.scores for r in rewards]), acc=pick_joined([r.acc for r in rewards]),
                         overlong_penalty=pick_joined([r.overlong_penalty for r in rewards]),
                         extra={k: pick_joined([r.extra[k] for r in rewards]) for k in rewards[0].extra}))

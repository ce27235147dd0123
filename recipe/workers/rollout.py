"""The rollout role of one rank: its engine (``recipe.rollout.ENGINES``), generation, and the
device handed back to the trainer while it sleeps. The weights come in through the engine's
``load_weights`` (``recipe.rollout.sync``)."""

from __future__ import annotations

import torch

from recipe.config import RecipeConfig
from recipe.rollout import ENGINES
from recipe.rollout.base import Generation, SamplingParams


class RolloutWorker:
    def __init__(self, cfg: RecipeConfig, model_dir: str, dtype: torch.dtype, platform: str):
        self.engine = ENGINES[cfg.actor_rollout_ref.rollout.name].build(cfg, model_dir, dtype, platform)

    def generate(self, prompts: list[list[int]], request_ids: list[int], params: SamplingParams) -> Generation:
        self.engine.wake_up()
        return self.engine.generate(prompts, params, request_ids=request_ids)

    def sleep(self) -> None:
        self.engine.sleep()

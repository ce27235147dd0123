"""The rollout role of one rank: its engine (``recipe.rollout.ENGINES``), generation, and the
device handed back to the trainer while it sleeps. The weights come in through the engine's
``load_weights`` (``recipe.rollout.sync``)."""

from __future__ import annotations

import time

import torch

from recipe.config import RecipeConfig
from recipe.rollout import ENGINES
from recipe.rollout.base import EngineArgs, Generation, SamplingParams


class RolloutWorker:
    def __init__(self, cfg: RecipeConfig, model_dir: str, dtype: torch.dtype, platform: str):
        rollout, data = cfg.actor_rollout_ref.rollout, cfg.data
        self.engine = ENGINES[rollout.name].build(EngineArgs(
            model_dir=model_dir, dtype=dtype, platform=platform, rollout=cfg.layout.rollout,
            max_model_len=data.max_prompt_length + data.max_response_length, seed=cfg.trainer.seed,
            return_routed_experts=rollout.enable_rollout_routing_replay,
            engine_kwargs=rollout.engine_kwargs.get(rollout.name),
        ))

    def generate(self, prompts: list[list[int]], request_ids: list[int],
                 params: SamplingParams) -> tuple[Generation, float]:
        """The engine's responses, and the seconds they took here (the driver's clock would count
        the time the call waited, too)."""
        start = time.perf_counter()
        self.engine.wake_up()
        return self.engine.generate(prompts, params, request_ids=request_ids), time.perf_counter() - start

    def sleep(self) -> None:
        self.engine.sleep()

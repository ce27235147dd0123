"""The rollout role of one rank: its engine (``recipe.rollout.ENGINES``), generation, and the
device handed back to the trainer while it sleeps. The weights come in through the engine's
``load_weights`` (``recipe.rollout.sync``). A generation the engine paused (partial rollout,
``recipe.rollout.partial``) is kept here, samplers included, until ``resume`` continues it."""

from __future__ import annotations

import dataclasses
import time

import torch

from recipe.config import RecipeConfig
from recipe.rollout import ENGINES
from recipe.rollout import partial
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
        self.paused: tuple[list[list[int]], SamplingParams, Generation] | None = None  # what resume() continues

    def generate(self, prompts: list[list[int]], request_ids: list[int],
                 params: SamplingParams) -> tuple[Generation, float]:
        """The engine's responses, and the seconds they took here (the driver's clock would count
        the time the call waited, too)."""
        start = time.perf_counter()
        self.engine.wake_up()
        out = self.engine.generate(prompts, params, request_ids=request_ids)
        return self._kept(prompts, params, out), time.perf_counter() - start

    def pause(self) -> None:
        """Stop the generation running now after its current token (from another thread)."""
        self.engine.pause()

    def resume(self) -> tuple[Generation, float] | None:
        """The paused generation, every row of it, with its paused responses continued under the
        weights the engine holds now, and the seconds that took; None if none is paused. A
        generation run in between (a validation) leaves the paused one as it was."""
        if self.paused is None:
            return None
        start = time.perf_counter()
        (prompts, params, paused), self.paused = self.paused, None
        out = partial.resume(self.engine, prompts, params, paused)
        return self._kept(prompts, params, out), time.perf_counter() - start

    def _kept(self, prompts: list[list[int]], params: SamplingParams, out: Generation) -> Generation:
        """``out`` as it leaves the process; kept here for ``resume``, samplers included, if paused."""
        if partial.paused_rows(out):
            self.paused = prompts, params, out
        return dataclasses.replace(out, generators=None)

    def sleep(self) -> None:
        self.engine.sleep()

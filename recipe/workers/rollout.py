"""The rollout role of one rank: its engine (``recipe.rollout.ENGINES``), generation, and the
device handed back to the trainer while it sleeps. The weights come in through the engine's
``load_weights`` (``recipe.rollout.sync``). With partial rollout (``recipe.rollout.partial``) a
pause holds until ``release``: the generation running stops after its current token, one that
starts meanwhile does not start; each is kept here under its key, samplers included, until
``resume`` continues it."""

from __future__ import annotations

import dataclasses
import time

import torch

from recipe.config import RecipeConfig
from recipe.rollout import ENGINES
from recipe.rollout import partial
from recipe.rollout.base import EngineArgs, Generation, SamplingParams


class RolloutWorker:
    def __init__(self, cfg: RecipeConfig, model_dir: str, dtype: torch.dtype, platform: str, colocated: bool = True):
        """``colocated``: the engine shares the device with a training rank (``EngineArgs.colocated``)."""
        rollout, data = cfg.actor_rollout_ref.rollout, cfg.data
        self.engine = ENGINES[rollout.name].build(EngineArgs(
            model_dir=model_dir, dtype=dtype, platform=platform, rollout=cfg.layout.rollout,
            max_model_len=data.max_prompt_length + data.max_response_length, seed=cfg.trainer.seed,
            return_routed_experts=rollout.enable_rollout_routing_replay,
            engine_kwargs=rollout.engine_kwargs.get(rollout.name), colocated=colocated,
            pausable=cfg.async_training.partial_rollout,
        ))
        self.holding = False  # a pause came and the new weights have not: generations wait
        # what resume() continues, by the key of the generation call: (prompts, request ids, params,
        # the generation so far, None if it never started)
        self.paused: dict[int, tuple[list[list[int]], list[int], SamplingParams, Generation | None]] = {}

    def generate(self, prompts: list[list[int]], request_ids: list[int], params: SamplingParams,
                 key: int | None = None) -> tuple[Generation, float]:
        """The engine's responses, and the seconds they took here (the driver's clock would count
        the time the call waited, too). ``key`` names the call for ``resume``."""
        # queued behind a paused generation: it starts after the push (on every rank of an engine
        # whose ranks decode together, if the pause has reached any of them)
        if key is not None and self.engine.agree(self.holding):
            self.paused[key] = prompts, request_ids, params, None
            return partial.held(len(prompts)), 0.0
        start = time.perf_counter()
        self.engine.wake_up()
        out = self.engine.generate(prompts, params, request_ids=request_ids)
        return self._kept(key, prompts, request_ids, params, out), time.perf_counter() - start

    def pause(self) -> None:
        """Stop the generation running now after its current token (from another thread), and hold
        the ones that would start until ``release``."""
        self.holding = True
        self.engine.pause()

    def release(self) -> None:
        """The pushed weights are in: generations run again."""
        self.holding = False

    def resume(self, key: int) -> tuple[Generation, float] | None:
        """Generation ``key``, every row of it, with its paused responses continued (or, held before it
        started, made from the start) under the weights the engine holds now, and the seconds that
        took; None if nothing of it waits here. A generation run in between (a validation) leaves
        the paused ones as they were."""
        if key not in self.paused:
            return None
        prompts, request_ids, params, paused = self.paused.pop(key)
        if paused is None:  # held before it started
            return self.generate(prompts, request_ids, params, key)
        start = time.perf_counter()
        out = partial.resume(self.engine, prompts, request_ids, params, paused)
        return self._kept(key, prompts, request_ids, params, out), time.perf_counter() - start

    def _kept(self, key: int | None, prompts: list[list[int]], request_ids: list[int], params: SamplingParams,
              out: Generation) -> Generation:
        """``out`` as it leaves the process; kept here for ``resume``, samplers included, if paused."""
        if key is not None and out.paused:
            self.paused[key] = prompts, request_ids, params, out
        return dataclasses.replace(out, generators=None)

    def sleep(self) -> None:
        self.engine.sleep()

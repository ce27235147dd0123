"""Rollout engines behind one interface (``recipe.rollout.base``): vLLM / vLLM-Ascend, and
transformers on the CPU; the weight sync from the actor (``sync``).

``ENGINES`` is what the config and the workers read: the names ``actor_rollout_ref.rollout.name``
accepts, the engine ``auto`` picks for a device, how to build one and how its weights are routed.
Adding an engine is one module with a ``build(args: EngineArgs)`` function and one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recipe.rollout.base import EngineArgs, RolloutEngine


@dataclass(frozen=True)
class Engine:
    module: str  # imported only to build the engine: it may import vllm
    devices: tuple[str, ...]  # the platforms it runs on
    expert_parallel: bool  # shards the experts over the rollout's EP ranks, each receiving only its own

    def build(self, args: EngineArgs) -> RolloutEngine:
        return importlib.import_module(self.module).build(args)


ENGINES = {
    "hf": Engine("recipe.rollout.hf_engine", devices=("cpu",), expert_parallel=False),
    "vllm": Engine("recipe.rollout.vllm_engine", devices=("cuda", "npu"), expert_parallel=True),
}


def engines_for(device: str) -> list[str]:
    """The engines that run on ``device``; ``auto`` takes the first."""
    return [name for name, engine in ENGINES.items() if device in engine.devices]

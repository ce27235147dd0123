"""Rollout engines behind one interface (``recipe.rollout.base``): vLLM / vLLM-Ascend
(``vllm_engine``, with ``vllm_setup`` and ``vllm_weights``) and transformers on every platform
(``hf_engine``); partial rollout (``partial``); the weight sync from the actor into a colocated
engine (``sync``) and to a rollout pool of its own (``broadcast``).

``ENGINES`` is what the config and the workers read: the names ``actor_rollout_ref.rollout.name``
accepts, the platforms each runs on, how to build one and how its weights are routed; ``auto_engine``
is what ``auto`` picks. Adding an engine is one module with a ``build(args: EngineArgs)`` function
and one entry here.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recipe.rollout.base import EngineArgs, RolloutEngine


@dataclass(frozen=True)
class Engine:
    module: str  # imported only to build the engine: it may import vllm
    devices: tuple[str, ...]  # the platforms it runs on
    expert_parallel: bool  # shards the experts over the rollout's EP ranks, each receiving only its own
    requires: dict[str, tuple[str, ...]] = field(default_factory=dict)  # per platform, the packages it imports

    def missing(self, device: str) -> list[str]:
        """The packages the engine needs on ``device`` that this Python cannot import."""
        return [p for p in self.requires.get(device, ()) if importlib.util.find_spec(p) is None]

    def build(self, args: EngineArgs) -> RolloutEngine:
        return importlib.import_module(self.module).build(args)


# In ``auto``'s order of preference: the first whose packages are installed serves.
ENGINES = {
    "vllm": Engine("recipe.rollout.vllm_engine", devices=("cuda", "npu"), expert_parallel=True,
                   requires={"cuda": ("vllm",), "npu": ("vllm", "vllm_ascend")}),
    # one process per rank, no parallelism and no paged KV cache: the CPU engine, and on a GPU or
    # NPU the engine for a machine without vLLM (and for debugging: transformers' own model code)
    "hf": Engine("recipe.rollout.hf_engine", devices=("cpu", "cuda", "npu"), expert_parallel=False),
}


def engines_for(device: str) -> list[str]:
    """The engines that run on ``device``, installed or not."""
    return [name for name, engine in ENGINES.items() if device in engine.devices]


def auto_engine(device: str) -> tuple[str, str]:
    """The engine ``auto`` picks on ``device`` (the first of ``ENGINES`` that runs there and is
    installed) and why, for the start-up line."""
    passed = []
    for name in engines_for(device):
        missing = ENGINES[name].missing(device)
        if not missing:
            why = f"the first engine for {device} installed here" if passed else f"the engine for {device}"
            return name, why + "".join(f"; {p}" for p in passed)
        passed.append(f"{name} needs {', '.join(missing)}, not installed")
    raise ValueError(f"no rollout engine runs on {device!r}")

"""How a step gets its samples and the engines get the step's weights: one interface, whatever the
mode, so the trainer's step has no mode branches.

- ``OnPolicy``: the synchronous loop (verl's default): each generation batch is made when the step
  asks for it, under the weights of the step before, and every update goes to the engines at once.
- ``AsyncSchedule`` (``recipe.driver.async_schedule``): one_step_off and fully_async, batches
  generated ahead on a rollout pool of its own, the weights pushed every T steps.

The trainer's step calls ``batch`` (then ``metrics``) and, after its update, ``after_update``; a
checkpoint asks ``drawn_ahead`` where the sampler stood before the next step's batch.
"""

from __future__ import annotations

from typing import Callable, Protocol

from recipe.driver.dispatch import Dispatch, GenerationRequest
from recipe.driver.rollouts import Rollout

Sync = Callable[[], dict[str, float]]  # the weight sync to the engines, returning its metrics


class GenerationStrategy(Protocol):
    def batch(self, step: int, index: int = 0) -> Rollout:
        """Step ``step``'s ``index``-th generation batch (index > 0: DAPO's filter asks for more)."""

    def after_update(self, step: int, sync: Sync, validates: bool) -> dict[str, float]:
        """After step ``step``'s update: the weights to the engines with ``sync()`` where due (and
        before a validation, if ``validates``); what ``sync`` returned, or nothing."""

    def drawn_ahead(self, step: int) -> int:
        """How many generation batches were drawn from the sampler for the steps after ``step``."""

    def metrics(self, step: int, rollout: Rollout, step_seconds: float) -> dict[str, float]:
        """The mode's own metrics of step ``step`` (its ``rollout``)."""


class OnPolicy:
    """Generation when the step asks for it, on the engines that hold the last update's weights."""

    def __init__(self, dispatch: Dispatch, request: Callable[[int, int], GenerationRequest]):
        self.dispatch, self.request = dispatch, request

    def batch(self, step: int, index: int = 0) -> Rollout:
        r = self.request(step, index)
        return self.dispatch.generate(r.prompts, r.n, r.params, r.first_row)

    def after_update(self, step: int, sync: Sync, validates: bool) -> dict[str, float]:
        return sync()

    def drawn_ahead(self, step: int) -> int:
        return 0

    def metrics(self, step: int, rollout: Rollout, step_seconds: float) -> dict[str, float]:
        return {}

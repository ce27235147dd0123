"""``async_training.mode=one_step_off``: verl's one-step-off-policy schedule, on a rollout pool of
its own (``recipe.workers.separate``; docs/async.md).

Policy version v is the weights after v updates. During step t the engines hold version t-1::

    step 1:  generate batch 1 (v0) and wait for it   | send batch 2 off (v0)  | train on 1 -> v1 | wait for 2, sync v1
    step t:  take batch t (made during step t-1)     | send batch t+1 off     | train on t -> vt | wait for t+1, sync vt
             (v_{t-2}: one version behind v_{t-1})   | (v_{t-1})

The actor recomputes the old log-probs of batch t under v_{t-1} (decoupled PPO: the policy that
made the samples need not be the proximal one), and the rollout correction weighs the gap between
them and the engine's log-probs (``recipe.config``: on by default in this mode). The trainer thus
updates while the next batch is generated; the sync waits for that batch, so a batch is never made
by two versions.
"""

from __future__ import annotations

import time
from typing import Callable

from recipe.driver.dispatch import Dispatch, PendingRollout, Rollout


class OneStepOff:
    def __init__(self, dispatch: Dispatch, total_steps: int):
        self.dispatch, self.total_steps = dispatch, total_steps
        self.ahead: tuple[PendingRollout, int] | None = None  # the generation in flight, and its policy version
        self.ready: Rollout | None = None  # collected, not yet taken
        self.waited = 0.0  # seconds the trainer waited for generations since the last metrics()

    def batch(self, step: int, start: Callable[[int], PendingRollout]) -> Rollout:
        """Step ``step``'s batch, with the next step's sent off to the rollout pool. ``start(s)``
        sends step s's prompts (with its seeds). The first step of a run (or of a resumed run)
        generates its own batch first."""
        if self.ready is None:
            self.ahead = (start(step), step - 1)
            self.finish()
        rollout, self.ready = self.ready, None
        if step < self.total_steps:
            self.ahead = (start(step + 1), step - 1)
        return rollout

    def finish(self) -> None:
        """Wait for the generation in flight (before the engines get new weights)."""
        if self.ahead is None:
            return
        (pending, version), self.ahead = self.ahead, None
        clock = time.perf_counter()
        self.ready = self.dispatch.collect(pending)
        self.waited += time.perf_counter() - clock
        self.ready.policy_version = version

    def metrics(self, step: int, rollout: Rollout) -> dict[str, float]:
        """How stale the step's samples were (versions behind the policy that scored them), how long
        the trainer waited for generations, and generation as the rollout ranks timed it."""
        waited, self.waited = self.waited, 0.0
        behind = float(step - 1 - rollout.policy_version)  # one generation batch: every sample alike
        return {"async/staleness_mean": behind, "async/staleness_max": behind,
                "timing_s/wait_rollout": waited, "timing_s/gen": rollout.gen_seconds}

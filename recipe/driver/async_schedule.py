"""The asynchronous modes' schedule (docs/async.md): batches generated ahead on a rollout pool of
its own (``recipe.workers.rank``), the weights pushed to it every T steps, no sample more than
K policy versions behind the policy that trains on it.

Policy version v is the weights after v updates; step t trains on batch t with version t-1, so a
batch made under version p is t - 1 - p versions stale. The engines hold the last pushed version
p, and batch b may be generated under it only while b - 1 - p <= K; a batch past the bound is held
back until the next push, never generated and dropped. Batches are sent in step order as soon as
the bound allows, all it allows at once as one round (each rollout rank runs a step's batches as
one engine call and answers each as soon as it is done, ``recipe.workers.rollout``; a step's
batches not sent yet when it asks for them go first, alone), and collected in that order. Before
a push the driver collects every batch the outgoing version may still make (waiting for them), so
a batch is never made by two versions and batch b always comes from the first pushed version p
with b <= p + K + 1, however fast generation runs.

With ``require_batches`` R > 1 a step's batch is R generation batches, numbered g = R (t - 1) + 1 ...
R t over the run, joined when the step takes them; the bound counts them: g may be made under p
while g <= R (p + T) + E, E = floor(``staleness_threshold`` x T x R) (with R = 1: b - 1 - p <= K).

With partial rollout (``async_training.partial_rollout``) a push instead pauses the batches in
flight (``recipe.rollout.partial``): the one each rollout rank is generating stops after its
current token, those queued behind it are held before they start; the weights load and the
batches go on under them, in the order sent. Their tokens carry the version that made each, and
none is more than K behind (those made before the push were within the bound when the batch was
sent, those after it are fresher).

``one_step_off`` is T = 1, K = 1 (verl's one-step-off-policy recipe)::

    step 1:  generate batch 1 (v0) and wait for it   | send batch 2 off (v0)  | train on 1 -> v1 | wait for 2, push v1
    step t:  take batch t (made during step t-1)     | send batch t+1 off     | train on t -> vt | wait for t+1, push vt
             (v_{t-2}: one version behind v_{t-1})   | (v_{t-1})

``fully_async``: T = ``trigger_parameter_sync_step``, K = T - 1 + ceil(E / R)
(``recipe.config.AsyncTrainingConfig``). The actor recomputes the old log-probs of batch t under
v_{t-1} (decoupled PPO: the policy that made the samples need not be the proximal one), and the
rollout correction weighs the gap between them and the engine's log-probs (on by default in both
modes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from recipe.driver.dispatch import Dispatch, GenerationRequest, PendingRollout
from recipe.driver.rollouts import Rollout
from recipe.rollout.partial import PAUSED
from recipe.workers.group import WorkerTimeoutError

WAIT_KEY = "async_training.wait_rollout_timeout_s"


@dataclass
class _Generating:
    """A generation batch sent: its number, its generation, and what the pushes that paused it recorded."""

    batch: int
    pending: PendingRollout
    token_versions: list[list[int]]  # per row, the versions of the tokens made before the last pause
    resumed: set[int] = field(default_factory=set)  # rows a pause stopped and the rollout continued
    seconds: float = 0.0  # the rollout ranks' generation before the last pause

    def record(self, so_far: Rollout, version: int) -> None:
        """The responses ``so_far`` (at a pause or the end): their new tokens were made by ``version``."""
        for versions, tokens in zip(self.token_versions, so_far.response_ids):
            versions += [version] * (len(tokens) - len(versions))
        self.resumed.update(row for row, reason in enumerate(so_far.finish_reasons) if reason == PAUSED)
        self.seconds += so_far.gen_seconds


class AsyncSchedule:
    def __init__(self, dispatch: Dispatch, request: Callable[[int, int], GenerationRequest], total_steps: int,
                 sync_every: int, batches_ahead: int, step: int, wait_timeout_s: float,
                 partial_rollout: bool = False, per_step: int = 1):
        """``request(s, i)`` is the ``i``-th of step s's ``per_step`` generation batches (its prompts, its
        seeds); ``sync_every`` is T, ``batches_ahead`` E (``AsyncTrainingConfig``);
        ``step`` is the last completed step, whose weights the engines hold (a fresh run's 0, a resumed
        run's); a batch not made within ``wait_timeout_s`` of the wait for it fails the run.
        ``partial_rollout``: a push pauses the batch in flight and it goes on under the new weights."""
        self.dispatch, self.request, self.total_steps = dispatch, request, total_steps
        self.wait_timeout_s = wait_timeout_s
        self.sync_every, self.batches_ahead, self.partial_rollout = sync_every, batches_ahead, partial_rollout
        self.per_step = per_step
        self.pushed = step  # the policy version the engines hold
        self.next_batch = step * per_step + 1  # the generation batch sent next, numbered from 1 over the run
        self.in_flight: list[_Generating] = []  # sent, not collected, in the order sent
        self.made: dict[int, Rollout] = {}  # collected, not yet taken, by generation batch
        self.waited = 0.0  # seconds the trainer waited for generations since the last metrics()
        self.generated = 0.0  # seconds the rollout ranks generated the batches collected since then
        self.pushes = 0  # weight pushes since the last metrics()

    def batch(self, step: int, index: int = 0) -> Rollout:
        """Step ``step``'s batch, its generation batches joined: made ahead, or generated now (the first
        step of a run or of a resumed run, or a rollout slower than the trainer). ``index`` is 0: DAPO's
        filter, which asks for more, is refused in the asynchronous modes (``recipe.config``)."""
        first = (step - 1) * self.per_step + 1
        wanted = range(first, first + self.per_step)
        self._send_allowed(last=wanted[-1])  # not sent yet (a run's first step): alone, the step waits for them
        self._send_allowed()
        while any(b not in self.made for b in wanted):  # within the bound: the last push is >= step - T
            self._advance()
        return Rollout.concat([self.made.pop(b) for b in wanted])

    def after_update(self, step: int, sync: Callable[[], dict[str, float]], validates: bool) -> dict[str, float]:
        """Push step ``step``'s weights when due or before a validation (which then sees the current
        policy); otherwise the rollout goes on generating, and the batches it finished are collected."""
        if self.push_due(step) or validates:
            return self.push(step, sync)
        self.poll()
        return {}

    def drawn_ahead(self, step: int) -> int:
        """The generation batches sent for the steps after ``step`` (each drew its prompts)."""
        return max(0, self.next_batch - 1 - step * self.per_step)

    def poll(self) -> None:
        """Collect the generations done, in the order sent, and send what the bound allows: the rollout
        need not idle until the trainer next asks for a batch."""
        while self.in_flight and self.dispatch.done(self.in_flight[0].pending):
            self._advance()

    def push_due(self, step: int) -> bool:
        """The weights of step ``step``'s update go to the engines every ``sync_every`` steps."""
        return step % self.sync_every == 0

    def push(self, step: int, sync: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Push step ``step``'s weights with ``sync()`` once the engines are idle; returns what ``sync``
        returned. Without partial rollout the engines first make every batch the outgoing version may
        still make (each is sent as soon as the bound allows); with it, the batches in flight are
        paused, and continued under the new weights."""
        if self.partial_rollout and self.in_flight:
            self._pause()
        else:
            while self.in_flight:
                self._advance()
        result = sync()
        self.pushed = step
        self.pushes += 1
        for paused in self.in_flight:  # paused above: its paused responses go on under the new weights
            paused.pending = self.dispatch.resume(paused.pending)
        return result

    def _pause(self) -> None:
        """Pause the batches in flight; their responses so far were made by the engines' version."""
        pending = [generating.pending for generating in self.in_flight]
        answers = self._wait(lambda timeout_s: self.dispatch.pause(pending, timeout_s))
        for generating, (so_far, paused) in zip(self.in_flight, answers):
            generating.pending = paused
            generating.record(so_far, self.pushed)

    def _wait(self, answers: Callable[[float], object]):
        """``answers(timeout_s)``: the rollout ranks' answers, waited for at most ``wait_timeout_s``
        (``timing_s/wait_rollout``); past it, one line naming the key that sets the limit."""
        clock = time.perf_counter()
        try:
            result = answers(self.wait_timeout_s)
        except WorkerTimeoutError as e:
            raise WorkerTimeoutError(f"no batch from the rollout pool within {WAIT_KEY}={self.wait_timeout_s:g} s: {e} "
                                     "(hung, or generating slower than that: then raise it)") from None
        self.waited += time.perf_counter() - clock
        return result

    def _allowed(self, batch: int) -> bool:
        """Generation batch ``batch`` may be made under the engines' version p: it is at most E batches
        past those of the T steps that train on p's pushes (b <= R (p + T) + E), so its step is at most
        K versions ahead of p, and it belongs to the run."""
        return batch <= min(self.per_step * (self.pushed + self.sync_every) + self.batches_ahead,
                            self.per_step * self.total_steps)

    def _send_allowed(self, last: int | None = None) -> None:
        """Send the next batches (up to ``last``), in order, while the bound allows them (a batch past
        it is held back until a push); those sent together the rollout ranks generate as one engine
        call, each answered as soon as its responses have ended."""
        batches, batch = [], self.next_batch
        while self._allowed(batch) and (last is None or batch <= last):
            batches.append(batch)
            batch += 1
        if not batches:
            return
        requests = []
        for batch in batches:
            step, index = divmod(batch - 1, self.per_step)
            requests.append(self.request(step + 1, index))
        for batch, pending in zip(batches, self.dispatch.start_generation(requests)):
            self.in_flight.append(_Generating(batch, pending, [[] for _ in pending.rows]))
        self.next_batch += len(batches)

    def _advance(self) -> None:
        """Wait for the first generation in flight, then send what the bound allows."""
        generating = self.in_flight.pop(0)
        rollout = self._wait(lambda timeout_s: self.dispatch.collect(generating.pending, timeout_s))
        generating.record(rollout, self.pushed)
        rollout.gen_seconds, rollout.token_versions = generating.seconds, generating.token_versions
        rollout.resumed_rows = len(generating.resumed)
        self.generated += rollout.gen_seconds
        self.made[generating.batch] = rollout
        self._send_allowed()

    def metrics(self, step: int, rollout: Rollout, step_seconds: float) -> dict[str, float]:
        """How stale the step's response tokens were (versions behind the policy that scored them:
        mean and max over the tokens), how many responses a push paused and the rollout continued,
        how long the trainer waited for generations, generation as the rollout ranks timed it, whether
        the step pushed its weights, the time the rollout ranks were not generating (waiting for the
        trainer: for a push, or held back by the bound; counted by the batches collected in the step,
        so a generation that ran across two steps counts in the step that collected it), and the
        share of the step each pool spent idle."""
        waited, self.waited = self.waited, 0.0
        generated, self.generated = self.generated, 0.0
        pushes, self.pushes = self.pushes, 0
        behind = [step - 1 - version for versions in rollout.token_versions for version in versions]
        return {"async/staleness_mean": sum(behind) / len(behind), "async/staleness_max": float(max(behind)),
                "async/partial_rollout_resumes": float(rollout.resumed_rows), "async/weight_pushes": float(pushes),
                "timing_s/wait_rollout": waited, "timing_s/gen": rollout.gen_seconds,
                "timing_s/wait_train": max(0.0, step_seconds - generated),
                "async/idle_ratio_trainer": min(1.0, waited / step_seconds),
                "async/idle_ratio_rollout": max(0.0, 1.0 - generated / step_seconds)}

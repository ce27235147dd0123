"""SIGTERM and SIGINT to the driver: a clean stop, never a stack dump.

Ray's ``ray.init`` replaces the driver's handlers: its Python SIGTERM handler calls
``sys.exit``, and the core worker it loads installs absl's failure-signal handler for SIGTERM
(the ``*** SIGTERM received`` dump, then the process aborts). The trainer installs these
handlers again once Ray is up (``DriverSignals.install``). A signal then raises ``Stopped``
wherever the driver is; the entry point ends the workers and Ray and exits with 128 + the
signal's number. ``Stopped`` is a ``KeyboardInterrupt`` because Ray's blocking waits
(``ray.get``) end early only for that: they run the handler, hold any other exception until the
wait is over, and raise a fresh ``KeyboardInterrupt`` in place of the handler's. So the handler
also keeps what it raised (``DriverSignals.stopped``) for whoever catches the interrupt.

With ``trainer.save_on_sigterm_grace_s`` > 0 a SIGTERM during a step lets the step finish and
saves a checkpoint before stopping, if that is done within the grace period; when the period runs
out first, the driver stops at once without the checkpoint. Another signal while the step
finishes stops at once; a signal while stopping is ignored, since the shutdown under way ends the run.
A signal within ``held`` (a step's metrics line and its checkpoint put in place) stops at its end, so
the run's files never record one of the two without the other.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator

from tqdm import tqdm

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Stopped(KeyboardInterrupt):
    """The driver was stopped by a signal; ``where`` says where the run was and where a re-run resumes."""

    def __init__(self, signum: int, why: str = ""):
        super().__init__(signum, why)
        self.signum, self.why, self.where = signum, why, ""
        self.exit_now = False  # nothing left to end: the command exits without its atexit clean-up

    def __str__(self) -> str:
        return "; ".join(filter(None, [f"stopped by {signal.Signals(self.signum).name}{self.why}", self.where]))

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class DriverSignals:
    def __init__(self, grace_s: float = 0.0):
        self.grace_s = grace_s
        self.in_steps = False  # a SIGTERM now may wait for the step's end (with a grace period)
        self.pending: int | None = None  # a SIGTERM waiting for the step's end
        self.stopping = False
        self.stopped: Stopped | None = None  # what the handler raised
        self.holding = False
        self.held_stop: tuple[int, str] | None = None  # a stop that waits for the end of ``held``

    def install(self) -> None:
        for signum in HANDLED:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.stopping:
            tqdm.write(f"{signal.Signals(signum).name} again: already stopping")
            return
        if signum == signal.SIGTERM and self.grace_s > 0 and self.in_steps and self.pending is None:
            self.pending = signum
            signal.signal(signal.SIGALRM, self._grace_over)
            signal.setitimer(signal.ITIMER_REAL, self.grace_s)
            tqdm.write(f"SIGTERM: finishing the step and saving a checkpoint within "
                       f"trainer.save_on_sigterm_grace_s={self.grace_s:g}")
            return
        self._stop_or_hold(signum, "")

    def _grace_over(self, signum: int, frame) -> None:
        if not self.stopping:
            self._stop_or_hold(signal.SIGTERM, f" (no checkpoint: the step and its save took longer than "
                                               f"trainer.save_on_sigterm_grace_s={self.grace_s:g})")

    def _stop_or_hold(self, signum: int, why: str) -> None:
        if not self.holding:
            self._stop(signum, why)
        elif self.held_stop is None:
            self.held_stop = (signum, why)

    def _stop(self, signum: int, why: str) -> None:
        self.stopping = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        self.stopped = Stopped(signum, why)
        raise self.stopped

    @contextlib.contextmanager
    def steps(self) -> Iterator[None]:
        """The training steps: a SIGTERM within waits for the end of its step (``step_ended``)."""
        self.in_steps = True
        try:
            yield
        finally:
            self.in_steps = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A stop signalled within waits for its end (the stop is raised there)."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.held_stop is not None:
            self._stop(*self.held_stop)

    def step_ended(self, save: Callable[[], object] | None) -> None:
        """At the end of a step: with a SIGTERM waiting, ``save`` (None: the step saved already) and stop."""
        if self.pending is not None:
            if save is not None:
                save()
            self._stop(self.pending, " (checkpoint saved at the end of the step)")

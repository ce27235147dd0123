"""The driver's signal handling without Ray (``recipe.driver.signals``): which signal stops when, the
grace period for a checkpoint on SIGTERM, and the exit status. The whole driver under signals: the
signal tests in test_recipe_stops.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

from recipe.driver.signals import HANDLED, DriverSignals, Stopped


@pytest.fixture
def handlers():
    """The test's handlers are the process's for the test only."""
    saved = {s: signal.getsignal(s) for s in (*HANDLED, signal.SIGALRM)}
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    for s, handler in saved.items():
        signal.signal(s, handler)


def deliver(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs at the next bytecode on the main thread


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_at_once_without_a_grace_period(handlers, signum, code):
    signals = DriverSignals()
    signals.install()
    with pytest.raises(Stopped) as info, signals.steps():
        deliver(signum)
    assert info.value is signals.stopped and info.value.exit_code == code
    assert str(info.value) == f"stopped by {signal.Signals(signum).name}"
    deliver(signum)  # a second one while stopping: ignored
    assert signals.stopped is info.value


def test_sigterm_waits_for_the_step_end_and_saves(handlers):
    signals, saves = DriverSignals(grace_s=60), []
    signals.install()
    with signals.steps():
        deliver(signal.SIGTERM)  # mid-step: the step goes on
        assert signals.stopped is None
        with pytest.raises(Stopped, match=r"^stopped by SIGTERM \(checkpoint saved at the end of the step\)$"):
            signals.step_ended(lambda: saves.append("saved"))
    assert saves == ["saved"] and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_sigterm_outside_the_steps_or_a_second_signal_stops_at_once(handlers):
    signals = DriverSignals(grace_s=60)
    signals.install()
    with pytest.raises(Stopped):  # start-up, validation before training: nothing to save
        deliver(signal.SIGTERM)
    signals = DriverSignals(grace_s=60)
    signals.install()
    with pytest.raises(Stopped, match=r"^stopped by SIGINT$"), signals.steps():
        deliver(signal.SIGTERM)
        deliver(signal.SIGINT)  # while the step finishes: stop now


def test_sigterm_stops_without_a_checkpoint_when_the_grace_period_runs_out(handlers):
    signals = DriverSignals(grace_s=0.2)
    signals.install()
    start = time.monotonic()
    with pytest.raises(Stopped, match=r"no checkpoint: the step and its save took longer than "
                                      r"trainer.save_on_sigterm_grace_s=0.2") as info, signals.steps():
        deliver(signal.SIGTERM)
        time.sleep(5)  # a step longer than the grace period
    assert info.value.exit_code == 143 and time.monotonic() - start < 2


def test_a_signal_within_held_stops_at_its_end(handlers):
    """The step's metrics line and its checkpoint's publication go together: a SIGINT between them
    stops after both; the second one is ignored as usual."""
    signals, done = DriverSignals(), []
    signals.install()
    with pytest.raises(Stopped, match=r"^stopped by SIGINT$") as info, signals.steps():
        with signals.held():
            done.append("metrics line")
            deliver(signal.SIGINT)
            deliver(signal.SIGINT)
            done.append("checkpoint published")
        done.append("next step")
    assert done == ["metrics line", "checkpoint published"] and info.value is signals.stopped
    assert not signals.holding

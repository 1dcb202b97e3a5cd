"""SIGTERM/SIGINT while a loop runs: the first asks for a stop after the step, the grace period and a
second signal stop at once (SIGTERM: exit 143 with one line; SIGINT: KeyboardInterrupt)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hybridflow.controller.preemption import Preemption, TrainingInterrupted

# A loop that steps every 0.05 s inside Preemption (grace from argv) and says what it saw.
LOOP = textwrap.dedent("""
    import sys, time
    from hybridflow.controller.preemption import Preemption
    with Preemption(float(sys.argv[1]), lambda: "the newest is step 7") as stop:
        print("ready", flush=True)
        for step in range(1, 2000):
            time.sleep(float(sys.argv[2]))
            if stop.requested:
                print(f"stopping after step {step}", flush=True)
                raise stop.stopped(step, 2000, None)
""")


def start_loop(grace_s: float, step_s: float) -> subprocess.Popen:
    loop = subprocess.Popen([sys.executable, "-c", LOOP, str(grace_s), str(step_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert loop.stdout is not None and loop.stdout.readline().strip() == "ready"
    return loop


def test_the_first_sigterm_stops_the_loop_after_its_step():
    loop = start_loop(grace_s=30, step_s=0.05)
    loop.send_signal(signal.SIGTERM)
    out, err = loop.communicate(timeout=60)
    assert "stopping after step" in out
    assert "SIGTERM: finishing this step" in err and "TrainingInterrupted: SIGTERM after step" in err


def test_past_the_grace_period_a_step_is_abandoned_with_exit_143_and_one_line():
    loop = start_loop(grace_s=0.5, step_s=600)  # a step far longer than the grace
    started = time.monotonic()
    loop.send_signal(signal.SIGTERM)
    out, err = loop.communicate(timeout=60)
    assert loop.returncode == 143 and time.monotonic() - started < 30
    assert "stopping after step" not in out
    assert err.strip().splitlines()[-1] == ("stopped at once (trainer.preempt_grace_s=0.5 s passed), abandoning the "
                                            "step in hand: the newest is step 7")


def test_a_second_sigterm_stops_at_once():
    loop = start_loop(grace_s=300, step_s=600)
    loop.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    loop.send_signal(signal.SIGTERM)
    _, err = loop.communicate(timeout=60)
    assert loop.returncode == 143
    assert err.strip().splitlines()[-1].startswith("stopped at once (a second SIGTERM)")


def test_ctrl_c_past_the_grace_period_raises_keyboard_interrupt_in_the_main_thread():
    """An interactive session keeps its interpreter: the stop is an exception, not an exit. It comes
    within the grace period even while the main thread is blocked in C (here a 30 s sleep)."""
    # What was there before (Python's default handler, or SIG_IGN where the test process was
    # started in the background of a non-interactive shell, which ignores SIGINT for it).
    before = signal.getsignal(signal.SIGINT)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match=r"trainer.preempt_grace_s=0.2 s passed.*the newest is step 7"):
        with Preemption(0.2, lambda: "the newest is step 7") as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.requested and stop.signum == signal.SIGINT
            time.sleep(30)  # the step that does not end in time
    assert time.monotonic() - started < 10, "the stop waited for the blocked step to end"
    assert signal.getsignal(signal.SIGINT) == before  # handlers put back


def test_a_stop_after_the_step_carries_the_signals_exit_code_and_the_checkpoint():
    with Preemption(30, lambda: "unused") as stop:
        signal.raise_signal(signal.SIGTERM)
        stopped = stop.stopped(3, 10, saved=None)
    assert isinstance(stopped, TrainingInterrupted) and stopped.exit_code == 143
    assert str(stopped) == "SIGTERM after step 3 of 10; saving its checkpoint failed (see the warning above): unused"

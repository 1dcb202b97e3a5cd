"""The watchdog names the stalled phase and the call it waits on, and ends the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from hybridflow.utils.watchdog import EXIT_STALLED, Watchdog, activity, current_activities, parse_phase_timeouts


def test_check_names_phase_and_call_and_respects_per_phase_limits() -> None:
    dog = Watchdog(default_timeout_s=0.05, phase_timeouts={"gen": 10.0})
    with activity("phase", "step"), activity("phase", "update_actor"), activity("call", "actor rank 1 ActorWorker.update_actor"):
        assert dog.check() is None  # not yet over 0.05 s
        time.sleep(0.08)
        message = dog.check()
    assert message is not None
    assert "phase 'update_actor'" in message and "waiting on actor rank 1 ActorWorker.update_actor" in message
    with activity("phase", "gen"):
        time.sleep(0.08)
        assert dog.check() is None  # gen has its own, longer limit
    with activity("phase", "step"):
        time.sleep(0.08)
        assert dog.check() is None  # the whole step is not watched unless named
    assert current_activities() == []


def test_thread_calls_on_stall_once() -> None:
    stalls: list[str] = []
    with Watchdog(0.05, on_stall=stalls.append, poll_s=0.01), activity("phase", "reward"):
        time.sleep(0.3)
    assert len(stalls) == 1 and "phase 'reward'" in stalls[0]


def test_a_stalled_process_exits_with_the_stall_code_and_a_traceback() -> None:
    script = textwrap.dedent(
        """
        import time
        from hybridflow.utils.watchdog import Watchdog, activity
        with Watchdog(0.2), activity("phase", "gen"), activity("call", "rollout rank 0 RolloutWorker.generate"):
            time.sleep(30)
        """
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_STALLED
    assert time.monotonic() - start < 20
    assert "phase 'gen'" in done.stderr and "rollout rank 0 RolloutWorker.generate" in done.stderr
    assert "time.sleep(30)" in done.stderr or "File" in done.stderr  # the stack dump


def test_parse_phase_timeouts() -> None:
    assert parse_phase_timeouts(["gen=3600", " update_actor = 90.5"]) == {"gen": 3600.0, "update_actor": 90.5}
    for bad in ("gen", "gen=abc", "=5", "gen=-1"):
        with pytest.raises(ValueError, match="<phase>=<seconds>"):
            parse_phase_timeouts([bad])

"""A watchdog that turns a silent hang into a named failure.

The controller marks what it is doing with nested *activities*: the phase of the step
(``PhaseTimer.phase`` opens one per phase) and, inside it, the worker call it is waiting on
(worker groups open one per call: role, rank, method). A daemon thread checks the innermost
phase against its time limit; when a phase overruns, it logs which phase, role, rank and method
the controller is waiting on, dumps every thread's stack to stderr, and exits the process with
``EXIT_STALLED``. A hung NCCL collective or a wedged tool never returns control to Python, so
raising in the main thread would not work: exiting from the watchdog thread is the only
reliable way out. Nothing is lost: checkpoints are written atomically.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)

EXIT_STALLED = 3


@dataclass
class _Activity:
    kind: str  # "phase" or "call"
    label: str
    started: float


# One controller per process; its activities form a stack. A lock keeps the watchdog's reads
# consistent with the main thread's pushes and pops.
_STACK: list[_Activity] = []
_LOCK = threading.Lock()


# Who wants to hear of every finished worker call (the timeline): fn(label, start, end) with
# time.perf_counter() seconds. Empty unless a run's timeline is on.
CallObserver = Callable[[str, float, float], None]
_CALL_OBSERVERS: list[CallObserver] = []


def observe_calls(observer: CallObserver) -> Callable[[], None]:
    """Call ``observer(label, start, end)`` when each "call" activity ends; returns the function
    that stops it. An observer that raises is logged, never the call's problem."""
    with _LOCK:
        _CALL_OBSERVERS.append(observer)

    def stop() -> None:
        with _LOCK:
            if observer in _CALL_OBSERVERS:
                _CALL_OBSERVERS.remove(observer)

    return stop


@contextmanager
def activity(kind: str, label: str) -> Iterator[None]:
    """Mark ``label`` as in progress (``kind`` "phase" is timed by the watchdog, "call" is detail)."""
    entry = _Activity(kind, label, time.monotonic())
    start = time.perf_counter()
    with _LOCK:
        _STACK.append(entry)
    try:
        yield
    finally:
        with _LOCK:
            if entry in _STACK:
                _STACK.remove(entry)
            observers = list(_CALL_OBSERVERS) if kind == "call" else []
        if observers:
            end = time.perf_counter()
            for observer in observers:
                try:
                    observer(label, start, end)
                except Exception:
                    log.warning("call observer failed on %r", label, exc_info=True)


def current_activities() -> list[tuple[str, str, float]]:
    """(kind, label, seconds running) for every open activity, outermost first."""
    now = time.monotonic()
    with _LOCK:
        return [(a.kind, a.label, now - a.started) for a in _STACK]


def parse_phase_timeouts(entries: list[str]) -> dict[str, float]:
    """``["gen=3600", "update_actor=900"]`` -> ``{"gen": 3600.0, ...}``; ValueError naming a bad entry."""
    timeouts: dict[str, float] = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not sep or not name.strip() or not seconds > 0:
            raise ValueError(f"phase timeout {entry!r} must look like <phase>=<seconds>, e.g. gen=3600")
        timeouts[name.strip()] = seconds
    return timeouts


class Watchdog:
    """Checks the innermost open phase against ``phase_timeouts.get(phase, default_timeout_s)``.

    ``default_timeout_s`` None or <= 0 disables the default (phases named in ``phase_timeouts``
    are still watched). The phase called ``step`` wraps a whole step and is only watched when
    named explicitly. ``on_stall(message)`` runs instead of the default exit (for tests).
    """

    def __init__(
        self,
        default_timeout_s: float | None,
        phase_timeouts: dict[str, float] | None = None,
        on_stall: Callable[[str], None] | None = None,
        poll_s: float | None = None,
    ) -> None:
        self.default = default_timeout_s if default_timeout_s and default_timeout_s > 0 else None
        self.timeouts = dict(phase_timeouts or {})
        self.on_stall = on_stall or _exit_stalled
        limits = [t for t in [self.default, *self.timeouts.values()] if t]
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.05, min(limits, default=5.0) / 20))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def limit_for(self, phase: str) -> float | None:
        if phase in self.timeouts:
            return self.timeouts[phase]
        return None if phase == "step" else self.default

    def check(self) -> str | None:
        """A stall message if the innermost phase is over its limit, else None."""
        activities = current_activities()
        phases = [(label, seconds) for kind, label, seconds in activities if kind == "phase"]
        for label, seconds in reversed(phases):
            limit = self.limit_for(label)
            if limit is not None and seconds > limit:
                waiting = [label for kind, label, _ in activities if kind == "call"]
                on = f"; waiting on {waiting[-1]}" if waiting else ""
                return (
                    f"watchdog: phase '{label}' has run {seconds:.0f} s, over its limit of {limit:.0f} s{on}. "
                    f"Open activities: {' > '.join(a[1] for a in activities)}. Raise the limit with "
                    f"trainer.phase_timeouts=[{label}=<seconds>] (or trainer.watchdog_timeout_s) if this is expected"
                )
        return None

    def start(self) -> Watchdog:
        if self.default is None and not self.timeouts:
            return self
        self._thread = threading.Thread(target=self._run, name="hybridflow-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            message = self.check()
            if message is not None:
                self.on_stall(message)
                return


def _exit_stalled(message: str) -> None:
    log.critical(message)
    print(message, file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(EXIT_STALLED)

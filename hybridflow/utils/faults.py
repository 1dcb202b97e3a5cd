"""Deterministic fault injection for tests of crash safety: ``HYBRIDFLOW_FAULT=<point>@<step>``.

Production code calls ``maybe_fault(point, step)`` at the few places where a crash is most
damaging (mid checkpoint write, after a step). With the variable unset it does nothing. Tests set
it to kill the process exactly there (SIGKILL: no cleanup, no atexit, like an OOM kill or a lost
node), or to make a loss non-finite, and then check that nothing was lost. ``<point>@<step>:TERM``
sends SIGTERM instead (a scheduler's preemption arriving exactly there); an entry listed twice
sends its signal twice, in order.
"""

from __future__ import annotations

import os
import signal

ENV = "HYBRIDFLOW_FAULT"


def _entries() -> list[str]:
    spec = os.environ.get(ENV)
    return [entry.strip() for entry in spec.split(",")] if spec else []


def fault_requested(point: str, step: int) -> bool:
    """True when ``HYBRIDFLOW_FAULT`` lists ``point@step`` (comma-separated entries)."""
    return f"{point}@{step}" in _entries()


def maybe_fault(point: str, step: int) -> None:
    """Signal this process (SIGKILL, or the entry's ``:<SIGNAL>``) if ``HYBRIDFLOW_FAULT`` asks for
    ``point@step``, once per matching entry."""
    for entry in _entries():
        where, _, name = entry.partition(":")
        if where == f"{point}@{step}":
            os.kill(os.getpid(), signal.Signals[f"SIG{name or 'KILL'}"])

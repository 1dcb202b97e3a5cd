"""Deterministic fault injection for tests of crash safety: ``HYBRIDFLOW_FAULT=<point>@<step>``.

Production code calls ``maybe_fault(point, step)`` at the few places where a crash is most
damaging (mid checkpoint write, after a step). With the variable unset it does nothing. Tests set
it to kill the process exactly there (SIGKILL: no cleanup, no atexit, like an OOM kill or a lost
node), or to make a loss non-finite, and then check that nothing was lost.
"""

from __future__ import annotations

import os
import signal

ENV = "HYBRIDFLOW_FAULT"


def fault_requested(point: str, step: int) -> bool:
    """True when ``HYBRIDFLOW_FAULT`` lists ``point@step`` (comma-separated entries)."""
    spec = os.environ.get(ENV)
    if not spec:
        return False
    return f"{point}@{step}" in {entry.strip() for entry in spec.split(",")}


def maybe_fault(point: str, step: int) -> None:
    """SIGKILL this process if ``HYBRIDFLOW_FAULT`` asks for ``point@step``."""
    if fault_requested(point, step):
        os.kill(os.getpid(), signal.SIGKILL)

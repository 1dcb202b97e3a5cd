"""Stopping a run on a signal without losing it: SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C).

The first signal asks the loop to stop after the step in hand: the loop finishes the step, saves a
checkpoint and raises ``TrainingInterrupted`` naming it, and the CLI prints that one line and exits
128 + the signal's number (143 for SIGTERM, 130 for SIGINT). Schedulers send SIGTERM, wait a grace
period, then SIGKILL, so ``trainer.preempt_grace_s`` bounds the rest of the step and the save
together: when it passes first, the run stops at once, abandoning the step (its half-updated
weights are never saved), and says which checkpoint the same command will resume from. A second
signal stops at once too.

Stopping at once corrupts nothing: a checkpoint appears by renaming a finished folder (a save cut
short leaves a temporary folder the next start removes), the run folder's records are replaced
whole, and readers of metrics.jsonl skip a torn last line. SIGTERM then ends the process
(``os._exit``, as the signal's default action would, after its line); SIGINT raises
KeyboardInterrupt in the main thread, so an interactive session keeps its interpreter.

Whatever sends the signal gets this stop, never an instant death: a reward function calling
``os.kill(os.getppid(), signal.SIGTERM)`` in its worker process saves the run like a scheduler
does. Only SIGKILL, which no process can catch, ends a run unsaved (the newest checkpoint stands).
Only the main thread can install signal handlers: elsewhere (a notebook's worker thread) both
signals keep their default behaviour.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingInterrupted(KeyboardInterrupt):
    """A signal stopped training between steps (after saving a checkpoint, when it could).
    ``exit_code``: the shell's code for the signal, 128 + its number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Preemption:
    """The loop's view of SIGTERM/SIGINT while it runs (module docstring): ``requested`` after the
    first signal; ``newest`` says where the newest checkpoint is (for a stop that cannot save)."""

    def __init__(self, grace_s: float, newest: Callable[[], str]) -> None:
        self.grace_s = grace_s
        self.newest = newest
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        self._expired = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._handle) for number in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            self._stop_now(signum, self._why() if self._expired else f"a second {signal.Signals(signum).name}")
        self.signum = signum
        name = signal.Signals(signum).name
        log.warning("%s: finishing this step, saving a checkpoint, then stopping (within trainer.preempt_grace_s=%g s; "
                    "a second signal stops at once)", name, self.grace_s)
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        """The grace period passed before the step and its checkpoint were done (the timer's thread)."""
        assert self.signum is not None
        self._expired = True
        if self.signum == signal.SIGINT:
            # A real signal to the main thread, not ``_thread.interrupt_main``: that only sets a flag
            # the interpreter checks between bytecodes, so a step blocked in C (a sleep, a long kernel,
            # a socket read) would run on past the grace period. The signal wakes it; ``_handle`` then
            # raises KeyboardInterrupt there.
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return
        self._stop_now(self.signum, self._why())

    def _why(self) -> str:
        return f"trainer.preempt_grace_s={self.grace_s:g} s passed"

    def _stop_now(self, signum: int, why: str) -> None:
        line = f"stopped at once ({why}), abandoning the step in hand: {self.newest()}"
        if signum == signal.SIGINT and threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt(line)
        print(line, file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def stopped(self, step: int, total_steps: int, saved: Path | None) -> TrainingInterrupted:
        """What the loop raises after saving step ``step`` (``saved``: its checkpoint, None when the
        save failed) on a requested stop."""
        assert self.signum is not None
        where = (f"saved checkpoint {saved}: run the same command again to resume" if saved is not None else
                 f"saving its checkpoint failed (see the warning above): {self.newest()}")
        return TrainingInterrupted(f"{signal.Signals(self.signum).name} after step {step} of {total_steps}; {where}",
                                   128 + self.signum)

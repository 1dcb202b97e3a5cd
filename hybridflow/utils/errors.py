"""Errors raised on both sides of a process boundary, and how to report them on one line.

``CheckpointError`` lives here, at the bottom layer, because two layers raise it: the training
engine (a file it refuses to load) and the controller (a checkpoint that fails verification or
cannot be written). Worker groups wrap a worker's exception in their own error, and Ray wraps it
once more, so ``find_cause`` walks the chain to the error that names the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged, refused by a loader, or could not be written.
    The message is one line and names the file or folder."""


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and everything behind it: ``__cause__``, ``__context__`` and Ray's ``cause``."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for nxt in (current.__cause__, getattr(current, "cause", None), current.__context__):
            if isinstance(nxt, BaseException):
                todo.append(nxt)


def find_cause(exc: BaseException, kind: type[E]) -> E | None:
    """The first exception of type ``kind`` in ``exc``'s chain, or None."""
    return next((e for e in causes(exc) if isinstance(e, kind)), None)


def one_line(exc: BaseException) -> str:
    """The first non-empty line of ``exc``'s message (torch's are pages long), or its type name."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__

"""Phase timing for the ``timing_s/*`` metrics, each phase's peak resident memory
(``perf/rss_peak_gb/*``), and, when given a sink, spans for the timeline.

``SpanSink`` is the one thing a timer needs of a trace recorder (``hybridflow.tracking.timeline``,
one layer up, implements it): every phase that closes is handed over as ``(track, name, start,
end)`` with ``time.perf_counter`` seconds, so the phases already timed become trace spans without
the loop knowing about traces.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from hybridflow.utils.memory import RSS_PEAKS
from hybridflow.utils.threads import adjust_threads
from hybridflow.utils.watchdog import activity


@contextmanager
def profiler_range(name: str) -> Iterator[None]:
    """A named range for torch.profiler traces (``trainer.profile.steps``) and, on a GPU, for
    ``nsys`` (NVTX); microseconds of overhead when nothing records."""
    with torch.profiler.record_function(name):
        if not _nvtx():
            yield
            return
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()


@functools.cache
def _nvtx() -> bool:
    return torch.cuda.is_available()


TIMING_PREFIX = "timing_s/"
# The process's peak resident memory (GB, 1e9 bytes) while a phase ran: on one machine with the local
# backend, every role but the reward scorer's subprocess; with Ray, the controller's process only.
RSS_PEAK_PREFIX = "perf/rss_peak_gb/"


class SpanSink(Protocol):
    """Receives closed spans: ``start`` and ``end`` are ``time.perf_counter()`` seconds."""

    def add(self, track: str, name: str, start: float, end: float, **args: Any) -> None: ...


class PhaseTimer:
    """Accumulates wall time per named phase; ``metrics()`` returns ``timing_s/<phase>`` and
    ``perf/rss_peak_gb/<phase>``, the process's peak resident memory while the phase ran (its
    largest over the step's passes through the phase; ``RSS_PEAKS``; absent off Linux).

    Phases nest one level at most: an outer phase (the step) and disjoint phases inside it, so
    each inner phase is a share of the outer one and the shares add up to at most 100%. A phase
    opened inside an inner one would count the same seconds twice, and is refused.

    With a ``sink`` every closed phase is also a span on ``track`` (the timeline's trainer row).
    """

    def __init__(self, sink: SpanSink | None = None, track: str = "trainer") -> None:
        self._seconds: dict[str, float] = {}
        self._rss_peaks: dict[str, int] = {}
        self._open: list[str] = []
        self._sink, self._track = sink, track

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time ``name``; it is also an open activity that the watchdog holds to its limit."""
        if len(self._open) >= 2:
            raise ValueError(
                f"phase {name!r} opened inside {self._open[-1]!r}, itself inside {self._open[0]!r}: phases inside a "
                f"step must be disjoint, or their shares of the step count the same seconds twice"
            )
        adjust_threads()  # a phase boundary: follow the cores other processes left free (no-op if fixed)
        start = RSS_PEAKS.mark()  # what came before is not this phase's memory
        self._open.append(name)
        try:
            with activity("phase", name), profiler_range(f"phase/{name}"):
                yield
        finally:
            self._open.pop()
            end = time.perf_counter()
            self._seconds[name] = self._seconds.get(name, 0.0) + end - start
            self._note_rss(name, start, end)
            if self._sink is not None:
                self._sink.add(self._track, name, start, end)

    def add(self, name: str, seconds: float, start: float | None = None) -> None:
        """Count ``seconds`` measured elsewhere to phase ``name`` (work whose parts interleave,
        such as scoring between two polls of a streamed generation); the caller keeps the phases
        disjoint. With its ``start`` (``time.perf_counter()``) it is a span on the sink too."""
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds
        if start is not None:
            self._note_rss(name, start, start + seconds)
        if self._sink is not None and start is not None:
            self._sink.add(self._track, name, start, start + seconds)

    def _note_rss(self, name: str, start: float, end: float) -> None:
        peak = RSS_PEAKS.peak_between(start, end)
        if peak is not None:
            self._rss_peaks[name] = max(peak, self._rss_peaks.get(name, 0))

    def seconds(self, name: str) -> float:
        return self._seconds.get(name, 0.0)

    def rss_peak_bytes(self, name: str) -> int | None:
        return self._rss_peaks.get(name)

    def metrics(self) -> dict[str, float]:
        return ({f"{TIMING_PREFIX}{k}": v for k, v in self._seconds.items()}
                | {f"{RSS_PEAK_PREFIX}{k}": v / 1e9 for k, v in self._rss_peaks.items()})

"""Who ran and who waited: a per-step trace of the run, for ui.perfetto.dev or chrome://tracing.

A ``Timeline`` collects *spans* (a track, a name, a start and an end) from any thread and writes
them to ``<run folder>/timeline.json`` in the Chrome trace event format that Perfetto and
chrome://tracing open: ``{"traceEvents": [...]}`` with one complete event (``"ph": "X"``, ``ts``
and ``dur`` in microseconds since the timeline began) per span.

Tracks are rows: ``trainer`` (the controller's phases, fed by ``PhaseTimer``: step, gen, reward,
old_log_prob, ref, adv, update_actor, update_weights, ...; testing and save_checkpoint between
steps), ``rollout replica k`` (the seconds each replica served in a generation round), and, with
``observe_worker_calls``, ``<role> rank <r>`` for every worker-group call (``actor rank 0``:
``compute_logprobs``, ``update``; ``reward rank 0``: ``score``; ``rollout replica 0 rank 0``:
``serve``, ``sleep``, ...): in this process's backend exactly when each ran, on Ray the controller's
wait for it. A track
named ``<role> replica <k>`` or ``<role> rank <k>`` is thread ``k`` of process ``<role>`` in the
trace, so a role's replicas sit together; any other track is a process of its own, thread 0.
Process and thread names are written as metadata events (``"ph": "M"``); the thread name is the
whole track name, which is what ``summarize_timeline`` reads back.

Bounded: the file holds the spans of the last ``keep_steps`` steps (a span named ``step`` on the
``trainer`` track closes a step; spans that end before the oldest kept step began are dropped) and at most
``max_events`` spans (oldest dropped first). It is rewritten atomically (a temporary file renamed
over it) each time a step closes and when the run closes, so a killed run leaves the trace of
every step it finished. A resumed run starts a new trace (perf_counter times of two processes do
not line up); a process that finishes no step (a finished run started again, a failure before the
first step) leaves the file alone.

Cost: ``add`` is a lock and a list append (about a microsecond); writing the file is a JSON dump of
the spans' JSON (each serialized once, when recorded) once per step: about 10 ms for 10,000 spans
on a busy laptop CPU, far below a step of an LLM run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.utils.watchdog import observe_calls

log = logging.getLogger(__name__)

TIMELINE_FILENAME = "timeline.json"
STEP_SPAN, STEP_TRACK = "step", "trainer"
"""A span of this name on this track (PhaseTimer's outer phase) closes a step: the file is written
then, and old steps are dropped."""
KEEP_STEPS = 100
"""Steps kept in the file by default: enough to see a pattern, small enough to open at once."""
MAX_EVENTS = 20_000
"""Spans kept at most, whatever the steps (about 2 MB of JSON; Perfetto opens it in a second)."""

_CALL = re.compile(r"^(?P<role>.+?) rank (?P<ranks>\d+(?:,\d+)*) (?P<method>\S+)$")
_INDEXED = re.compile(r"^(?P<role>.*\S)\s+(?P<kind>replica|rank)\s+(?P<index>\d+)$")


@dataclass
class _Span:
    end: float  # perf_counter seconds, for dropping old steps
    json: str  # the trace event, serialized once when recorded: writing the file is a join


class Timeline:
    """Thread-safe span recorder; ``path`` None keeps the spans in memory only (tests, ``events``).

    ``enabled=False`` makes every method a no-op, so callers need no ``if``.
    """

    def __init__(self, path: str | Path | None = None, *, keep_steps: int = KEEP_STEPS,
                 max_events: int = MAX_EVENTS, enabled: bool = True) -> None:
        if keep_steps < 1 or max_events < 1:
            raise ValueError(f"Timeline keeps at least one step and one event, got {keep_steps=}, {max_events=}")
        self.path = Path(path) if path is not None else None
        self.enabled = enabled
        self.keep_steps, self.max_events = keep_steps, max_events
        self.origin = time.perf_counter()
        self.wall_origin = time.time()
        self._spans: deque[_Span] = deque(maxlen=max_events)
        self._step_starts: deque[float] = deque(maxlen=keep_steps)
        self._threads: dict[str, tuple[int, int]] = {}  # track -> (pid, tid), fixed when first seen
        self._pids: dict[str, int] = {}  # role -> pid
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._write_failed = False
        self._stop_observing: Callable[[], None] | None = None

    @classmethod
    def disabled(cls) -> Timeline:
        return cls(enabled=False)

    # ------------------------------------------------------------------ recording
    def add(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        """Record a span; ``start`` and ``end`` are ``time.perf_counter()`` seconds. A span ``step``
        on ``trainer`` closes a step: older steps beyond ``keep_steps`` are dropped and the file written."""
        if not self.enabled:
            return
        end = max(start, end)
        with self._lock:
            pid, tid = self._thread_of(track)
            event: dict[str, Any] = {"name": name, "ph": "X", "pid": pid, "tid": tid,
                                     "ts": round((start - self.origin) * 1e6, 1), "dur": round((end - start) * 1e6, 1)}
            if args:
                event["args"] = args
            self._spans.append(_Span(end, json.dumps(event, separators=(",", ":"), default=str)))
            closes_step = name == STEP_SPAN and track == STEP_TRACK
            if closes_step:
                self._step_starts.append(start)
                if len(self._step_starts) == self.keep_steps:
                    cutoff = self._step_starts[0]
                    while self._spans and self._spans[0].end < cutoff:
                        self._spans.popleft()
        if closes_step:
            self.flush()

    @contextmanager
    def span(self, track: str, name: str, **args: Any) -> Iterator[None]:
        """Time the block as a span on ``track`` (recorded even when the block raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(track, name, start, time.perf_counter(), **args)

    def observe_worker_calls(self) -> None:
        """Record every worker-group call as a span of its role and rank (``actor rank 0``:
        ``update``), from the labels the worker groups give the watchdog, until ``close``."""
        if self.enabled and self._stop_observing is None:
            self._stop_observing = observe_calls(self.add_call)

    def add_call(self, label: str, start: float, end: float) -> None:
        """``actor rank 0 ActorWorker.update`` -> a span ``update`` on ``actor rank 0``. A Ray wait
        on several calls (``a rank 0,1 M; b rank 0 N``) gives each rank the whole wait: the ranks
        do not report when they finished, so their spans are the most each could have run."""
        for part in label.split("; "):
            m = _CALL.match(part)
            if m is None:
                self.add(part, "call", start, end)
                continue
            method = m["method"].rsplit(".", 1)[-1]
            for rank in m["ranks"].split(","):
                self.add(f"{m['role']} rank {rank}", method, start, end)

    # ------------------------------------------------------------------ output
    def _thread_of(self, track: str) -> tuple[int, int]:
        if track not in self._threads:
            role, tid = _role_and_index(track)
            self._threads[track] = (self._pids.setdefault(role, len(self._pids) + 1), tid)
        return self._threads[track]

    def _metadata(self) -> list[dict[str, Any]]:
        """Process names (roles, in order of appearance) and thread names (whole track names)."""
        out: list[dict[str, Any]] = []
        for role, pid in self._pids.items():
            out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": role}})
            out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for track, (pid, tid) in sorted(self._threads.items(), key=lambda kv: kv[1]):
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
        return out

    def _snapshot(self) -> tuple[list[dict[str, Any]], list[str]]:
        with self._lock:
            return self._metadata(), [s.json for s in self._spans]

    def events(self) -> list[dict[str, Any]]:
        """The trace events: metadata (process and thread names) first, then one ``X`` per span."""
        metadata, spans = self._snapshot()
        return metadata + [json.loads(s) for s in spans]

    def _other_data(self) -> dict[str, Any]:
        return {"generator": "hybridflow", "wall_clock_origin_s": self.wall_origin,
                "keep_steps": self.keep_steps, "max_events": self.max_events}

    def to_json(self) -> dict[str, Any]:
        return {"traceEvents": self.events(), "displayTimeUnit": "ms", "otherData": self._other_data()}

    def flush(self) -> None:
        """Write the file atomically (no-op without a path)."""
        if not self.enabled or self.path is None:
            return
        if not self._step_starts:  # no step ran in this process (a finished run started again, a
            return  # failure before the first step): keep the trace that is there
        metadata, spans = self._snapshot()
        events = [json.dumps(e, separators=(",", ":")) for e in metadata] + spans
        text = ('{"traceEvents":[' + ",".join(events) + '],"displayTimeUnit":"ms","otherData":'
                + json.dumps(self._other_data()) + "}")
        with self._write_lock:  # two threads closing spans at once must not share the temporary file
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            try:
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, self.path)
            except OSError as error:  # a trace is worth a warning, never the run (a full disk, a removed folder)
                if not self._write_failed:
                    log.warning("could not write the timeline %s (%s); training goes on, later failures are not "
                                "reported", self.path, error)
                self._write_failed = True

    def close(self) -> None:
        if self._stop_observing is not None:
            self._stop_observing()
            self._stop_observing = None
        self.flush()


def _role_and_index(track: str) -> tuple[str, int]:
    """``rollout replica 3`` -> (``rollout``, 3); ``trainer`` -> (``trainer``, 0)."""
    m = _INDEXED.match(track)
    return (m["role"], int(m["index"])) if m else (track, 0)


# ---------------------------------------------------------------------- reading a trace back
@dataclass
class TrackSummary:
    track: str
    busy_s: float  # the union of the track's spans within the window
    idle_s: float  # the window minus busy
    phases: dict[str, float] = field(default_factory=dict)  # total seconds per span name (nested spans overlap)

    @property
    def idle_ratio(self) -> float:
        window = self.busy_s + self.idle_s
        return self.idle_s / window if window > 0 else 0.0


@dataclass
class TimelineSummary:
    window_s: float  # from the first span's start to the last span's end, over every track
    steps: int  # spans named ``step``
    tracks: list[TrackSummary]


def read_timeline(path: str | Path) -> list[dict[str, Any]]:
    """The trace events of ``timeline.json`` (or of the one in a run folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / TIMELINE_FILENAME
    data = json.loads(path.read_text(encoding="utf-8"))
    events = data["traceEvents"] if isinstance(data, dict) else data  # both forms of the format
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list")
    return events


def summarize_timeline(events: list[dict[str, Any]]) -> TimelineSummary:
    """Per track: busy seconds (union of its spans), idle seconds and the idle ratio over the
    traced window, and the total seconds of each span name."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    phases: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    steps = 0
    for e in events:
        if e.get("ph") != "X":
            continue
        track = names.get((e["pid"], e["tid"]), f"pid {e['pid']} tid {e['tid']}")
        start, dur = float(e["ts"]) / 1e6, float(e.get("dur", 0.0)) / 1e6
        spans[track].append((start, start + dur))
        phases[track][e["name"]] += dur
        steps += e["name"] == STEP_SPAN and track == STEP_TRACK
    if not spans:
        return TimelineSummary(0.0, 0, [])
    lo = min(s for intervals in spans.values() for s, _ in intervals)
    hi = max(e for intervals in spans.values() for _, e in intervals)
    window = hi - lo
    tracks = []
    for track, intervals in spans.items():
        busy = _union_length(intervals)
        tracks.append(TrackSummary(track, busy, max(0.0, window - busy), dict(phases[track])))
    tracks.sort(key=lambda t: (t.track != "trainer", t.track))  # the controller first, then by role
    return TimelineSummary(window, steps, tracks)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def format_timeline_summary(summary: TimelineSummary) -> str:
    """The table ``hybridflow timeline`` prints."""
    if not summary.tracks:
        return "the timeline holds no spans"
    lines = [f"traced window {summary.window_s:.3f} s, {summary.steps} step(s)", "",
             f"{'track':<24} {'busy s':>10} {'idle s':>10} {'idle':>7}"]
    for t in summary.tracks:
        lines.append(f"{t.track:<24} {t.busy_s:>10.3f} {t.idle_s:>10.3f} {t.idle_ratio:>6.1%}")
    for t in summary.tracks:
        lines += ["", f"{t.track}: seconds per phase"]
        for name, seconds in sorted(t.phases.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {name:<22} {seconds:>10.3f}")
    return "\n".join(lines)

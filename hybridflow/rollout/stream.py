"""A persistent event loop that serves generation requests in the background, with an outbox.

The rollout worker's streaming path (``RolloutWorker.start`` / ``take``) and its blocking one
(``generate``) both run here, so every request of a replica shares one loop and the engine
batches them all continuously, whatever call they came with:

    stream = RequestStream("rollout rank 0")
    stream.start([Job(tag=7, label="'gsm8k-12'", run=lambda: engine.generate(request))])
    finished = stream.take(max_wait_s=0.1)      # [Finished(7, [...], seconds)] or [] after 0.1 s
    results = stream.run_all([lambda: engine.generate(r) for r in requests])   # blocking

The loop runs in a daemon thread of this process, started on first use, so the caller's thread
stays free for other calls while requests run (weight updates, which the engines apply between
two steps; on Ray the actor's thread answers them). ``take`` never blocks longer than asked: a
Ray actor polled with short takes answers a queued ``update_weights`` within that time.

A job that raises surfaces from ``take`` as a ``RequestFailed`` naming the job; the jobs still
running are not affected. ``abort`` cancels everything in flight and drops what was not taken.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hybridflow.types import Trajectory
from hybridflow.utils.aio import all_or_nothing

_T = TypeVar("_T")


@dataclass(frozen=True)
class Job:
    """One request to run: ``run()`` makes its coroutine (called on the loop's thread)."""

    tag: Any  # the caller's name for it, returned with its trajectories
    label: str  # what an error names (the request's id)
    run: Callable[[], Awaitable[list[Trajectory]]]


@dataclass
class Finished:
    """A finished request: its ``n`` trajectories and the seconds since its ``start`` call."""

    tag: Any
    trajectories: list[Trajectory]
    seconds: float


class RequestFailed(RuntimeError):
    """A streamed request raised; the message names it, the cause is its error."""


class RequestStream:
    """Requests served on one persistent event loop in a background thread (module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # notified when a job finishes
        self._outbox: list[tuple[Job, list[Trajectory] | BaseException, float]] = []
        self._tasks: set[asyncio.Task[Any]] = set()  # the streamed jobs in flight (touched on the loop)
        self._in_flight = 0  # streamed jobs started and not yet in the outbox (any thread)

    # ------------------------------------------------------------------ loop
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop, started on first use."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()
                thread = threading.Thread(target=self._run_loop, args=(loop, ready), daemon=True,
                                          name=f"rollout-stream {self.name}")
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
            return self._loop

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            loop.close()

    def _check_caller(self) -> None:
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError(f"{self.name}: a blocking stream call from the stream's own event loop would deadlock")

    def run(self, coroutine: Callable[[], Awaitable[_T]]) -> _T:
        """Run one coroutine (made on the loop) to its end and return its result, from another thread."""
        self._check_caller()

        async def call() -> _T:
            return await coroutine()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result()

    # ------------------------------------------------------------------ blocking
    def run_all(self, jobs: Sequence[Callable[[], Awaitable[_T]]]) -> list[_T]:
        """Every job's result in order, batched with whatever else runs on the loop; the first
        error cancels the others and is raised."""
        if not jobs:
            return []
        return self.run(lambda: all_or_nothing([job() for job in jobs]))

    # ------------------------------------------------------------------ streaming
    def start(self, jobs: Sequence[Job]) -> None:
        """Start ``jobs`` and return at once; they join what is in flight. All of them enter the
        loop in one callback, so an engine sees them arrive together (as ``run_all``'s do)."""
        if not jobs:
            return
        started = time.perf_counter()
        with self._lock:
            self._in_flight += len(jobs)
        self.loop.call_soon_threadsafe(self._launch, list(jobs), started)

    def _launch(self, jobs: list[Job], started: float) -> None:
        for job in jobs:
            task = asyncio.ensure_future(_call(job))
            self._tasks.add(task)
            task.add_done_callback(lambda task, job=job: self._deliver(task, job, started))

    def _deliver(self, task: asyncio.Task[list[Trajectory]], job: Job, started: float) -> None:
        self._tasks.discard(task)
        with self._ready:
            self._in_flight -= 1
            if not task.cancelled():  # an aborted job has nobody waiting for it
                error = task.exception()
                outcome: list[Trajectory] | BaseException = task.result() if error is None else error
                self._outbox.append((job, outcome, time.perf_counter() - started))
            self._ready.notify_all()

    @property
    def in_flight(self) -> int:
        """Streamed jobs started and not yet finished."""
        with self._lock:
            return self._in_flight

    def take(self, max_wait_s: float = 0.0) -> list[Finished]:
        """The streamed jobs finished since the last call (completion order), waiting at most
        ``max_wait_s`` for a first one when none is there and some are in flight. A job that
        raised raises ``RequestFailed`` naming it; the results that finished before it are
        returned by this call's successor, none is lost."""
        self._check_caller()
        with self._ready:
            self._ready.wait_for(lambda: self._outbox or not self._in_flight, timeout=max(0.0, max_wait_s))
            failed = next((i for i, (_, outcome, _) in enumerate(self._outbox)
                           if isinstance(outcome, BaseException)), None)
            if failed is not None:
                job, error, _ = self._outbox[failed]
                del self._outbox[failed]
                raise RequestFailed(f"{self.name}: request {job.label} failed: {error!r}") from error
            items, self._outbox = self._outbox, []
        return [Finished(job.tag, outcome, seconds) for job, outcome, seconds in items]  # type: ignore[arg-type]

    def abort(self) -> int:
        """Cancel every streamed job in flight and drop finished ones not taken; returns how many
        were cancelled or dropped."""
        if self._loop is None:
            return 0
        self._check_caller()

        async def cancel() -> int:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return len(tasks)

        cancelled = self.run(cancel)
        with self._lock:
            dropped, self._outbox = len(self._outbox), []
        return cancelled + dropped

    def close(self, before_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        """Cancel what runs, run ``before_stop`` on the loop (closing a client), stop the thread."""
        if self._loop is None:
            return
        try:
            self.abort()
            if before_stop is not None:
                self.run(before_stop)
        finally:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=10.0)


async def _call(job: Job) -> list[Trajectory]:
    return await job.run()




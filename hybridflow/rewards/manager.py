"""Score a batch of responses in worker processes that reward code cannot take down with it.

Reward code is untrusted: it may raise, hang, return NaN/inf/None/a string/a dict without
``score``, leak memory or call ``os._exit``. ``RewardManager`` turns every such sample into a
0.0 score and a count in the metrics, and the run goes on:

- Scoring runs in ``num_workers`` persistent processes (``worker.py``) started with ``spawn``:
  a fresh interpreter, because the trainer holds torch threads that ``fork`` would copy in a
  broken state. Each worker loads the reward function once.
- The trainer sends chunks of samples (one pipe message per chunk, not per sample) and the
  worker reports each result as soon as it has it, so the trainer always knows which sample is
  running and since when. That sample must finish within ``timeout_s``; if it does not, or the
  worker dies, the trainer kills the worker's whole process group, charges that one sample as
  a timeout/crash, starts a new worker and resends the rest of the chunk from the first
  unscored sample.
- A worker whose memory grows past half its limit retires after its current sample and is
  replaced; its heap is capped so a runaway allocation fails inside the reward, not the host.

This isolates faults, not malice: reward code runs as the trainer's user and could still signal
the trainer or read its files, so rewards that execute model-written code need a real sandbox.
POSIX only (process groups, ``setsid``, rlimits).

Metrics (per ``score`` call): ``reward/error_rate`` (raised or crashed), ``reward/timeout_rate``,
``reward/nonfinite_rate`` (NaN/inf/None/non-numeric/no ``score``), ``reward/worker_restarts``, and
for dict results ``reward/extra/<key>/mean`` over the samples that returned ``<key>``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from hybridflow.rewards import worker as protocol
from hybridflow.rewards.tally import RewardTally
from hybridflow.utils.closing import ClosesOnExit

if TYPE_CHECKING:
    from hybridflow.rewards.sandbox_fusion import SandboxFusionSettings

logger = logging.getLogger(__name__)

# Metric names (verl-style ``area/name``). rewards/ stays free of torch, so it cannot import
# tracking/metrics.py; these constants are the one spelling the rest of the code should use.
METRIC_ERROR_RATE = "reward/error_rate"
METRIC_TIMEOUT_RATE = "reward/timeout_rate"
METRIC_NONFINITE_RATE = "reward/nonfinite_rate"
METRIC_WORKER_RESTARTS = "reward/worker_restarts"
METRIC_EXTRA_MEAN = "reward/extra/{key}/mean"

# verl's reward managers (config reward.reward_manager), as they map here: naive and dapo score per
# sample (dapo's overlong shaping is reward.overlong_buffer, applied by the reward role), batch calls
# the function once per score() with lists, prime scores per sample in a pool of processes.
REWARD_MANAGERS = ("naive", "batch", "dapo", "prime")
# verl's prime manager scores in a pool of 64 processes; here at most that many, one per core.
PRIME_MAX_WORKERS = 64


def scoring_processes(reward_manager: str, num_workers: int) -> int:
    """Scoring processes for ``reward.reward_manager`` and ``reward.num_workers``: prime's pool is at
    least one process per core (up to ``PRIME_MAX_WORKERS``), the others' ``num_workers``."""
    if reward_manager == "prime":
        return max(num_workers, min(PRIME_MAX_WORKERS, os.cpu_count() or 1))
    return num_workers


# Statuses the trainer assigns when it has to give up on a sample (the worker's own are in
# worker.py). A crash counts towards reward/error_rate.
STATUS_TIMEOUT = 3
STATUS_CRASH = 4

_FAILURE_KINDS = {
    protocol.STATUS_ERROR: ("raised", METRIC_ERROR_RATE),
    STATUS_CRASH: ("crashed its worker", METRIC_ERROR_RATE),
    STATUS_TIMEOUT: ("timed out", METRIC_TIMEOUT_RATE),
    protocol.STATUS_NONFINITE: ("returned no finite score", METRIC_NONFINITE_RATE),
}

# Chunking: about four chunks per worker lets a fast worker take over the work of one stuck on
# slow samples; the cap bounds both one pipe message and what is resent after a kill.
_CHUNKS_PER_WORKER = 4
_MAX_CHUNK_SIZE = 256
# Starting a worker imports sympy/math-verify (about 1 s) and the user's module; a minute on a
# loaded machine means it is stuck, not slow.
DEFAULT_STARTUP_TIMEOUT_S = 60.0
# After SIGKILL the kernel reaps in milliseconds; this only bounds a pathological wait.
_JOIN_TIMEOUT_S = 5.0
# How long a worker asked to stop may take before it is killed instead.
_SHUTDOWN_GRACE_S = 1.0
# Enough for sympy and a custom reward that loads a small library; far below a host's RAM.
DEFAULT_MEMORY_LIMIT_MB = 4096
# A slot whose workers are killed by a signal this many times in a row while loading stops the run:
# something kills every import (a memory limit below what it needs), not a one-off.
MAX_LOAD_KILLS = 3


def _signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} (signal {number})"
    except ValueError:
        return f"signal {number}"


@contextlib.contextmanager
def _parent_main_hidden() -> Iterator[None]:
    """Start spawned workers without re-running the parent's ``__main__``.

    ``spawn`` re-runs the parent's ``__main__`` in the child, from ``__main__.__spec__`` (``python
    -m pkg``) or ``__main__.__file__``. A user's script that calls ``api.train`` without an ``if
    __name__ == "__main__":`` guard would then start a second training run inside every worker,
    and a script read on stdin (``python - <<EOF``) has no file at all, so every worker died at
    start. The workers never need the parent's ``__main__`` (their target lives in
    ``hybridflow.rewards.worker`` and custom reward files are loaded by path), so it is hidden
    while a worker starts.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    missing = object()
    saved = {name: getattr(main, name, missing) for name in ("__file__", "__spec__")}
    if "__file__" in vars(main):
        del main.__file__
    main.__spec__ = None
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                vars(main).pop(name, None)
            else:
                setattr(main, name, value)


@dataclass(frozen=True)
class ScoreRequest:
    """One response to score: the row's ``data_source``, the generated text (prompt and EOS
    excluded), the row's ``ground_truth`` and ``extra_info``."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] | None = field(default_factory=dict)


@dataclass
class RewardOutput:
    """Scores aligned with the requests (0.0 for every failed sample), the numeric extras each
    sample's dict result carried, with its text ``pred`` (``{}`` otherwise), and the batch's
    ``reward/*`` metrics."""

    scores: list[float]
    extra: list[dict[str, float | str]]
    metrics: dict[str, float]
    # The same metrics as per-sample values, for a caller that scores a batch in parts.
    tally: RewardTally | None = None


class _State(Enum):
    STARTING = "starting"  # spawned, loading the reward function; deadline = startup deadline
    IDLE = "idle"  # waiting for a chunk
    BUSY = "busy"  # scoring assigned[position]; deadline = that sample's deadline


@dataclass(eq=False)
class _WorkerHandle:
    """The trainer's handle on one worker process."""

    process: BaseProcess
    conn: Connection
    state: _State
    deadline: float
    assigned: list[int] = field(default_factory=list)  # request indices of the current chunk
    position: int = 0  # assigned[position] is the sample being scored
    retiring: bool = False  # sent RECYCLE: it exits after its last result, through no fault
    terminated: bool = False  # killed and reaped; its pid may already belong to someone else
    exitcode: int | None = None  # set when terminated (negative: killed by that signal)
    load_kills: int = 0  # this slot's workers killed by a signal while loading, in a row


@dataclass
class _Round:
    """State of one ``score`` call."""

    payload: list[tuple[str, str, Any, Any]]
    pending: deque[list[int]]
    statuses: list[int | None]
    scores: list[float]
    extra: list[dict[str, float | str]]
    remaining: int
    restarts: int = 0

    def record(
        self, index: int, status: int, score: float, extra: dict[str, float | str], message: str, warned: set[int]
    ) -> None:
        """Sample ``index``'s result; a failure is logged, with a warning once per kind (``warned``: the
        kinds the manager has warned about)."""
        self.statuses[index] = status
        self.scores[index] = score if status == protocol.STATUS_OK else 0.0
        self.extra[index] = extra if status == protocol.STATUS_OK else {}
        self.remaining -= 1
        if status == protocol.STATUS_OK:
            return
        what, metric = _FAILURE_KINDS[status]
        data_source = self.payload[index][0]
        logger.debug("reward sample %d (data_source %r) %s: %s", index, data_source, what, message)
        if status not in warned:
            warned.add(status)
            logger.warning(
                "reward function %s on a sample with data_source %r: %s. Such samples score 0.0 and are "
                "counted in %s; this is logged once per kind of failure.",
                what,
                data_source,
                message,
                metric,
            )

    def tally(self) -> RewardTally:
        """The round's metrics as per-sample values (``RewardTally``): failure rates, restarts,
        and the mean of every numeric extra over the samples that returned it."""
        tally = RewardTally()

        def flags(*statuses: int) -> list[float]:
            return [1.0 if status in statuses else 0.0 for status in self.statuses]

        tally.add(METRIC_ERROR_RATE, "mean", flags(protocol.STATUS_ERROR, STATUS_CRASH))
        tally.add(METRIC_TIMEOUT_RATE, "mean", flags(STATUS_TIMEOUT))
        tally.add(METRIC_NONFINITE_RATE, "mean", flags(protocol.STATUS_NONFINITE))
        tally.add(METRIC_WORKER_RESTARTS, "sum", [float(self.restarts)])
        per_key: dict[str, list[float]] = {}
        for extra in self.extra:
            for key, value in extra.items():
                if isinstance(value, str):  # the answer text: not a number to average
                    continue
                per_key.setdefault(key, []).append(value)
        for key in sorted(per_key):
            tally.add(METRIC_EXTRA_MEAN.format(key=key), "mean", per_key[key])
        return tally


def _chunks(n: int, num_workers: int) -> deque[list[int]]:
    size = max(1, min(_MAX_CHUNK_SIZE, math.ceil(n / (num_workers * _CHUNKS_PER_WORKER))))
    return deque(list(range(start, min(start + size, n))) for start in range(0, n, size))


def _has_exited(process: BaseProcess) -> bool:
    """Whether ``process`` has wholly exited, asked of the kernel without reaping it (``WNOWAIT``:
    its exit code stays for ``_terminate``). Asked directly rather than through its sentinel, which
    only reads as closed once every holder of the pipe is gone (a SIGKILLed worker's other threads
    can take a moment to exit while /proc already shows it as a zombie)."""
    if process.pid is None:
        return False
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped: gone
        return True


def _terminate(worker: _WorkerHandle, graceful: bool) -> None:
    """Stop a worker and everything it spawned, and reap it.

    The process group is killed *before* the worker is reaped: until then its pid (which is also
    its group id) cannot be reused, so ``killpg`` can only reach the worker's own descendants.
    """
    if worker.terminated:
        return
    worker.terminated = True
    process = worker.process
    if graceful and worker.state is _State.IDLE:
        try:
            worker.conn.send_bytes(protocol.SHUTDOWN)
            multiprocessing.connection.wait([process.sentinel], _SHUTDOWN_GRACE_S)
        except OSError:
            pass  # already gone
    if process.pid is not None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # it died before os.setsid(): there is no group of its own to kill
    try:
        process.kill()
    except (OSError, ValueError):
        pass
    process.join(_JOIN_TIMEOUT_S)
    worker.exitcode = process.exitcode
    worker.conn.close()
    if worker.exitcode is not None:
        process.close()  # releases its sentinel fd now rather than at garbage collection


def _terminate_all(workers: list[_WorkerHandle | None]) -> None:
    for slot, worker in enumerate(workers):
        if worker is not None:
            _terminate(worker, graceful=False)
            workers[slot] = None


def _check_arguments(
    custom_path: str | None,
    custom_name: str,
    timeout_s: float,
    num_workers: int,
    memory_limit_mb: int | None,
    startup_timeout_s: float,
    batch: bool,
    reward_kwargs: dict[str, Any] | None,
) -> None:
    """``RewardManager``'s arguments, each error naming the one that is wrong."""
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(
            f"RewardManager timeout_s must be a positive number of seconds, got {timeout_s!r}"
        )
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"RewardManager num_workers must be an integer >= 1, got {num_workers!r}")
    if memory_limit_mb is not None and memory_limit_mb < 64:
        raise ValueError(
            f"RewardManager memory_limit_mb must be >= 64 (a Python worker needs that), "
            f"got {memory_limit_mb}"
        )
    if not (math.isfinite(startup_timeout_s) and startup_timeout_s > 0):
        raise ValueError(f"RewardManager startup_timeout_s must be positive, got {startup_timeout_s!r}")
    if custom_path is not None and not custom_name:
        raise ValueError("RewardManager custom_name must name the function in the custom reward file")
    if custom_path is None and (batch or reward_kwargs):
        raise ValueError("RewardManager: batch scoring and reward_kwargs need a custom reward function (the "
                         "built-in scorers score one sample and take no extra arguments)")


class RewardManager(ClosesOnExit):
    """Scores ``ScoreRequest`` batches in persistent, supervised worker processes.

    Args:
        custom_path: Python file with a custom reward function, or ``None`` for the built-in
            scorers (``registry.DEFAULT_SCORERS``, chosen by ``data_source``).
        custom_name: Function name in ``custom_path``.
        timeout_s: Per-sample deadline; a sample still running after it scores 0.0 and counts
            as a timeout.
        num_workers: Scoring processes.
        memory_limit_mb: Heap cap per worker (``None``: no cap). Allocations beyond it raise
            ``MemoryError`` inside the reward (an error sample); past half of it the worker is
            replaced between samples, which bounds a slow leak.
        startup_timeout_s: How long a worker may take to start and load the reward function.
        batch: Call the reward function once per ``score`` call with lists (verl's batch reward
            manager; ``worker.py``) instead of once per sample. The call runs in one worker with a
            deadline of ``timeout_s`` per sample; a call that fails, crashes or times out fails every
            sample of it.
        reward_kwargs: Extra keyword arguments of every call (``reward.reward_kwargs``; picklable).

    Construction starts the workers and waits until they have loaded the reward function, so a
    missing file, a syntax error (file and line) or a missing function raises here, in the
    trainer, before any rollout. Not thread-safe: one ``score`` call at a time.
    """

    def __init__(
        self,
        custom_path: str | None,
        custom_name: str = "compute_score",
        timeout_s: float = 10.0,
        num_workers: int = 1,
        *,
        memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        batch: bool = False,
        reward_kwargs: dict[str, Any] | None = None,
        sandbox_fusion: SandboxFusionSettings | None = None,
    ) -> None:
        _check_arguments(custom_path, custom_name, timeout_s, num_workers, memory_limit_mb, startup_timeout_s, batch,
                         reward_kwargs)
        # Absolute now: a worker restarted later must find the file even if the trainer chdir'd.
        self._custom_path = None if custom_path is None else os.path.abspath(os.path.expanduser(custom_path))
        self._custom_name = custom_name
        self._batch = batch
        self._reward_kwargs = dict(reward_kwargs or {})
        # Imported here, not at the top: a manager for a custom reward never needs the built-in
        # scorers, and they pull sympy into the trainer.
        # A SandboxFusion service (built-in scoring only, as in verl): its request slots are files in
        # a directory of this manager's, shared by its workers (sandbox_fusion.py says why files).
        self._slots_dir: tempfile.TemporaryDirectory[str] | None = None
        if sandbox_fusion is not None and custom_path is None:
            self._slots_dir = tempfile.TemporaryDirectory(prefix="hybridflow-sandbox-fusion-")
            sandbox_fusion = dataclasses.replace(sandbox_fusion, slots_dir=self._slots_dir.name)
        else:
            sandbox_fusion = None
        self._sandbox_fusion = sandbox_fusion
        if custom_path is None:
            from hybridflow.rewards.registry import scorers_for

            self._builtin_sources: frozenset[str] | None = frozenset(scorers_for(sandbox_fusion))
        else:
            self._builtin_sources = None
        self._timeout_s = float(timeout_s)
        self._memory_limit_mb = memory_limit_mb
        self._startup_timeout_s = float(startup_timeout_s)
        self._context = multiprocessing.get_context("spawn")
        self._warned: set[int] = set()
        self._closed = False
        self._workers: list[_WorkerHandle | None] = [None] * num_workers
        # Kill the workers if the manager is dropped without close(); at interpreter exit the
        # module's atexit hook does it (see _close_live_managers for why not this finalizer).
        self._finalizer = weakref.finalize(self, _terminate_all, self._workers)
        self._finalizer.atexit = False
        _LIVE_MANAGERS.add(self)
        try:
            self._ensure_workers()
            while any(worker.state is _State.STARTING for worker in self._live_workers()):
                self._poll(None)
        except BaseException:
            self.close()
            raise

    # -- public API ---------------------------------------------------------------------------

    def score(self, requests: list[ScoreRequest]) -> RewardOutput:
        """Score every request; never raises because of what the reward code does.

        Raises:
            UnknownDataSourceError: (a ``KeyError``) built-in scoring and a ``data_source``
                without a scorer: a data or config bug, reported before anything runs.
            TypeError: a request is not a ``ScoreRequest`` or cannot be pickled.
            RuntimeError: the manager is closed, or a replacement worker failed to start.
        """
        if self._closed:
            raise RuntimeError("RewardManager.score() called after close()")
        for index, request in enumerate(requests):
            if not isinstance(request, ScoreRequest):
                raise TypeError(
                    f"RewardManager.score: request {index} is a {type(request).__name__}, not a ScoreRequest"
                )
        if self._builtin_sources is not None:
            unknown = sorted({request.data_source for request in requests} - self._builtin_sources)
            if unknown:
                from hybridflow.rewards.registry import UnknownDataSourceError, unknown_data_source_message

                raise UnknownDataSourceError(unknown_data_source_message(unknown))
        n = len(requests)
        round_ = _Round(
            payload=[(r.data_source, r.solution_str, r.ground_truth, r.extra_info) for r in requests],
            pending=(deque([list(range(n))]) if n else deque()) if self._batch else _chunks(n, len(self._workers)),
            statuses=[None] * n,
            scores=[0.0] * n,
            extra=[{} for _ in range(n)],
            remaining=n,
        )
        try:
            self._ensure_workers(round_)
            while round_.remaining:
                self._dispatch(round_)
                self._poll(round_)
        except BaseException:
            # Workers still busy with this round would answer the next one with stale results.
            self._abort_round()
            raise
        tally = round_.tally()
        return RewardOutput(scores=round_.scores, extra=round_.extra, metrics=_rates_of_empty(tally.metrics()),
                            tally=tally)

    def close(self) -> None:
        """Stop the workers (idempotent). Idle workers get a moment to exit; others are killed."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _LIVE_MANAGERS.discard(self)
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                _terminate(worker, graceful=True)
                self._workers[slot] = None
        if self._slots_dir is not None:
            self._slots_dir.cleanup()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for diagnostics and tests)."""
        return [worker.process.pid for worker in self._live_workers() if worker.process.pid is not None]

    # -- worker lifecycle ---------------------------------------------------------------------

    def _live_workers(self) -> list[_WorkerHandle]:
        return [worker for worker in self._workers if worker is not None]

    def _ensure_workers(self, round_: _Round | None = None) -> None:
        for slot, worker in enumerate(self._workers):
            if worker is None:
                self._workers[slot] = self._start_worker(slot)
            elif self._died_holding_nothing(worker, round_):
                # Died between rounds (the OOM killer, a stray kill): it held no sample, so it is
                # replaced before this round rather than charged with the first sample sent to it.
                self._replace(worker, round_)

    def _died_holding_nothing(self, worker: _WorkerHandle, round_: _Round | None) -> bool:
        """Exited while idle, or after it loaded: its READY may still be unread in the pipe (the
        handle then says STARTING), so that is read first. A worker that died loading stays
        STARTING and is left for ``_poll`` to report as a load failure."""
        if worker.state is _State.BUSY or not _has_exited(worker.process):
            return False
        if worker.state is _State.STARTING:
            self._drain(worker, round_)
        return worker.state is _State.IDLE

    def _start_worker(self, slot: int) -> _WorkerHandle:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=protocol.run_worker,
            args=(
                child_conn,
                self._custom_path,
                self._custom_name,
                os.getpid(),
                threading.current_thread() is threading.main_thread(),
                self._memory_limit_mb,
                self._batch,
                self._reward_kwargs,
                self._sandbox_fusion,
            ),
            name=f"hybridflow-reward-worker-{slot}",
        )
        with _parent_main_hidden():
            process.start()
        child_conn.close()  # only the child holds its end now, so its exit reads as EOF here
        startup_deadline = time.monotonic() + self._startup_timeout_s
        return _WorkerHandle(process, parent_conn, _State.STARTING, startup_deadline)

    def _replace(self, worker: _WorkerHandle, round_: _Round | None, load_kills: int = 0) -> None:
        """Kill ``worker`` (if still running) and start a fresh one in its slot."""
        slot = self._workers.index(worker)
        _terminate(worker, graceful=False)
        self._workers[slot] = replacement = self._start_worker(slot)
        replacement.load_kills = load_kills
        if round_ is not None:
            round_.restarts += 1

    def _abort_round(self) -> None:
        for slot, worker in enumerate(self._workers):
            if worker is not None and worker.state is not _State.IDLE:
                _terminate(worker, graceful=False)
                self._workers[slot] = None  # restarted lazily by the next score()

    def _describe_function(self) -> str:
        if self._custom_path is None:
            return "the built-in scorers"
        return f"{'batch reward function ' if self._batch else ''}{self._custom_name} from {self._custom_path}"

    # -- the scoring loop ---------------------------------------------------------------------

    def _dispatch(self, round_: _Round) -> None:
        """Hand the next pending chunk to every idle worker."""
        for worker in self._live_workers():
            if not round_.pending:
                return
            if worker.state is not _State.IDLE or worker.retiring:
                continue
            chunk = round_.pending.popleft()
            data = self._pickle_chunk(round_, chunk)
            worker.state, worker.assigned, worker.position = _State.BUSY, chunk, 0
            try:
                worker.conn.send_bytes(data)
            except OSError:
                # It died between chunks or while reading this one. Charging the chunk's first
                # sample keeps the loop making progress even if every new worker dies here.
                self._on_crash(worker, round_, "while receiving samples")
                continue
            # A batch call answers for its whole chunk at once: it gets the chunk's time.
            worker.deadline = time.monotonic() + self._timeout_s * (len(chunk) if self._batch else 1)

    def _pickle_chunk(self, round_: _Round, chunk: list[int]) -> bytes:
        try:
            return pickle.dumps([round_.payload[i] for i in chunk], protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            for index in chunk:
                try:
                    pickle.dumps(round_.payload[index], protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as item_error:
                    raise TypeError(
                        f"ScoreRequest {index} (data_source {round_.payload[index][0]!r}) cannot be sent to "
                        f"the reward worker: {type(item_error).__name__}: {item_error}"
                    ) from item_error
            raise TypeError(f"reward requests cannot be pickled: {error}") from error

    def _poll(self, round_: _Round | None) -> None:
        """Wait for messages or the nearest deadline, then settle every worker that needs it."""
        active = [w for w in self._live_workers() if w.state is not _State.IDLE or w.retiring]
        if not active:
            raise RuntimeError("RewardManager: samples remain but no worker is running (internal error)")
        timeout = max(0.0, min(worker.deadline for worker in active) - time.monotonic())
        ready = multiprocessing.connection.wait(
            [worker.conn for worker in active] + [worker.process.sentinel for worker in active], timeout
        )
        ready_set = set(ready)
        for worker in active:
            # Read what it sent before judging it: a result that arrived in time counts.
            ended = self._drain(worker, round_)
            if ended or worker.process.sentinel in ready_set:
                self._on_exit(worker, round_)
            elif time.monotonic() >= worker.deadline:
                self._on_deadline(worker, round_)

    def _drain(self, worker: _WorkerHandle, round_: _Round | None) -> bool:
        """Handle every message waiting from ``worker``; ``True`` once its pipe has closed."""
        while True:
            try:
                if not worker.conn.poll():
                    return False
                message = worker.conn.recv()
            except (EOFError, OSError):
                return True
            kind = message[0]
            if kind == protocol.RESULT:
                self._on_result(worker, round_, *message[1:])
            elif kind == protocol.READY:
                worker.state = _State.IDLE
            elif kind == protocol.RECYCLE:
                worker.retiring = True
            elif kind == protocol.LOAD_ERROR:
                raise message[1]  # the loader's own error: file, line, what is missing
            else:
                raise RuntimeError(f"reward worker sent an unknown message {kind!r} (internal error)")

    def _on_result(
        self,
        worker: _WorkerHandle,
        round_: _Round | None,
        status: int,
        score: float,
        extra: dict[str, float | str],
        message: str,
    ) -> None:
        if round_ is None or worker.state is not _State.BUSY:
            raise RuntimeError("reward worker sent a result it was not asked for (internal error)")
        round_.record(worker.assigned[worker.position], status, score, extra, message, self._warned)
        worker.position += 1
        worker.deadline = time.monotonic() + self._timeout_s
        if worker.position == len(worker.assigned):
            worker.state, worker.assigned, worker.position = _State.IDLE, [], 0

    def _on_exit(self, worker: _WorkerHandle, round_: _Round | None) -> None:
        if worker.state is _State.STARTING:
            self._on_load_exit(worker, round_)
            return
        if worker.state is _State.BUSY and not worker.retiring:
            self._on_crash(worker, round_, "while scoring")
            return
        if worker.state is _State.BUSY:  # retired mid-chunk: the rest goes back to the queue
            assert round_ is not None
            round_.pending.appendleft(worker.assigned[worker.position :])
        self._replace(worker, round_)

    def _on_load_exit(self, worker: _WorkerHandle, round_: _Round | None) -> None:
        """A worker ended before it finished loading. An exit code is the reward file's doing (it
        calls exit() on import): loading again would do the same, so the run stops naming it. A
        signal usually comes from outside (the out-of-memory killer, an operator, a chaos test):
        the slot starts a fresh worker, up to MAX_LOAD_KILLS times in a row."""
        multiprocessing.connection.wait([worker.process.sentinel], _SHUTDOWN_GRACE_S)
        pid = worker.process.pid
        _terminate(worker, graceful=False)
        code = worker.exitcode
        what = self._describe_function()
        if code is None or code >= 0:
            raise RuntimeError(f"reward worker exited with code {code} while loading {what} "
                               "(a custom file that calls exit() on import?)")
        signame = _signal_name(-code)
        if worker.load_kills + 1 >= MAX_LOAD_KILLS:
            raise RuntimeError(
                f"reward worker was killed by {signame} while loading {what}, {MAX_LOAD_KILLS} times in a row "
                "(the out-of-memory killer? reward.memory_limit_mb too low for its imports?)")
        logger.warning("reward worker (pid %s) was killed by %s while loading %s; starting another",
                    pid, signame, what)
        self._replace(worker, round_, load_kills=worker.load_kills + 1)

    def _on_deadline(self, worker: _WorkerHandle, round_: _Round | None) -> None:
        if worker.state is _State.STARTING:
            _terminate(worker, graceful=False)
            raise TimeoutError(
                f"reward worker did not finish loading {self._describe_function()} "
                f"within startup_timeout_s={self._startup_timeout_s:g}"
            )
        if worker.retiring:  # it said it would exit and has not yet: no sample of ours is running
            self._on_exit(worker, round_)
        else:
            message = f"still running after timeout_s={self._timeout_s:g}; worker killed"
            self._give_up(worker, round_, STATUS_TIMEOUT, message)

    def _on_crash(self, worker: _WorkerHandle, round_: _Round | None, when: str) -> None:
        # Give a dying worker a moment to finish exiting, so its own exit code is the one reported.
        multiprocessing.connection.wait([worker.process.sentinel], _SHUTDOWN_GRACE_S)
        pid = worker.process.pid
        _terminate(worker, graceful=False)
        code = worker.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        self._give_up(worker, round_, STATUS_CRASH, f"reward worker (pid {pid}) {how} {when}")

    def _give_up(self, worker: _WorkerHandle, round_: _Round | None, status: int, message: str) -> None:
        """Charge the running sample with ``status``, requeue the rest of the chunk, replace the worker.
        In batch mode the rest was in the same failed call: it is charged too, not run again."""
        assert round_ is not None and worker.state is _State.BUSY
        round_.record(worker.assigned[worker.position], status, 0.0, {}, message, self._warned)
        rest = worker.assigned[worker.position + 1 :]
        if rest and self._batch:
            for index in rest:
                round_.record(index, status, 0.0, {}, message, self._warned)
        elif rest:
            round_.pending.appendleft(rest)
        self._replace(worker, round_)


def _rates_of_empty(metrics: dict[str, float]) -> dict[str, float]:
    """An empty round reports rates of 0 (as it always has), not no rates."""
    for key in (METRIC_ERROR_RATE, METRIC_TIMEOUT_RATE, METRIC_NONFINITE_RATE):
        metrics.setdefault(key, 0.0)
    return metrics


# Managers not yet closed. At interpreter exit multiprocessing joins every non-daemon child it
# started, which would wait forever on a worker blocked in a reward. atexit runs hooks in
# reverse order of registration, and this one is registered after multiprocessing's (imported
# above), so the workers are killed first. (Workers are not daemons because daemonic processes
# may not start children, and reward code is allowed to.)
_LIVE_MANAGERS: weakref.WeakSet[RewardManager] = weakref.WeakSet()


def _close_live_managers() -> None:
    for manager in list(_LIVE_MANAGERS):
        manager.close()


atexit.register(_close_live_managers)

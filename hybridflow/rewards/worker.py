"""The scoring worker: the child-process half of ``RewardManager`` (``manager.py``).

A worker is a fresh interpreter (``spawn``) that loads the reward function once and then
serves chunks of samples sent by the trainer, one message back per sample as soon as it is
scored. Reward code is untrusted, so everything it returns is turned here into plain data
(a status code, a float, a dict of floats, a message) before it crosses the pipe: the trainer
never unpickles an object the reward code made, and a hostile ``__float__`` or ``__repr__``
runs in this process, under the trainer's per-sample deadline.

The worker leads its own process group, so the trainer can kill it together with anything it
spawned, and it dies with the trainer, so a hung reward never outlives the run.

Protocol (over one duplex ``multiprocessing`` pipe):

- worker -> trainer: ``(READY,)`` once loaded, or ``(LOAD_ERROR, exception)`` and exit;
  then per sample ``(RESULT, status, score, extra, message)``; ``(RECYCLE,)`` just before a
  voluntary exit (memory grew too much), after the result of the sample that caused it.
- trainer -> worker: a pickled list of ``(data_source, solution_str, ground_truth, extra_info)``
  (``send_bytes``), or ``b""`` to stop.

Per sample (``batch=False``) the function is called once per request; in batch mode
(``reward.reward_manager=batch``, verl's ``BatchRewardManager``) once per chunk, with lists
(``data_sources``, ``solution_strs``, ``ground_truths``, ``extra_infos``), and must return one result
per request. Either way ``reward_kwargs`` are passed as extra keyword arguments, as verl does.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import os
import pickle
import reprlib
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

# Message kinds (worker -> trainer).
READY = "ready"
LOAD_ERROR = "load_error"
RESULT = "result"
RECYCLE = "recycle"

# Per-sample status codes, sent as plain ints. The trainer adds its own codes for samples
# it had to give up on (see manager.py).
STATUS_OK = 0
STATUS_ERROR = 1  # the reward function raised
STATUS_NONFINITE = 2  # it returned NaN/inf/None/a non-number/a dict without a numeric "score"

SHUTDOWN = b""

Outcome = tuple[int, float, dict[str, float | str], str]  # (status, score, extra, message)

PRED_KEY = "pred"
"""The one text extra kept: the answer the reward function extracted (verl's key), which validation
votes on for maj@k and the generation dumps show."""
PRED_MAX_CHARS = 200
"""An answer longer than this is cut: it crosses a pipe per sample and is compared as a whole, and
a real extracted answer (a number, a boxed expression) is far shorter."""

# Messages are for a log line: long enough for a traceback's last frame, short enough that a
# hostile 1 GB exception text cannot flood the pipe or the log.
_MAX_MESSAGE_CHARS = 1000
# Leak guard: once the worker's peak RSS passes this fraction of its memory limit, it finishes
# the sample, reports it and exits so the trainer starts a fresh one, long before allocations
# start failing at the hard limit.
_RECYCLE_RSS_FRACTION = 0.5
# How often the orphan watchdog looks for a dead trainer.
_PARENT_POLL_S = 1.0
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

_repr = reprlib.Repr()
_repr.maxstring = 80
_repr.maxother = 80


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[: _MAX_MESSAGE_CHARS - 3] + "..."


def _describe(value: Any) -> str:
    """A short repr of whatever the reward returned; never raises."""
    try:
        return _repr.repr(value)
    except BaseException:  # a hostile __repr__; the type name is enough
        return f"<{type(value).__name__} with a failing repr>"


def _describe_exception(error: BaseException) -> str:
    """``"ValueError: bad (at reward.py:12 in compute_score)"``; never raises."""
    try:
        text = f"{type(error).__name__}: {error}"
    except BaseException:
        text = f"{type(error).__name__}: <message unavailable>"
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return _clip(text)


def _as_real(value: Any) -> float | None:
    """``value`` as a float if it is a real number (bool, int, float, numpy or 0-d torch scalar).

    Strings are not numbers here even when they look like one: a reward that returns "1" is a
    bug worth surfacing, not a score.
    """
    if isinstance(value, (str, bytes, bytearray)):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(type(value), "__float__"):
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            return None  # e.g. a tensor with more than one element
    return None


MAX_ABS_SCORE = 1e18
"""The largest score magnitude accepted. Scores train in float32, where 1e308 is inf; and the
group statistics square them (a variance of 1e20-sized scores overflows float32's 3.4e38). A
finite float64 beyond this is garbage from the reward code: counted and scored 0, like NaN."""


def _usable(score: float | None) -> bool:
    return score is not None and math.isfinite(score) and abs(score) <= MAX_ABS_SCORE


def classify(value: Any) -> Outcome:
    """Turn a reward function's return value into ``(status, score, extra, message)``.

    A usable result is a finite real number, or a dict whose ``"score"`` is one; the dict's other
    finite real values (``bool`` included, so ``acc`` counts) become ``extra``, and so does a text
    ``pred`` (the extracted answer, at most ``PRED_MAX_CHARS``). Other non-numeric extras are
    dropped: only numbers can be averaged into metrics.
    """
    if isinstance(value, dict):
        if "score" not in value:
            keys = _describe(list(value))
            return STATUS_NONFINITE, 0.0, {}, f"returned a dict without 'score' (keys: {keys})"
        score = _as_real(value["score"])
        if not _usable(score):
            return STATUS_NONFINITE, 0.0, {}, f"returned score {_describe(value['score'])}{_range_note(score)}"
        extra: dict[str, float | str] = {}
        for key, item in value.items():
            if key == "score" or not isinstance(key, str):
                continue
            if key == PRED_KEY and isinstance(item, str):
                extra[key] = item[:PRED_MAX_CHARS]
                continue
            number = _as_real(item)
            if _usable(number):
                extra[key] = number
        return STATUS_OK, score, extra, ""
    score = _as_real(value)
    if not _usable(score):
        return STATUS_NONFINITE, 0.0, {}, f"returned {_describe(value)}{_range_note(score)}"
    return STATUS_OK, score, {}, ""


def _range_note(score: float | None) -> str:
    if score is not None and math.isfinite(score):
        return f" (beyond the usable range ±{MAX_ABS_SCORE:g}: it would overflow float32 training)"
    return ""


def _score_one(fn: Callable[..., Any], request: tuple[str, str, Any, Any],
               reward_kwargs: dict[str, Any] | None = None) -> Outcome:
    data_source, solution_str, ground_truth, extra_info = request
    try:
        value = fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
            **(reward_kwargs or {}),
        )
        outcome = classify(value)
        # Drop the reward's object here, so a slow or hanging __del__ is charged to this sample.
        del value
        return outcome
    except BaseException as error:  # SystemExit and MemoryError included: the sample failed, not the worker
        return STATUS_ERROR, 0.0, {}, _describe_exception(error)


def _score_batch(fn: Callable[..., Any], requests: list[tuple[str, str, Any, Any]],
                 reward_kwargs: dict[str, Any] | None = None) -> list[Outcome]:
    """One call of a batch reward function for ``requests``: each result classified as ``_score_one``'s;
    a call that raises, or returns anything but one result per request, fails every request."""
    try:
        values = fn(
            data_sources=[r[0] for r in requests],
            solution_strs=[r[1] for r in requests],
            ground_truths=[r[2] for r in requests],
            extra_infos=[r[3] for r in requests],
            **(reward_kwargs or {}),
        )
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or len(values) != len(requests):
            got = f"{len(values)} results" if hasattr(values, "__len__") else _describe(values)
            message = f"batch reward function returned {got} for {len(requests)} requests (one result each expected)"
            return [(STATUS_ERROR, 0.0, {}, message)] * len(requests)
        return [classify(value) for value in values]
    except BaseException as error:  # as in _score_one: the samples failed, not the worker
        return [(STATUS_ERROR, 0.0, {}, _describe_exception(error))] * len(requests)


def _rss_bytes() -> int:
    """This worker's resident memory now (Linux: /proc), else its peak (ru_maxrss).

    On Linux ru_maxrss survives fork+exec, so a worker spawned by a large trainer would start
    "over budget" and retire after every sample; the current resident size has no such carry-over.
    """
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def _limit_memory(memory_limit_mb: int | None) -> int | None:
    """Cap the heap (RLIMIT_DATA: anonymous and heap memory, not mapped libraries) so a runaway
    allocation raises ``MemoryError`` in the reward instead of waking the host's OOM killer.
    Returns the limit in bytes, or ``None`` when there is none."""
    if memory_limit_mb is None:
        return None
    limit = memory_limit_mb * 1024 * 1024
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    except (ValueError, OSError):
        return None  # a platform that will not set it: run uncapped rather than not at all
    return limit


def _die_with_parent(parent_pid: int, started_from_main_thread: bool) -> None:
    """Make sure a worker never outlives the trainer.

    On Linux the kernel kills us when the trainer dies (``PR_SET_PDEATHSIG``); that even covers
    a reward stuck in C code holding the GIL. The signal fires when the *thread* that started us
    exits, so it is only armed for workers started from the main thread. A watchdog thread
    covers the rest (and other platforms): once the trainer is gone it kills our whole group.
    """
    if sys.platform.startswith("linux") and started_from_main_thread:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass  # no prctl: the watchdog below still works
    if os.getppid() != parent_pid:  # the trainer died before we got here
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="hybridflow-reward-orphan-watchdog", daemon=True).start()


def _load_function(custom_path: str | None, custom_name: str, batch: bool = False,
                   reward_kwargs: dict[str, Any] | None = None, sandbox_fusion: Any = None) -> Callable[..., Any]:
    if custom_path is None:
        import functools

        from hybridflow.rewards.registry import default_compute_score

        # sandbox_fusion (a SandboxFusionSettings or None) adds the sources that service scores.
        return functools.partial(default_compute_score, sandbox_fusion=sandbox_fusion) if sandbox_fusion \
            else default_compute_score
    from hybridflow.rewards.custom import load_reward_function

    return load_reward_function(custom_path, custom_name, batch=batch, extra_keywords=tuple(reward_kwargs or ()))


def run_worker(
    conn: Connection,
    custom_path: str | None,
    custom_name: str,
    parent_pid: int,
    started_from_main_thread: bool,
    memory_limit_mb: int | None,
    batch: bool = False,
    reward_kwargs: dict[str, Any] | None = None,
    sandbox_fusion: Any = None,
) -> None:
    """Entry point of a worker process (the ``target`` the manager spawns)."""
    os.setsid()  # lead a new session and process group: the trainer kills the whole group
    # SIGTERM sent to every process of a job (Slurm's scancel, a container runtime) is the trainer's
    # to handle: it finishes the step, which needs this worker's scores, saves and then stops us
    # (SIGKILL, or its death: below). Dying here would fail the step the trainer is saving.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(parent_pid, started_from_main_thread)
    memory_limit = _limit_memory(memory_limit_mb)
    try:
        fn = _load_function(custom_path, custom_name, batch, reward_kwargs, sandbox_fusion)
    except BaseException as error:
        try:
            conn.send((LOAD_ERROR, error))
        except Exception:  # an exception that will not pickle: send its text instead
            conn.send((LOAD_ERROR, RuntimeError(_describe_exception(error))))
        return
    conn.send((READY,))
    recycle_at = None if memory_limit is None else int(memory_limit * _RECYCLE_RSS_FRACTION)
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:  # the trainer closed the pipe
            return
        if payload == SHUTDOWN:
            return
        requests = pickle.loads(payload)
        # Batch mode scores the chunk in one call, then reports it sample by sample as per-sample mode
        # does; it retires only after the chunk's last result (the rest is already scored).
        outcomes = _score_batch(fn, requests, reward_kwargs) if batch else None
        for index, request in enumerate(requests):
            outcome = outcomes[index] if outcomes is not None else _score_one(fn, request, reward_kwargs)
            status, score, extra, message = outcome
            conn.send((RESULT, status, score, extra, message))
            if outcomes is not None and index < len(requests) - 1:
                continue
            out_of_memory = status == STATUS_ERROR and message.startswith("MemoryError")
            if out_of_memory or (recycle_at is not None and _rss_bytes() > recycle_at):
                # The heap may be fragmented or leaking; a fresh process is cheaper than doubt.
                conn.send((RECYCLE,))
                return

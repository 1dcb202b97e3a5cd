"""Code rewards scored by a SandboxFusion service (https://github.com/bytedance/SandboxFusion).

Selected by ``reward.sandbox_fusion.url`` (verl's ``reward_model.sandbox_fusion.url``) for the data
sources verl sends there: ``codecontests``, ``apps``, ``codeforces`` and ``taco``. hybridflow's own
code reward (``code.py``, data source ``hybridflow/code``, the local sandbox) stays as it is.

Per test case the response's code is POSTed to the service's ``run_code`` endpoint (the url as
given) as ``{"code", "stdin", "language": "python", "compile_timeout", "run_timeout",
"memory_limit_MB", "files": {}, "fetch_files": []}``; the service answers
``{"status": "Success" | "Failed" | "SandboxError", "compile_result", "run_result": {"status":
"Finished" | "TimeLimitExceeded" | "Error", "stdout", "return_code", ...}}``.

What the row holds (``ground_truth``: JSON text or the parsed dict), as verl reads it:

- ``{"inputs": [...], "outputs": [...]}``: each input on stdin; the case passes when stdout, trailing
  newlines dropped, equals ``str(output)`` likewise;
- plus ``"fn_name"``: each input is the function's arguments, one JSON value per line; the program
  calls ``fn_name`` (a top-level function, or a method of ``Solution()``) and prints the result
  (JSON for dicts, lists, tuples, None and bools, ``str`` otherwise);
- ``{"assert_case": [...]}``: each case is the code followed by that assert program; it passes when
  it runs to the end (no stdin, no expected output).

Score (verl's ``continuous`` mode for these sources): the fraction of the first ``SCORED_CASES``
cases that pass. Only those cases are sent: the rest could not change the score. A response with
no fenced code block scores 0, as in verl. A compile error in one case fails the cases after it
(verl's rule: they would be the same program).

Failures of the service are not the policy's: a request that times out, an HTTP error, a reply
that is not the JSON above, ``SandboxError``: the sample raises ``SandboxFusionError``, which the
reward manager counts in ``reward/error_rate`` and scores 0, and the run goes on. A 504 (the
gateway's timeout) is retried, as verl does, within the sample's deadline.

Concurrency: at most ``max_concurrent`` requests are in flight across all scoring processes of the
run. Each request holds one of ``max_concurrent`` slot files under ``slots_dir`` with ``flock``: a
lock the kernel drops when its holder dies, so a worker the manager kills mid-request (its
timeout) gives its slot back, which a shared semaphore would not.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import http.client
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
# verl scores these sources by the first ten cases (continuous=True in its default_compute_score).
SCORED_CASES = 10
# verl's allowance for the service itself on top of compile and run time, per request.
API_MARGIN_S = 10.0
# The sample gives up this fraction into reward.timeout_s, so a slow service is reported by this
# module (an error) instead of the manager killing and restarting the scoring process (a timeout).
DEADLINE_FRACTION = 0.9
# verl retries a 504 three times, waiting 1 s then 2 s.
MAX_ATTEMPTS = 3
RETRY_DELAY_S = 1.0
# How often a request waiting for a free slot looks again.
SLOT_POLL_S = 0.01
MAX_ERROR_BODY_CHARS = 200

_PASSED, _FAILED, _COMPILE_ERROR = "passed", "failed", "compile_error"


class SandboxFusionError(RuntimeError):
    """The service did not give a usable answer (unreachable, timed out, an HTTP error, a reply that
    is not SandboxFusion's JSON, its own SandboxError)."""


@dataclass(frozen=True)
class SandboxFusionSettings:
    """What the scorer needs; plain data, so it crosses to the scoring processes."""

    url: str
    max_concurrent: int
    memory_limit_mb: int
    run_timeout_s: float  # the service's compile and run limits, each
    deadline_s: float  # one sample's whole budget (every case, retries included)
    slots_dir: str | None = None  # the shared concurrency slots; None: no limit across processes

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward.sandbox_fusion.url={self.url!r} must be an http:// or https:// URL")
        if self.max_concurrent < 1:
            raise ValueError(f"reward.sandbox_fusion.max_concurrent={self.max_concurrent} must be >= 1")
        if self.memory_limit_mb < 1:
            raise ValueError(f"reward.sandbox_fusion.memory_limit_mb={self.memory_limit_mb} must be >= 1")
        if not (self.run_timeout_s > 0 and self.deadline_s > 0):
            raise ValueError(f"sandbox_fusion run_timeout_s={self.run_timeout_s} and deadline_s={self.deadline_s} "
                             "must be > 0")


def build_settings(
    url: str, max_concurrent: int, memory_limit_mb: int, run_timeout_s: float, sample_timeout_s: float
) -> SandboxFusionSettings:
    """Settings for a run whose reward manager gives a sample ``sample_timeout_s`` (reward.timeout_s)."""
    return SandboxFusionSettings(url=url, max_concurrent=max_concurrent, memory_limit_mb=memory_limit_mb,
                                 run_timeout_s=run_timeout_s, deadline_s=sample_timeout_s * DEADLINE_FRACTION)


# ---------------------------------------------------------------------------------------------
# The row and the response


def extract_code(completion: str) -> str | None:
    """The code verl sends: after the last ```` ```python ```` up to the next fence; else the first
    fenced block (its first line dropped when it is a language name); None without a fence."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" not in completion:
        return None
    block = completion.split("```")[1]
    first_line, newline, rest = block.partition("\n")
    return rest if newline and first_line.strip().isalpha() else block


@dataclass(frozen=True)
class Case:
    code: str
    stdin: str | None
    expected: str | None  # None: passing means running to the end


def parse_cases(ground_truth: Any, code: str) -> list[Case]:
    """The cases of one row (module docstring), all of them.

    Raises:
        ValueError: the row's tests are not one of the shapes above (a data bug).
    """
    tests = ground_truth
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except ValueError as error:
            raise ValueError(f"sandbox_fusion: ground_truth is not JSON: {error}") from None
    if not isinstance(tests, dict):
        raise ValueError(f"sandbox_fusion: ground_truth must be a JSON object, got {type(tests).__name__}")
    asserts = tests.get("assert_case")
    if isinstance(asserts, list):
        return [Case(code + "\n\n" + str(test), None, None) for test in asserts]
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError("sandbox_fusion: ground_truth needs 'inputs' and 'outputs' lists of one length, or an "
                         "'assert_case' list")
    fn_name = tests.get("fn_name")
    program = _call_program(code, str(fn_name)) if fn_name else code
    return [Case(program, None if stdin is None else str(stdin), None if out is None else str(out))
            for stdin, out in zip(inputs, outputs, strict=True)]


# Names a LeetCode-style solution uses without importing them (List, defaultdict, heappush, inf, ...).
_CALL_PRELUDE = """\
from typing import *
from collections import *
from heapq import *
from bisect import *
from itertools import *
from functools import *
from math import *
import collections, heapq, bisect, itertools, functools, math, re, string, sys, json
"""

_CALL_MAIN = """
def __hybridflow_call(name):
    import json as _json, sys as _sys
    text = _sys.stdin.read()
    args = [_json.loads(line) for line in text.split("\\n")] if text.strip() else []
    target = globals().get(name)
    if target is None and "Solution" in globals():
        target = getattr(globals()["Solution"](), name)
    result = target(*args)
    if result is None or isinstance(result, (dict, list, tuple, bool)):
        print(_json.dumps(result))
    else:
        print(str(result))

__hybridflow_call(%r)
"""


def _call_program(code: str, fn_name: str) -> str:
    """The solution wrapped to call ``fn_name`` on the arguments read from stdin (one JSON value a line)."""
    return _CALL_PRELUDE + "\n" + code + "\n" + _CALL_MAIN % fn_name


def case_outcome(reply: Any, expected: str | None) -> str:
    """``passed``, ``failed`` or ``compile_error`` from the service's reply to one case.

    Raises:
        SandboxFusionError: the reply is not SandboxFusion's (see the module docstring), or its SandboxError.
    """
    if not isinstance(reply, dict):
        raise SandboxFusionError(f"reply is not a JSON object: {str(reply)[:MAX_ERROR_BODY_CHARS]!r}")
    status = reply.get("status")
    compiled, run = reply.get("compile_result") or {}, reply.get("run_result") or {}
    if not isinstance(compiled, dict) or not isinstance(run, dict):
        raise SandboxFusionError("reply's compile_result and run_result must be objects or null")
    if status == "Success":
        if run.get("status") != "Finished":
            raise SandboxFusionError(f"reply says Success but run_result.status={run.get('status')!r}")
        stdout = run.get("stdout")
        actual = "" if stdout is None else str(stdout)
        return _PASSED if expected is None or actual.rstrip("\n") == expected.rstrip("\n") else _FAILED
    if status == "Failed":
        compile_status = compiled.get("status")
        if compile_status in ("Error", "TimeLimitExceeded") or (
                compile_status == "Finished" and compiled.get("return_code") != 0):
            return _COMPILE_ERROR
        return _FAILED  # the run failed: an error, a non-zero exit, its time limit
    if status == "SandboxError":
        raise SandboxFusionError(f"the service reported SandboxError: {str(reply)[:MAX_ERROR_BODY_CHARS]}")
    raise SandboxFusionError(f"reply has an unknown status {status!r}")


# ---------------------------------------------------------------------------------------------
# The service


@contextlib.contextmanager
def _slot(settings: SandboxFusionSettings, deadline: float) -> Iterator[None]:
    """Hold one of ``max_concurrent`` slots shared by every process of the run (module docstring)."""
    if settings.slots_dir is None:
        yield
        return
    while True:
        for index in range(settings.max_concurrent):
            fd = os.open(os.path.join(settings.slots_dir, f"slot-{index}"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield
            finally:
                os.close(fd)  # closing the last descriptor drops the lock
            return
        if time.monotonic() >= deadline:
            raise SandboxFusionError(f"no free request slot (max_concurrent={settings.max_concurrent}) before the "
                                     "sample's deadline")
        time.sleep(SLOT_POLL_S)


def run_case(settings: SandboxFusionSettings, case: Case, deadline: float) -> Any:
    """The service's JSON reply to one case (retrying a 504 while time is left).

    Raises:
        SandboxFusionError: no usable reply before ``deadline`` (a ``time.monotonic`` instant).
    """
    payload = json.dumps({
        "code": case.code, "stdin": case.stdin, "language": "python",
        "compile_timeout": settings.run_timeout_s, "run_timeout": settings.run_timeout_s,
        "memory_limit_MB": settings.memory_limit_mb, "files": {}, "fetch_files": [],
    }).encode()
    request_limit_s = 2 * settings.run_timeout_s + API_MARGIN_S
    for attempt in range(1, MAX_ATTEMPTS + 1):
        left = deadline - time.monotonic()
        if left <= 0:
            raise SandboxFusionError(f"no reply from {settings.url} before the sample's deadline "
                                     f"({settings.deadline_s:g} s, attempt {attempt})")
        request = urllib.request.Request(settings.url, data=payload, method="POST", headers={
            "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with _slot(settings, deadline), urllib.request.urlopen(request, timeout=min(request_limit_s, left)) as reply:
                body = reply.read()
        except urllib.error.HTTPError as error:
            if error.code == 504 and attempt < MAX_ATTEMPTS:
                time.sleep(min(RETRY_DELAY_S * attempt, max(0.0, deadline - time.monotonic())))
                continue
            text = error.read()[:MAX_ERROR_BODY_CHARS].decode(errors="replace")
            raise SandboxFusionError(f"{settings.url} answered HTTP {error.code}: {text!r}") from None
        except (OSError, http.client.HTTPException) as error:  # URLError, a timeout, a reset
            reason = getattr(error, "reason", error)
            raise SandboxFusionError(f"{settings.url} failed: {type(reason).__name__}: {reason}") from None
        try:
            return json.loads(body)
        except (ValueError, RecursionError):
            raise SandboxFusionError(f"{settings.url} answered with text that is not JSON: "
                                     f"{body[:MAX_ERROR_BODY_CHARS].decode(errors='replace')!r}") from None
    raise SandboxFusionError(f"{settings.url} answered HTTP 504 (gateway timeout) {MAX_ATTEMPTS} times")


def compute_score(settings: SandboxFusionSettings, solution_str: str, ground_truth: Any, **_: Any) -> float:
    """The fraction of the row's first ``SCORED_CASES`` cases that pass (module docstring).

    Raises:
        ValueError: the row's tests are malformed.
        SandboxFusionError: the service failed on some case.
    """
    code = extract_code(solution_str)
    if code is None:
        return 0.0  # verl's rule: no fenced code, nothing to run
    cases = parse_cases(ground_truth, code)[:SCORED_CASES]
    if not cases:
        raise ValueError("sandbox_fusion: the row has no test cases")
    deadline = time.monotonic() + settings.deadline_s
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(cases), settings.max_concurrent)) as pool:
        futures = [pool.submit(run_case, settings, case, deadline) for case in cases]
        try:
            outcomes = [case_outcome(future.result(), case.expected) for future, case in zip(futures, cases, strict=True)]
        except BaseException:
            for future in futures:
                future.cancel()  # the queued ones; the running ones end at their own timeout
            raise
    if _COMPILE_ERROR in outcomes:
        first = outcomes.index(_COMPILE_ERROR)
        outcomes[first:] = [_COMPILE_ERROR] * (len(outcomes) - first)
    return sum(outcome == _PASSED for outcome in outcomes) / len(cases)


def scorers(settings: SandboxFusionSettings) -> dict[str, Any]:
    """``data_source -> scorer`` for the sources this service scores (registry.py merges them)."""
    import functools

    return {source: functools.partial(compute_score, settings) for source in DATA_SOURCES}

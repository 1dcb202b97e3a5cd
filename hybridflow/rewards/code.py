"""Reward for code generation (``data_source == "hybridflow/code"``): run the solution against
the row's tests in the sandbox (``sandbox.py``).

The response's code is its last fenced code block (```` ```python ... ``` ````), or the whole
response when it has no fence. ``ground_truth`` (JSON text, or the parsed value) is one of:

- a list of assert statements, or ``{"assert_tests": [...]}`` (MBPP's ``"test_list"`` is also
  read): each statement runs after the solution, in its namespace;
- ``{"inputs": [...], "outputs": [...]}`` (APPS/TACO style): each input is fed to the solution
  on stdin and its stdout must match the output (trailing whitespace per line ignored);
- a plain string that is not JSON: one test program run after the solution.

Score: 1.0 when every test passes, else 0.0; ``pass_rate`` (the fraction passed) comes along
as an extra value for the metrics.

Reward hacking: the tests are not in a file the solution can read, and a result only counts
when the harness prints it with a per-run random token, so ``sys.exit(0)``/``os._exit(0)`` or
printing "passed" earn nothing. For assert tests the solution shares the harness's process
(its functions must be callable), so code that inspects the interpreter's frames could still
find the token; stdin/stdout cases run the solution in processes of their own, which cannot.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import sys
import threading
from dataclasses import dataclass
from typing import Any

from hybridflow.rewards.sandbox import Sandbox, run_coroutine_sync

DATA_SOURCE = "hybridflow/code"

# The reward manager gives a sample 10 s by default; a run must end well inside that, or the
# sample is charged as a reward timeout instead of a failed solution.
CASE_TIMEOUT_S = 4.0
TOTAL_TIMEOUT_S = 8.0
# Output kept per stdin/stdout case: enough for any expected answer to be compared in full.
MAX_CASE_OUTPUT_CHARS = 1 << 14

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

# Runs in the sandbox. Reads the token and the tests from stdin before the solution runs, keeps
# its own reference to os.write (the solution may replace print or sys.stdout), and reports one
# line per test as it goes, so a later test that hangs does not lose earlier results.
_ASSERT_HARNESS = r'''
import json, os, signal, sys

def _main():
    write = os.write
    token = sys.stdin.readline().strip()
    spec = json.loads(sys.stdin.readline())
    source = open("solution.py").read()

    def alarm(signum, frame):
        raise TimeoutError("test timed out")

    def run(code, name):
        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, spec["case_timeout_s"])
        try:
            exec(compile(code, name, "exec"), namespace)
            return True
        except BaseException:
            return False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    namespace = {"__name__": "__main__"}
    loaded = run(source, "solution.py")
    for index, test in enumerate(spec["tests"]):
        passed = loaded and run(test, f"test_{index}")
        write(1, f"\n{token} {json.dumps({'case': index, 'passed': passed})}\n".encode())

_main()
'''

_STDIO_HARNESS = r'''
import ctypes, json, os, subprocess, sys

def _main():
    token = sys.stdin.readline().strip()
    spec = json.loads(sys.stdin.readline())
    # Not dumpable: the solution's processes (same user) cannot read this one's memory.
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    limit = spec["max_output_chars"]
    for index, case_input in enumerate(spec["inputs"]):
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-B", "solution.py"], input=case_input.encode(),
                capture_output=True, timeout=spec["case_timeout_s"],
            )
            status = "ok" if done.returncode == 0 else "error"
            stdout = done.stdout.decode(errors="replace")[:limit]
        except subprocess.TimeoutExpired:
            status, stdout = "timeout", ""
        except OSError:
            status, stdout = "error", ""
        line = json.dumps({"case": index, "status": status, "stdout": stdout})
        os.write(1, f"\n{token} {line}\n".encode())

_main()
'''


@dataclass(frozen=True)
class CodeTests:
    """Parsed ``ground_truth``: assert statements, or stdin/stdout pairs (one kind per row)."""

    asserts: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.asserts) or len(self.inputs)


def parse_tests(ground_truth: Any) -> CodeTests:
    """Read a row's ``ground_truth``. Raises ``ValueError`` for a malformed one: that is a data
    bug, not a wrong answer, so it must not silently score 0."""
    value = ground_truth
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return CodeTests(asserts=(ground_truth,))
    if isinstance(value, dict):
        value = _tests_from_dict(value)
    if isinstance(value, CodeTests):
        tests = value
    elif isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        tests = CodeTests(asserts=tuple(value))
    else:
        raise ValueError(
            "code ground_truth must be a list of assert statements, {'assert_tests': [...]}, "
            f"{{'inputs': [...], 'outputs': [...]}} or test code; got {type(value).__name__} {str(value)[:80]!r}"
        )
    if tests.count == 0:
        raise ValueError("code ground_truth holds no tests")
    return tests


def _tests_from_dict(value: dict[str, Any]) -> CodeTests | list[Any]:
    if "inputs" in value or "outputs" in value:
        inputs, outputs = value.get("inputs"), value.get("outputs")
        if not (isinstance(inputs, list) and isinstance(outputs, list) and len(inputs) == len(outputs)):
            raise ValueError("code ground_truth 'inputs' and 'outputs' must be lists of the same length")
        if "fn_name" in value:
            raise ValueError("code ground_truth with 'fn_name' (call-based tests) is not supported")
        return CodeTests(inputs=tuple(map(str, inputs)), outputs=tuple(map(str, outputs)))
    for key in ("assert_tests", "test_list"):
        if key in value:
            return list(value[key]) if isinstance(value[key], list) else value[key]
    raise ValueError(f"code ground_truth dict has none of 'assert_tests', 'test_list', 'inputs': {sorted(value)}")


def extract_code(solution_str: str) -> str:
    """The last fenced code block of the response, or the whole response without fences."""
    blocks = _FENCE.findall(solution_str)
    if not blocks:
        return solution_str
    python = [code for language, code in blocks if language.lower() in ("python", "py", "python3", "")]
    return (python or [code for _, code in blocks])[-1]


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _reports(stdout: str, token: str) -> dict[int, dict[str, Any]]:
    """The harness's per-case reports, by case index (a forged line lacks the token)."""
    reports: dict[int, dict[str, Any]] = {}
    prefix = token + " "
    for line in stdout.splitlines():
        if line.startswith(prefix):
            try:
                report = json.loads(line[len(prefix) :])
                reports[int(report["case"])] = report
            except (ValueError, KeyError, TypeError):
                continue
    return reports


async def run_tests(
    sandbox: Sandbox,
    code: str,
    tests: CodeTests,
    case_timeout_s: float = CASE_TIMEOUT_S,
    total_timeout_s: float = TOTAL_TIMEOUT_S,
) -> list[bool]:
    """Whether each test passed, in order (a test the run never reached counts as failed)."""
    token = secrets.token_hex(16)
    if tests.asserts:
        harness = _ASSERT_HARNESS
        spec: dict[str, Any] = {"tests": list(tests.asserts), "case_timeout_s": case_timeout_s}
    else:
        harness = _STDIO_HARNESS
        spec = {"inputs": list(tests.inputs), "case_timeout_s": case_timeout_s, "max_output_chars": MAX_CASE_OUTPUT_CHARS}
    # Every case report is one line; the cap must hold them all.
    output_bytes = max(sandbox.limits.max_output_bytes, tests.count * (MAX_CASE_OUTPUT_CHARS * 6 + 256))
    limits = dataclasses.replace(
        sandbox.limits, timeout_s=total_timeout_s, cpu_time_s=total_timeout_s, max_output_bytes=output_bytes
    )
    result = await sandbox.run(
        [sys.executable, "-I", "-B", "harness.py"],
        files={"harness.py": harness, "solution.py": code},
        stdin=f"{token}\n{json.dumps(spec)}\n",
        limits=limits,
    )
    reports = _reports(result.stdout, token)
    if tests.asserts:
        return [bool(reports.get(i, {}).get("passed")) for i in range(tests.count)]
    return [
        reports.get(i, {}).get("status") == "ok" and _normalise(reports[i]["stdout"]) == _normalise(expected)
        for i, expected in enumerate(tests.outputs)
    ]


_sandbox_lock = threading.Lock()
_sandbox: list[Sandbox] = []


def shared_sandbox() -> Sandbox:
    """One sandbox per process (creating it probes the machine once; it refuses if isolation
    cannot be set up, and that error is the sample's reward error)."""
    with _sandbox_lock:
        if not _sandbox:
            _sandbox.append(Sandbox())
        return _sandbox[0]


def compute_score(solution_str: str, ground_truth: Any, **kwargs: Any) -> dict[str, float]:
    """1.0 if the response's code passes every test of ``ground_truth``, else 0.0, plus
    ``pass_rate``. Extra keyword arguments are accepted and ignored, like every built-in scorer.

    Raises:
        ValueError: ``ground_truth`` is malformed (a data bug).
        SandboxUnavailableError: code cannot be run in isolation on this machine.
    """
    tests = parse_tests(ground_truth)
    passed = run_coroutine_sync(run_tests(shared_sandbox(), extract_code(solution_str), tests))
    rate = sum(passed) / len(passed)
    return {"score": 1.0 if all(passed) else 0.0, "pass_rate": rate}

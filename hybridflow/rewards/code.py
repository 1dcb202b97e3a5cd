"""Reward for code generation (``data_source == "hybridflow/code"``): run the solution against
the row's tests in the sandbox (``sandbox.py``).

The response's code is its last fenced code block (```` ```python ... ``` ````), or the whole
response when it has no fence. ``ground_truth`` (JSON text, or the parsed value) is one of:

- a list of tests, or ``{"assert_tests": [...]}`` (MBPP's ``"test_list"`` is also read): each
  test is a small program of assert statements run after the solution, in its namespace;
- ``{"inputs": [...], "outputs": [...]}`` (APPS/TACO style): each input is fed to the solution
  on stdin and its stdout must match the output (trailing whitespace per line ignored);
- a plain string that is not JSON: one test program run after the solution.

Score: 1.0 when every test passes, else 0.0; ``pass_rate`` (the fraction passed) comes along
as an extra value for the metrics.

The split of assert tests is ``code_plan.py``; what runs in the sandbox (the harnesses and the value
codec) is ``code_harness.py``.

Reward hacking. Everything in the sandbox is the solution's to control: it runs in the same
interpreter as the harness there, so it can read the harness's frames, replace builtins or
``json``, write to any descriptor, exit early. So nothing the sandbox says is a verdict, and
nothing it could read decides one:

- The verdict is computed here, in the caller's process. For assert tests the caller splits
  each assert: the parts that need the solution (``add(1, 2)``, ``s.pop()``) are sent to the
  sandbox as expressions to evaluate; the rest (``== 3``, ``math.isclose(..., rel_tol=...)``,
  ``set(...)``, ``not``, arithmetic) runs here on the values that come back. The expected
  values never enter the sandbox (nor do stdin/stdout tests' expected outputs), so there is
  nothing for the solution to copy.
- Values cross only as serialised plain data (``encode_value``): exact ``None``, ``bool``,
  ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``, ``set``,
  ``frozenset``, ``range`` and drained built-in iterators. Anything else (an object whose
  ``__eq__`` is always true, a subclass of ``int`` or ``str`` that lies about itself) cannot be
  reported, and the check that needed it fails. They are rebuilt here as fresh built-in objects,
  so no code of the solution's runs while they are compared.
- A report is only a claim of a value: a forged report line, a patched encoder or a harness
  killed early (``sys.exit(0)``, ``os._exit(0)``) can at most claim values, which are then
  checked like returned ones; a missing report fails its check, and two reports of one value
  fail it too. There is no secret token to steal.

What a test program may hold, so that this split is sound: top-level ``assert`` statements
(``if __name__ == "__main__":`` is unwrapped), imports of the modules in ``TEST_MODULES``,
assignments, and setup statements (``s = Stack()``, ``s.push(1)``) that run in the sandbox and
so must not compare anything. Functions, classes, loops and other imports in a test are
refused with ``ValueError``: their asserts would be decided in the sandbox. Residual: a test
that passes its expected value *to the solution* lets the solution answer it: a method call
on an object the solution built (``cache.get(2)``, ``obj.equals(expected)``) runs in the
sandbox with its arguments. Compare results (``assert cache.get(2) == "b"``) instead.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any

from hybridflow.rewards.code_harness import (
    MAX_VALUE_CHARS,
    MAX_VALUE_ITEMS,
    STDIO_HARNESS,
    decode_value,
    harness_source,
)
from hybridflow.rewards.code_plan import BASE_ENV, PROBE, Planner
from hybridflow.rewards.sandbox import Sandbox, run_coroutine_sync


DATA_SOURCE = "hybridflow/code"


# The reward manager gives a sample 10 s by default; a run must end well inside that, or the
# sample is charged as a reward timeout instead of a failed solution.
CASE_TIMEOUT_S = 4.0


TOTAL_TIMEOUT_S = 8.0


# Output kept per stdin/stdout case: enough for any expected answer to be compared in full.
MAX_CASE_OUTPUT_CHARS = 1 << 14


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CodeTests:
    """Parsed ``ground_truth``: assert tests, or stdin/stdout pairs (one kind per row)."""

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


class _ProbeFailed(Exception):
    pass


def _reports(stdout: str) -> dict[int, dict[str, Any]]:
    """The reports by id, from the sandbox's stdout. Each is a claim of the solution's, checked
    here; a malformed line is skipped, and an id reported twice counts as failed."""
    reports: dict[int, dict[str, Any]] = {}
    failed = {"ok": False}
    for line in stdout.splitlines():
        try:
            report = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: JSON nested past the stack
            continue
        if type(report) is not dict or type(report.get("id")) is not int or type(report.get("ok")) is not bool:
            continue
        ident = report["id"]
        reports[ident] = failed if ident in reports else report
    return reports


def _verdict(checks: list[tuple[Any, ...]], reports: dict[int, dict[str, Any]], env: dict[str, Any]) -> bool:
    """Replay one test here: every setup step ran, every assert holds on the reported values."""
    values: dict[int, Any] = {}

    def probe(ident: int) -> Any:
        if ident not in values:
            report = reports.get(ident, {})
            if report.get("ok") is not True or "value" not in report:
                raise _ProbeFailed(ident)
            try:
                values[ident] = decode_value(report["value"], max_range=MAX_VALUE_ITEMS)
            except ValueError:
                raise _ProbeFailed(ident) from None
        return values[ident]

    env[PROBE] = probe
    for kind, *args in checks:
        if kind == "fail":
            return False
        if kind == "set":
            env.update(args[0])
        elif kind == "step":
            if reports.get(args[0], {}).get("ok") is not True:
                return False
        else:
            try:
                # The row's own test code, on fresh built-in values: nothing of the solution's runs.
                result = eval(args[0], env) if kind == "assert" else exec(args[0], env)  # noqa: S102, S307
                if kind == "assert" and not result:
                    return False
            except Exception:
                return False
    return True


async def run_tests(
    sandbox: Sandbox,
    code: str,
    tests: CodeTests,
    case_timeout_s: float = CASE_TIMEOUT_S,
    total_timeout_s: float = TOTAL_TIMEOUT_S,
) -> list[bool]:
    """Whether each test passed, in order (a test the run never reached counts as failed).

    Raises:
        ValueError: a test cannot be checked outside the sandbox (see the module docstring).
    """
    if tests.asserts:
        planner = Planner()
        plans = [planner.plan_test(source, index) for index, source in enumerate(tests.asserts)]
        spec: dict[str, Any] = {
            "tests": [plan.steps for plan in plans],
            "case_timeout_s": case_timeout_s,
            "max_value_chars": MAX_VALUE_CHARS,
        }
        lines = sum(1 for plan in plans for step in plan.steps if step[1] == "eval")
        output_bytes = lines * (MAX_VALUE_CHARS + 256) + planner.next_id * 256
        files = {"harness.py": harness_source(), "solution.py": code}
    else:
        spec = {
            "inputs": list(tests.inputs),
            "case_timeout_s": case_timeout_s,
            "max_output_chars": MAX_CASE_OUTPUT_CHARS,
        }
        output_bytes = tests.count * (MAX_CASE_OUTPUT_CHARS * 6 + 256)  # every report in full
        files = {"harness.py": STDIO_HARNESS, "solution.py": code}
    limits = dataclasses.replace(
        sandbox.limits,
        timeout_s=total_timeout_s,
        cpu_time_s=total_timeout_s,
        max_output_bytes=max(sandbox.limits.max_output_bytes, output_bytes),
    )
    result = await sandbox.run(
        [sys.executable, "-I", "-B", "harness.py"], files=files, stdin=json.dumps(spec) + "\n", limits=limits
    )
    reports = _reports(result.stdout)
    if tests.asserts:
        env = dict(BASE_ENV)
        return [_verdict(plan.checks, reports, env) for plan in plans]
    return [_stdout_matches(reports.get(index, {}), expected) for index, expected in enumerate(tests.outputs)]


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _stdout_matches(report: dict[str, Any], expected: str) -> bool:
    stdout = report.get("stdout")
    return report.get("ok") is True and type(stdout) is str and _normalise(stdout) == _normalise(expected)


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
        ValueError: ``ground_truth`` is malformed, or a test cannot be checked outside the
            sandbox (a data bug either way).
        SandboxUnavailableError: code cannot be run in isolation on this machine.
    """
    tests = parse_tests(ground_truth)
    passed = run_coroutine_sync(run_tests(shared_sandbox(), extract_code(solution_str), tests))
    rate = sum(passed) / len(passed)
    return {"score": 1.0 if all(passed) else 0.0, "pass_rate": rate}

"""The ``code`` reward: solutions run against assert and stdin/stdout tests in the sandbox."""

from __future__ import annotations

import json
import time

import pytest

from hybridflow.rewards.code import CodeTests, compute_score, extract_code, parse_tests, run_tests, shared_sandbox
from hybridflow.rewards.sandbox import run_coroutine_sync, sandbox_unavailable_reason

needs_sandbox = pytest.mark.skipif(
    sandbox_unavailable_reason() is not None, reason=f"no isolation on this machine: {sandbox_unavailable_reason()}"
)

ADD_TESTS = json.dumps(["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"])
DOUBLE_TESTS = json.dumps({"inputs": ["2\n", "21\n"], "outputs": ["4\n", "42"]})


def test_extract_code_takes_the_last_python_block() -> None:
    text = "First try:\n```python\nx = 1\n```\nBetter:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert extract_code(text) == "def add(a, b):\n    return a + b\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("def f(): pass") == "def f(): pass"


def test_parse_tests_formats() -> None:
    assert parse_tests(ADD_TESTS).asserts[0] == "assert add(1, 2) == 3"
    assert parse_tests({"test_list": ["assert f()"]}) == CodeTests(asserts=("assert f()",))
    assert parse_tests(DOUBLE_TESTS) == CodeTests(inputs=("2\n", "21\n"), outputs=("4\n", "42"))
    assert parse_tests("assert f() == 1\nassert f() != 2").asserts == ("assert f() == 1\nassert f() != 2",)


@pytest.mark.parametrize(
    "ground_truth, match",
    [
        ({"inputs": ["1"], "outputs": []}, "same length"),
        ({"inputs": ["1"], "outputs": ["1"], "fn_name": "f"}, "not supported"),
        ({"other": 1}, "none of"),
        ("[]", "must be a list"),
        ([1, 2], "must be a list"),
    ],
)
def test_malformed_ground_truth_is_a_data_error(ground_truth: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_tests(ground_truth)


@needs_sandbox
@pytest.mark.parametrize(
    "solution, ground_truth, score, pass_rate",
    [
        ("```python\ndef add(a, b):\n    return a + b\n```", ADD_TESTS, 1.0, 1.0),
        ("def add(a, b):\n    return a * b", ADD_TESTS, 0.0, 1 / 3),  # only 2+2 passes
        ("def add(a, b) return", ADD_TESTS, 0.0, 0.0),  # syntax error
        ("print(int(input()) * 2)", DOUBLE_TESTS, 1.0, 1.0),
        ("print(4)", DOUBLE_TESTS, 0.0, 0.5),
        ("import sys\nsys.exit(1)", DOUBLE_TESTS, 0.0, 0.0),
    ],
)
def test_scores(solution: str, ground_truth: str, score: float, pass_rate: float) -> None:
    result = compute_score(solution, ground_truth)
    assert result["score"] == score
    assert result["pass_rate"] == pytest.approx(pass_rate)


@needs_sandbox
@pytest.mark.parametrize(
    "hack",
    [
        "import os\nos._exit(0)",  # skip the tests, exit cleanly
        "import sys\nsys.exit(0)",
        "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\nassert_ = None\nprint('1 passed')",
        "import json\nprint(json.dumps({'case': 0, 'passed': True}))\nprint(json.dumps({'case': 1, 'passed': True}))",
    ],
)
def test_reward_hacks_earn_nothing(hack: str) -> None:
    assert compute_score(hack, ADD_TESTS)["score"] == 0.0


@needs_sandbox
def test_hanging_test_loses_only_itself() -> None:
    code = "def f(x):\n    while x: pass\n    return 0"
    tests = CodeTests(asserts=("assert f(0) == 0", "assert f(1) == 0", "assert f(0) == 0"))
    started = time.monotonic()
    passed = run_coroutine_sync(run_tests(shared_sandbox(), code, tests, case_timeout_s=0.5, total_timeout_s=5.0))
    assert passed == [True, False, True]
    assert time.monotonic() - started < 4.0


@needs_sandbox
def test_infinite_stdin_solution_is_cut_at_the_case_timeout() -> None:
    tests = CodeTests(inputs=("1\n",), outputs=("1",))
    started = time.monotonic()
    passed = run_coroutine_sync(run_tests(shared_sandbox(), "while True: pass", tests, case_timeout_s=0.5))
    assert passed == [False]
    assert time.monotonic() - started < 3.0


@needs_sandbox
def test_scores_inside_the_reward_manager(tmp_path) -> None:
    # The manager's scoring workers cap their own memory and lead their own process groups;
    # the sandbox must work from inside one.
    from hybridflow.rewards.manager import RewardManager, ScoreRequest

    reward_file = tmp_path / "code_reward.py"
    reward_file.write_text(
        "from hybridflow.rewards.code import compute_score as score\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return score(solution_str, ground_truth)\n"
    )
    manager = RewardManager(str(reward_file), timeout_s=10.0)
    try:
        good, bad = "def add(a, b):\n    return a + b", "x = bytearray(10 * 2**30)"
        output = manager.score([ScoreRequest("hybridflow/code", good, ADD_TESTS), ScoreRequest("hybridflow/code", bad, ADD_TESTS)])
    finally:
        manager.close()
    assert output.scores == [1.0, 0.0]
    assert output.metrics["reward/error_rate"] == 0.0

"""The code reward against reward hacking: wrong code that games the harness scores 0, honest
code still scores 1. The verdict is computed in the caller from plain values the sandbox
reports, so what the solution does inside the sandbox can at most misreport its own answers.

The codec and planner tests need no sandbox; the exploit tests run real sandboxed code and skip
where isolation is unavailable, like the other code-reward tests.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridflow.rewards.code import CodeTests, compute_score, run_tests, shared_sandbox
from hybridflow.rewards.code_harness import decode_value, encode_value
from hybridflow.rewards.code_plan import Planner
from hybridflow.rewards.sandbox import run_coroutine_sync, sandbox_unavailable_reason

needs_sandbox = pytest.mark.skipif(
    sandbox_unavailable_reason() is not None, reason=f"no isolation on this machine: {sandbox_unavailable_reason()}"
)

ADD_TESTS = json.dumps(["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"])


class LyingInt(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__

    def __repr__(self) -> str:
        return "3"


# ---------------------------------------------------------------------------------------------
# Values across the boundary


def test_plain_values_round_trip_with_their_types() -> None:
    value = (
        None, True, 1, -2.5, "s\ud800", b"\x00b", 1 + 2j, range(1, 9, 2), 3**5000,
        [1, (2, 3)], {1: "a", (2,): [None]}, {1, 2}, frozenset({"x"}),
    )
    decoded = decode_value(json.loads(json.dumps(encode_value(value))))
    assert decoded == value
    assert [type(item) for item in decoded] == [type(item) for item in value]
    assert type(decoded[9]) is list and type(decoded[9][1]) is tuple  # a tuple is not a list


def test_nan_and_infinities_survive_and_compare_as_floats() -> None:
    nan, inf = decode_value(json.loads(json.dumps(encode_value([float("nan"), float("-inf")]))))
    assert math.isnan(nan) and nan != nan and inf == float("-inf")


def test_iterators_are_drained_and_rebuilt_as_iterators() -> None:
    decoded = decode_value(encode_value(i * 2 for i in range(3)))
    assert decoded != [0, 2, 4] and list(decoded) == [0, 2, 4]  # as Python compares a generator


def test_json_would_pass_a_subclass_off_as_its_base_value() -> None:
    # Why the encoder checks exact types: json writes an int subclass through int.__repr__.
    assert json.dumps(LyingInt(5)) == "5"
    assert LyingInt(5) == 4


@pytest.mark.parametrize(
    "value",
    [
        LyingInt(5),
        type("LyingStr", (str,), {"__eq__": lambda self, other: True, "__hash__": str.__hash__})("no"),
        type("LyingList", (list,), {"__eq__": lambda self, other: True})([1]),
        type("LyingFloat", (float,), {"__eq__": lambda self, other: True, "__hash__": float.__hash__})(0.5),
        type("LyingDict", (dict,), {"__eq__": lambda self, other: True})(),
        type("Anything", (), {"__eq__": lambda self, other: True})(),
        [1, type("Anything", (), {})()],
        math,
    ],
    ids=["int", "str", "list", "float", "dict", "object", "nested", "module"],
)
def test_anything_but_exact_plain_types_is_refused(value: object) -> None:
    with pytest.raises(TypeError, match="not plain data"):
        encode_value(value)


def test_oversized_and_self_referential_values_are_refused() -> None:
    loop: list = []
    loop.append(loop)
    for value in (loop, list(range(10)), iter(int, 1)):  # the last one never ends
        with pytest.raises(ValueError, match="too large or too deeply nested"):
            encode_value(value, max_items=5)


@pytest.mark.parametrize(
    "data",
    [
        {"object": []},
        {"list": [1], "tuple": [2]},
        {"set": [{"list": []}]},  # unhashable element
        {"dict": [[1]]},
        {"int": 5},
        {"complex": ["1", 2]},
        {"range": [0, 10**18, 1]},
        ["bare", "json", "list"],
        {"tuple": [{"tuple": [{"tuple": [{"tuple": []}]}]}]},  # deeper than max_depth
    ],
)
def test_malformed_or_oversized_claims_are_rejected(data: object) -> None:
    with pytest.raises(ValueError):
        decode_value(data, max_depth=2, max_range=1000)


# ---------------------------------------------------------------------------------------------
# What enters the sandbox


@pytest.mark.parametrize(
    "test",
    [
        "assert add(1, 2) == 31337",
        "assert math.isclose(area(2), 31337.5, rel_tol=1e-3)",
        "expected = [31337]\nxs = [3, 1]\nassert f(xs) == expected",
        "cases = [(1, 31337), (2, 31338)]\nassert all(f(x) == y for x, y in cases)",
        "cases = [(1, 31337)]\nassert f(cases[0][0]) == cases[0][1]",
        "s = Stack()\ns.push(1)\nassert s.pop() + 31336 == 31337",
        "d = f(1) - 31337\nassert d == 0",
    ],
)
def test_expected_values_never_enter_the_sandbox(test: str) -> None:
    steps = Planner().plan_test(test, 0).steps
    assert steps and "31337" not in json.dumps(steps) and "31338" not in json.dumps(steps)


@pytest.mark.parametrize(
    "test, match",
    [
        ("def check(candidate):\n    assert candidate(1) == 2\ncheck(f)", "FunctionDef is not supported"),
        ("for i in range(3):\n    assert f(i) == i", "For is not supported"),
        ("import os\nassert f(1) == 2", "may import only"),
        ("results = []\nresults.append(f(1) == 2)\nassert results[0]", "comparison outside an assert"),
        ("assert sum([1, 2]) == 3", "asserts nothing about the solution"),
        ("assert f(1).__class__ is int", "attribute '__class__'"),
        ("assert all(f(x) for x in g(3))", "loops over values only the solution's run produces"),
    ],
)
def test_tests_the_reward_cannot_decide_outside_the_sandbox_are_data_errors(test: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Planner().plan_test(test, 0)


# ---------------------------------------------------------------------------------------------
# Exploits, run for real

FRAME_FORGE = """
import json, os, re, sys

def add(a, b):
    return None

def forge():  # the old harness kept a per-run token in its frame: find it, print passes with it
    frame = sys._getframe()
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{32}", value):
                for case in range(10):
                    os.write(1, f"\\n{value} {json.dumps({'case': case, 'passed': True})}\\n".encode())
                os._exit(0)
        frame = frame.f_back

forge()
"""

FRAME_READ_EXPECTED = """
import re, sys

def add(a, b):  # read `add(a, b) == N` out of the harness's frames and answer N
    frame = sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
            found = re.search(rf"add\\({a}, {b}\\) == (-?\\d+)", str(value))
            if found:
                return int(found.group(1))
        frame = frame.f_back
"""

ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = object.__hash__

def add(a, b):
    return Anything()
"""

LYING_INT = """
class LyingInt(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__
    def __repr__(self): return "3"
    __str__ = __repr__

def add(a, b):
    return LyingInt(99)
"""

LYING_STR_AND_LIST = """
class LyingStr(str):
    def __eq__(self, other): return True
    __hash__ = str.__hash__

class LyingList(list):
    def __eq__(self, other): return True

def add(a, b):
    return LyingList([LyingStr("x")]) if a > 0 else LyingStr("x")
"""

LYING_METACLASS = """
class Meta(type):  # `type(x) is int`-style checks compare classes: make the class equal to all
    def __eq__(cls, other): return True
    __hash__ = type.__hash__

class Number(int, metaclass=Meta):
    def __eq__(self, other): return True
    __hash__ = int.__hash__

def add(a, b):
    return Number(99)
"""

STDOUT_FORGE = """
import json, os, sys
claims = [{"id": 0, "ok": True, "value": 3}, {"id": 1, "ok": True, "value": 0}, {"id": 2, "ok": True, "value": 4}]
for claim in claims:
    print(json.dumps(claim))
    print("0" * 32, json.dumps({"case": claim["id"], "passed": True}))
    os.write(1, (json.dumps(claim) + "\\n").encode())
sys.stdout.flush()
os._exit(0)
"""

DESCRIPTOR_FORGE = """
import json, os

def add(a, b):
    for fd in range(3, 64):  # claim a pass on every descriptor the harness may report on
        for ident in range(3):
            try:
                os.write(fd, (json.dumps({"id": ident, "ok": True, "value": True}) + "\\n").encode())
            except OSError:
                pass
    os._exit(0)
"""

PATCHED_JSON_AND_BUILTINS = """
import builtins, json
json.dumps = lambda *args, **kwargs: '{"id": 0, "ok": true, "value": 3}'
json.loads = lambda *args, **kwargs: {}
builtins.isinstance = lambda *args: True
builtins.type = lambda *args: int
builtins.eval = lambda *args, **kwargs: 3
builtins.AssertionError = type("NotAnAssertionError", (Exception,), {})

def add(a, b):
    return "3"
"""

CUSTOM_EXCEPTION = """
class Passed(BaseException):
    def __str__(self): return "passed"

def add(a, b):
    raise Passed()
"""


EXPLOITS = {
    "frame-inspection-token-forge": FRAME_FORGE,
    "frame-inspection-reads-expected": FRAME_READ_EXPECTED,
    "always-true-eq": ALWAYS_EQUAL,
    "lying-int-subclass": LYING_INT,
    "lying-str-and-list-subclasses": LYING_STR_AND_LIST,
    "lying-metaclass": LYING_METACLASS,
    "stdout-forged-result": STDOUT_FORGE,
    "descriptor-forged-result": DESCRIPTOR_FORGE,
    "os-exit-in-function": "import os\ndef add(a, b):\n    os._exit(0)",
    "sys-exit-in-function": "import sys\ndef add(a, b):\n    sys.exit(0)",
    "exit-at-import": "raise SystemExit(0)",
    "monkeypatched-json-and-builtins": PATCHED_JSON_AND_BUILTINS,
    "custom-base-exception": CUSTOM_EXCEPTION,
    "nan": "def add(a, b):\n    return float('nan')",
}
# Results that cannot be reported, run with short limits: each must fail, not hang the scorer.
UNREPORTABLE = {
    "endless-output": "def add(a, b):\n    while True:\n        print('x' * 10000)",
    "huge-result": "def add(a, b):\n    return list(range(10**6))",
    "endless-iterator": "import itertools\ndef add(a, b):\n    return itertools.count()",
    "cyclic-result": "def add(a, b):\n    x = []\n    x.append(x)\n    return x",
}


def _unreportable(code: str) -> list[bool]:
    tests = CodeTests(asserts=("assert add(1, 2) == 3",))
    return run_coroutine_sync(run_tests(shared_sandbox(), code, tests, case_timeout_s=0.5, total_timeout_s=3.0))


@pytest.fixture(scope="module")
def hack_results() -> dict[str, object]:
    """Every sandboxed case of this file at once, through the real entry points: the runs
    overlap (each mostly waits on process start-up), which keeps the file to a few seconds."""
    jobs = {name: (compute_score, code, ADD_TESTS) for name, code in EXPLOITS.items()}
    jobs |= {name: (_unreportable, code) for name, code in UNREPORTABLE.items()}
    stdio_forge = 'print(\'{"id": 0, "ok": true, "status": "ok", "stdout": "4"}\')'
    jobs["stdio-forged-report"] = (compute_score, stdio_forge, json.dumps({"inputs": ["2\n"], "outputs": ["4"]}))
    jobs["honest"] = (_honest,)
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = {name: pool.submit(*job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


@needs_sandbox
@pytest.mark.parametrize("name", EXPLOITS)
def test_wrong_code_that_games_the_harness_scores_zero(name: str, hack_results: dict[str, object]) -> None:
    assert hack_results[name] == {"score": 0.0, "pass_rate": 0.0}


@needs_sandbox
@pytest.mark.parametrize("name", UNREPORTABLE)
def test_results_that_cannot_be_reported_fail(name: str, hack_results: dict[str, object]) -> None:
    assert hack_results[name] == [False]


@needs_sandbox
def test_a_stdio_solution_cannot_print_a_report(hack_results: dict[str, object]) -> None:
    assert hack_results["stdio-forged-report"] == {"score": 0.0, "pass_rate": 0.0}


HONEST = """
import math
from collections import Counter

def add(a, b):
    print("debugging output the harness must not mistake for a report " * 2000)
    return a + b

def pair(x): return (x, x)
def common(a, b): return tuple(set(a) & set(b))
def area(r): return math.pi * r * r
def doubles(n): return (i * 2 for i in range(n))
def counts(s): return Counter(s)
def maybe(x): return None if x else True
def nan(): return float("nan")
def big(n): return math.factorial(n)
def mixed(): return b"ab", 1 + 2j, range(3), frozenset({1}), {(1, 2): [3]}
def sort_in_place(a): a.sort()
def square(x): return x * x
def greet(x): return "ab" + x

class Stack:
    def __init__(self): self.items = []
    def push(self, x): self.items.append(x)
    def pop(self): return self.items.pop()
    def __len__(self): return len(self.items)

class Solution:
    def twoSum(self, nums, target):
        seen = {}
        for i, n in enumerate(nums):
            if target - n in seen:
                return [seen[target - n], i]
            seen[n] = i
"""

HONEST_TESTS = [
    "assert add(1, 2) == 3",
    "assert pair(1) == (1, 1)\nassert pair(1) != [1, 1]\nassert isinstance(pair(2), tuple)",
    "assert set(common((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
    "assert math.isclose(area(10), 314.159, rel_tol=0.001)\nassert abs(area(1) - 3.14159) < 1e-4",
    "assert list(doubles(3)) == [0, 2, 4]\nassert sorted(doubles(2), reverse=True) == [2, 0]",
    "assert counts('aab') == {'a': 2, 'b': 1}",
    "assert maybe(1) is None\nassert maybe(0) is True\nassert not maybe(1)",
    "assert math.isnan(nan())\nassert nan() != nan()",
    "assert big(3000) == math.factorial(3000)",
    "assert mixed() == (b'ab', 1 + 2j, range(3), frozenset({1}), {(1, 2): [3]})",
    "a = [3, 1, 2]\nsort_in_place(a)\nassert a == [1, 2, 3]",
    "s = Stack()\ns.push(1)\ns.push(2)\nassert len(s) == 2\nassert s.pop() == 2",
    "assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]",
    "cases = [(1, 1), (2, 4), (3, 9)]\nassert all(square(x) == y for x, y in cases)",
    "assert [square(i) for i in range(3)] == [0, 1, 4]",
    "d = square(2) - 4\nassert d == 0",
    "assert greet('c').startswith('ab')\nassert greet('x').upper() == 'ABX'",
    "from math import isclose\nif __name__ == '__main__':\n    assert isclose(area(1.0), math.pi)",
]


def _honest() -> tuple[list[bool], dict[str, float]]:
    passed = run_coroutine_sync(run_tests(shared_sandbox(), HONEST, CodeTests(asserts=tuple(HONEST_TESTS))))
    return passed, compute_score("def add(a, b):\n    return a + b", ADD_TESTS)


@needs_sandbox
def test_honest_code_passes_every_supported_test_form(hack_results: dict[str, object]) -> None:
    passed, score = hack_results["honest"]  # type: ignore[misc]
    assert passed == [True] * len(HONEST_TESTS)
    assert score == {"score": 1.0, "pass_rate": 1.0}

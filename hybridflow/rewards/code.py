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

import ast
import builtins
import copy
import dataclasses
import functools
import importlib
import inspect
import json
import math
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from hybridflow.rewards.sandbox import Sandbox, run_coroutine_sync

DATA_SOURCE = "hybridflow/code"

# The reward manager gives a sample 10 s by default; a run must end well inside that, or the
# sample is charged as a reward timeout instead of a failed solution.
CASE_TIMEOUT_S = 4.0
TOTAL_TIMEOUT_S = 8.0
# Output kept per stdin/stdout case: enough for any expected answer to be compared in full.
MAX_CASE_OUTPUT_CHARS = 1 << 14
# One reported value (its JSON line) and the items in it: a list of ten thousand numbers fits;
# a value past either is reported as an error rather than filling the output cap.
MAX_VALUE_CHARS = 1 << 17
MAX_VALUE_ITEMS = 1 << 15
MAX_VALUE_DEPTH = 100
# The test's own inputs sent into the sandbox (``xs = list(range(10**5))``) may be larger.
MAX_INPUT_ITEMS = 1 << 20
# Modules a test may import (``math`` is there without an import: MBPP's tests use it so). The
# caller runs calls into them on plain values; none looks attributes up by a string, which is
# why ``operator`` (attrgetter) and ``string`` (Formatter.get_field) are not here.
TEST_MODULES = (
    "math", "cmath", "re", "collections", "itertools", "functools", "heapq", "statistics", "fractions", "decimal",
)
# Builtins an assert may call here. The ones in _SANDBOX_BUILTINS run in the sandbox instead
# when every argument comes from the solution (``len(stack)``, ``list(gen)``, ``next(gen)``):
# they then take nothing of the test's, and the solution's objects define what they return.
_CALLER_BUILTINS = (
    "abs", "all", "any", "ascii", "bin", "bool", "bytes", "callable", "chr", "complex", "dict", "divmod",
    "enumerate", "filter", "float", "frozenset", "hash", "hex", "int", "isinstance", "issubclass", "iter",
    "len", "list", "map", "max", "min", "next", "oct", "ord", "pow", "range", "repr", "reversed", "round",
    "set", "slice", "sorted", "str", "sum", "tuple", "type", "zip",
)
_SANDBOX_BUILTINS = frozenset(_CALLER_BUILTINS) - {"type", "isinstance", "issubclass"}
_BASE_ENV: dict[str, Any] = {
    "__builtins__": {}, "math": math, **{name: getattr(builtins, name) for name in _CALLER_BUILTINS},
}
# Attributes an assert may not use here: ``str.format`` looks attributes up by a string.
_FORBIDDEN_ATTRIBUTES = frozenset({"format", "format_map"})
_PROBE, _ROWS, _ROW = "__probe__", "__rows__", "__row__"  # names of the rewritten asserts

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


# ---------------------------------------------------------------------------------------------
# Values across the sandbox boundary. Both functions also run inside the sandbox (the harness
# carries their source), so they use nothing but builtins and the modules they import.


def encode_value(value: Any, max_items: int = MAX_VALUE_ITEMS, max_depth: int = MAX_VALUE_DEPTH) -> Any:
    """``value`` as JSON-ready data that keeps Python's types apart (a tuple is not a list).

    Only exact built-in types qualify, checked with ``type(x) is ...``: ``json.dumps`` would
    write a subclass of ``int`` or ``str`` as its base value and iterate a subclass of ``list``
    natively, and a subclass's ``__eq__`` or ``__repr__`` may say anything, so a subclass is
    refused like any other object. Built-in iterators (generators, ``map``, ``zip``, ...) are
    drained; ``Counter``, ``OrderedDict`` and ``defaultdict`` travel as the dicts they compare as.

    Raises:
        TypeError: the value holds something that is not plain data.
        ValueError: it holds more than ``max_items`` items or nests deeper than ``max_depth``.
    """
    import collections
    import types

    iterators = (
        types.GeneratorType, map, filter, zip, enumerate, reversed,
        type(iter([])), type(reversed([])), type(iter(())), type(iter("")), type(iter(b"")),
        type(iter(range(0))), type(iter(set())), type(iter({})), type(iter({}.values())), type(iter({}.items())),
        type(iter(int, 0)),
    )
    mappings = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)
    sequences = ((list, "list"), (tuple, "tuple"), (set, "set"), (frozenset, "frozenset"))
    left = [max_items]

    def walk(item: Any, depth: int) -> Any:
        left[0] -= 1
        if left[0] < 0 or depth > max_depth:
            raise ValueError("value too large or too deeply nested to report")
        kind = type(item)
        if item is None or kind is bool or kind is str or kind is float:
            return item  # json writes nan and infinities as NaN and Infinity, and reads them back
        if kind is int:
            # Past Python's 4300-digit limit for decimal text, hex has none.
            return item if item.bit_length() <= 4096 else {"int": format(item, "x")}
        if kind is complex:
            return {"complex": [item.real, item.imag]}
        if kind is bytes:
            return {"bytes": item.hex()}
        if kind is range:
            return {"range": [item.start, item.stop, item.step]}
        for sequence, tag in sequences:  # by identity: a metaclass can make a class == list
            if kind is sequence:
                return {tag: [walk(element, depth + 1) for element in item]}
        if any(kind is mapping for mapping in mappings):
            return {"dict": [[walk(key, depth + 1), walk(element, depth + 1)] for key, element in item.items()]}
        if any(kind is iterator for iterator in iterators):
            return {"iter": [walk(element, depth + 1) for element in item]}
        raise TypeError(f"{kind.__module__}.{kind.__qualname__} is not plain data")

    return walk(value, 0)


def decode_value(data: Any, max_depth: int = MAX_VALUE_DEPTH, max_range: int | None = None) -> Any:
    """The value ``encode_value`` encoded, built from scratch out of built-in types. ``data``
    is untrusted: anything but a well-formed encoding raises ``ValueError``, and so does a
    ``range`` longer than ``max_range`` (a claimed ``range(10**18)`` would stall ``sum``)."""

    def number(item: Any) -> bool:
        return type(item) is int or type(item) is float

    def build(item: Any, depth: int) -> Any:
        if depth > max_depth:
            raise ValueError("encoded value nests too deeply")
        kind = type(item)
        if item is None or kind is bool or kind is int or kind is float or kind is str:
            return item
        if kind is dict and len(item) == 1:
            ((tag, body),) = item.items()
            if tag == "int" and type(body) is str:
                return int(body, 16)
            if tag == "bytes" and type(body) is str:
                return bytes.fromhex(body)
            if tag == "complex" and type(body) is list and len(body) == 2 and all(map(number, body)):
                return complex(body[0], body[1])
            if tag == "range" and type(body) is list and len(body) == 3 and all(type(x) is int for x in body):
                value = range(body[0], body[1], body[2])
                if max_range is None or len(value) <= max_range:
                    return value
            if tag == "dict" and type(body) is list:
                pairs = [pair for pair in body if type(pair) is list and len(pair) == 2]
                if len(pairs) == len(body):
                    return {build(key, depth + 1): build(element, depth + 1) for key, element in pairs}
            if tag in ("list", "tuple", "set", "frozenset", "iter") and type(body) is list:
                elements = [build(element, depth + 1) for element in body]
                return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "iter": iter}[tag](elements)
        raise ValueError(f"not an encoded value: {str(item)[:80]!r}")

    try:
        return build(data, 0)
    except (TypeError, RecursionError) as error:  # an unhashable key or element, say
        raise ValueError(f"not an encoded value: {error}") from None


# ---------------------------------------------------------------------------------------------
# Sandbox side

# Runs in the sandbox. Reads its steps from stdin before the solution runs (they hold no
# expected value), reports on a copy of stdout while the solution's own prints go to /dev/null
# (a chatty solution neither fills the output cap nor writes over reports), one JSON line per
# step as it goes, so a later test that hangs does not lose earlier results.
_ASSERT_HARNESS = r'''
from __future__ import annotations
import json, os, signal, sys

{codec}

class _Timeout(BaseException):
    pass

def _main():
    spec = json.loads(sys.stdin.readline())
    report_fd = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    write, dumps, encode, decode = os.write, json.dumps, encode_value, decode_value
    limit, timeout = spec["max_value_chars"], spec["case_timeout_s"]
    armed = [False]

    def alarm(signum, frame):
        if armed[0]:
            raise _Timeout()

    def timed(run, *args):
        signal.signal(signal.SIGALRM, alarm)
        armed[0] = True
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            return run(*args)
        except BaseException:
            return False
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)

    def report(ident, ok, value=None):
        item = {{"id": ident, "ok": ok}}
        if ok and value is not None:
            item["value"] = value[0]
        line = dumps(item)
        if len(line) > limit:
            line = dumps({{"id": ident, "ok": False}})
        write(report_fd, (line + "\n").encode())

    def load():
        exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
        return True

    def test(steps):
        for ident, kind, *args in steps:
            try:
                if kind == "bind":
                    namespace[args[0]] = decode(args[1])
                elif kind == "exec":
                    exec(compile(args[0], f"test_step_{{ident}}", "exec"), namespace)
                    report(ident, True)
                else:
                    value = eval(compile(args[0], f"test_step_{{ident}}", "eval"), namespace)
                    report(ident, True, [encode(value)])
            except _Timeout:
                raise
            except BaseException:
                report(ident, False)
                if kind != "eval":  # a setup step failed: the rest of this test cannot run
                    return False
        return True

    namespace = {{"__name__": "__main__"}}
    if timed(load):
        for steps in spec["tests"]:
            timed(test, steps)
    os._exit(0)  # not waiting for threads or atexit handlers the solution left behind

_main()
'''

_STDIO_HARNESS = r'''
import ctypes, json, os, subprocess, sys

def _main():
    spec = json.loads(sys.stdin.readline())
    # Not dumpable: the solution's processes (same user) cannot read or trace this one, and
    # they do not hold its stdout: only this process reports.
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
        line = json.dumps({"id": index, "ok": status == "ok", "status": status, "stdout": stdout})
        os.write(1, f"{line}\n".encode())

_main()
'''


@functools.cache
def _harness_source() -> str:
    codec = "\n\n".join(inspect.getsource(function) for function in (encode_value, decode_value))
    limits = f"MAX_VALUE_ITEMS = {MAX_VALUE_ITEMS}\nMAX_VALUE_DEPTH = {MAX_VALUE_DEPTH}\n"  # the defaults' values
    return _ASSERT_HARNESS.format(codec=limits + codec)


# ---------------------------------------------------------------------------------------------
# Ground truth


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


# ---------------------------------------------------------------------------------------------
# Caller side: split assert tests into sandbox steps and checks run here


@dataclass
class _Binding:
    """A name a test bound: in the sandbox, or here (with its value when known at planning)."""

    in_sandbox: bool
    value: Any = None
    known: bool = False  # computed here before the run, so it can be sent into the sandbox
    sent: bool = False  # the sandbox holds it too (sent, or imported on both sides)


@dataclass
class _TestPlan:
    steps: list[list[Any]] = field(default_factory=list)  # [id, "bind"|"exec"|"eval", ...] for the sandbox
    checks: list[tuple[Any, ...]] = field(default_factory=list)  # what decides the verdict, in order, here


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)
_SCOPES = (*_COMPREHENSIONS, ast.Lambda)
_SIMPLE_STATEMENTS = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete, ast.Pass)


def _bound_names(node: ast.AST) -> set[str]:
    """The names a comprehension or lambda binds for its own body."""
    if isinstance(node, ast.Lambda):
        a = node.args
        return {arg.arg for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if arg is not None}
    if isinstance(node, _SCOPES):
        return {n.id for gen in node.generators for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
    return set()


def _read_names(node: ast.AST) -> set[str]:
    """The names ``node`` reads from the scope it runs in."""
    if isinstance(node, ast.Name):
        return {node.id} if not isinstance(node.ctx, ast.Store) else set()
    names: set[str] = set()
    for child in ast.iter_child_nodes(node):
        names |= _read_names(child)
    if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
        names.add(node.target.id)
    return names - _bound_names(node)


def _stored_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}


def _is_immutable(value: Any) -> bool:
    if value is None or type(value) in (bool, int, float, complex, str, bytes, range):
        return True
    return type(value) in (tuple, frozenset) and all(map(_is_immutable, value))


def _is_main_guard(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and not node.orelse
        and isinstance(node.test, ast.Compare)
        and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'
    )


class _Planner:
    """Turns test programs into sandbox steps and checks that run here. A test's scope carries
    over to the next, as in one namespace. Raises ``ValueError`` for a test it cannot split."""

    def __init__(self) -> None:
        self.scope: dict[str, _Binding] = {}
        self.env = dict(_BASE_ENV)  # the values computed here while planning
        self.next_id = 0
        self.plan = _TestPlan()
        self.touched: set[str] = set()
        self.probes = 0
        # While splitting a comprehension's element: its loop variables, and the solution's
        # parts that read them, evaluated there once per iteration (see _split_comprehension).
        self.rows: tuple[frozenset[str], list[ast.expr]] | None = None

    def plan_test(self, source: str, index: int) -> _TestPlan:
        self.plan, self.probes = _TestPlan(), 0
        try:
            body = ast.parse(source).body
        except SyntaxError as error:
            raise ValueError(f"code test {index} is not valid Python: {error}") from None
        try:
            self._statements(body)
        except _PlanStop:
            pass  # a statement that runs here failed: the test fails there, as Python would
        else:
            if not self.probes:
                raise ValueError(
                    f"code test {index} asserts nothing about the solution (no assert uses a name the solution "
                    f"defines): {source[:120]!r}"
                )
        return self.plan

    def _statements(self, body: list[ast.stmt]) -> None:
        for statement in body:
            if _is_main_guard(statement):
                self._statements(statement.body)  # type: ignore[attr-defined]
                continue
            self._statement(statement)
            for name in self.touched:  # a mutable value sent in may be changed there (in-place tests)
                binding = self.scope[name]
                if not binding.in_sandbox and not _is_immutable(binding.value):
                    self.scope[name] = _Binding(in_sandbox=True)
            self.touched.clear()

    def _statement(self, statement: ast.stmt) -> None:
        if isinstance(statement, ast.Assert):
            test = self._split(statement.test, frozenset())
            self.plan.checks.append(("assert", self._compile(ast.Expression(test), "eval")))
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            self._import(statement)
        elif isinstance(statement, ast.Assign) and all(_plain_target(t) for t in statement.targets):
            self._assign(statement)
        elif isinstance(statement, _SIMPLE_STATEMENTS):
            if any(isinstance(node, ast.Compare) for node in ast.walk(statement)):
                raise ValueError(
                    f"code test line {statement.lineno}: a comparison outside an assert would be decided in "
                    f"the sandbox: {ast.unparse(statement)[:120]!r}"
                )
            self._in_sandbox(statement)
        else:
            raise ValueError(
                f"code test line {statement.lineno}: {type(statement).__name__} is not supported in a code test "
                "(top-level asserts, imports of TEST_MODULES, assignments and setup calls only), since its asserts "
                f"would be decided inside the sandbox: {ast.unparse(statement)[:120]!r}"
            )

    def _import(self, statement: ast.Import | ast.ImportFrom) -> None:
        bound: dict[str, Any] = {}
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                module = self._module(alias.name, statement)
                top = alias.name.split(".")[0]  # what ``import a.b`` binds
                bound[alias.asname or top] = module if alias.asname else importlib.import_module(top)
        else:
            module = self._module("." * statement.level + (statement.module or ""), statement)
            for alias in statement.names:
                if alias.name == "*" or alias.name.startswith("_"):
                    raise ValueError(f"code test line {statement.lineno}: {ast.unparse(statement)!r} is not supported")
                if not hasattr(module, alias.name):
                    self.plan.checks.append(("fail",))  # an ImportError, as Python would raise
                    raise _PlanStop
                bound[alias.asname or alias.name] = getattr(module, alias.name)
        self.env.update(bound)
        self.plan.checks.append(("set", bound))
        self._exec_step(statement)  # the solution's expressions may use them too
        for name, value in bound.items():
            self.scope[name] = _Binding(in_sandbox=False, value=value, known=True, sent=True)

    @staticmethod
    def _module(name: str, statement: ast.stmt) -> Any:
        if name.split(".")[0] not in TEST_MODULES:
            raise ValueError(
                f"code test line {statement.lineno}: a test may import only {TEST_MODULES}: {ast.unparse(statement)!r}"
            )
        try:
            return importlib.import_module(name)
        except ImportError as error:
            raise ValueError(f"code test line {statement.lineno}: {error}") from None

    def _assign(self, statement: ast.Assign) -> None:
        names = set().union(*(_stored_names(target) for target in statement.targets))
        if self._known_here(statement.value):
            self._run_here(statement, names)  # test data: stays here until the solution is given it
            for name in names:
                self.scope[name] = _Binding(in_sandbox=False, value=self.env[name], known=True)
        elif self._needs_sandbox(statement.value, frozenset()) and self._runs_in_sandbox(statement.value, frozenset()):
            self._in_sandbox(statement)  # s = Stack(), x = f(1): the value lives with the solution
        else:
            # Mixed (d = f(1) - 3): the solution's parts are evaluated there, the rest here, after
            # the run (as is anything that uses such a name).
            value = self._split(statement.value, frozenset())
            tree = ast.Module([ast.copy_location(ast.Assign(statement.targets, value), statement)], [])
            self.plan.checks.append(("exec", self._compile(tree, "exec")))
            for name in names:
                self.scope[name] = _Binding(in_sandbox=False)

    def _run_here(self, statement: ast.stmt, names: set[str]) -> None:
        """Run a statement of test data here now (it needs nothing of the solution's)."""
        code = self._compile(ast.Module([statement], []), "exec")
        try:
            exec(code, self.env)  # noqa: S102 - a validated statement of the row's test, no solution value in reach
        except Exception:
            self.plan.checks.append(("fail",))
            raise _PlanStop from None
        self.plan.checks.append(("set", {name: self.env[name] for name in names}))

    def _known_here(self, node: ast.AST) -> bool:
        """Whether ``node`` can be evaluated here before the run: it reads only builtins and
        values the test computed from its own data."""
        for name in _read_names(node):
            binding = self.scope.get(name)
            if binding is None and name not in _BASE_ENV:
                return False
            if binding is not None and (binding.in_sandbox or not binding.known):
                return False
        return True

    def _in_sandbox(self, statement: ast.stmt) -> None:
        statement = self._inputs(statement)
        for name in sorted(_read_names(statement)):
            self._send(name)
        ident = self._exec_step(statement)
        self.plan.checks.append(("step", ident))
        for name in _stored_names(statement):
            self.scope[name] = _Binding(in_sandbox=True)

    def _exec_step(self, statement: ast.stmt) -> int:
        ident = self._new_id()
        self.plan.steps.append([ident, "exec", ast.unparse(statement)])
        return ident

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _send(self, name: str) -> None:
        """Give the sandbox a value the test bound here, before code there reads it."""
        binding = self.scope.get(name)
        if binding is None or binding.in_sandbox or binding.sent:
            return  # the solution's name, a builtin, or already there
        if not binding.known:
            raise ValueError(f"code test passes {name!r}, computed from the solution's results, back to the solution")
        try:
            data = encode_value(binding.value, max_items=MAX_INPUT_ITEMS)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"code test passes {name!r} to the solution, which only plain data can reach: {error}"
            ) from None
        self.plan.steps.append([self._new_id(), "bind", name, data])
        binding.sent = True
        self.touched.add(name)

    def _in_sandbox_name(self, name: str, local: frozenset[str]) -> bool:
        if name in local or name in (_PROBE, _ROWS, _ROW):
            return False
        binding = self.scope.get(name)
        return binding.in_sandbox if binding is not None else name not in _BASE_ENV

    def _needs_sandbox(self, node: ast.AST, local: frozenset[str]) -> bool:
        return any(self._in_sandbox_name(name, local) for name in _read_names(node))

    def _is_object(self, node: ast.expr, local: frozenset[str]) -> bool:
        """An object the solution or a setup statement built (``s``, ``Solution()``, ``s.items``),
        as opposed to a result (``f(x)``): its methods and attributes are asked there."""
        if isinstance(node, ast.Name):
            return self._in_sandbox_name(node.id, local)
        if isinstance(node, ast.Attribute):
            return self._is_object(node.value, local)
        if isinstance(node, ast.Call):  # a constructor, by the naming convention of the test's author
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            return callee[:1].isupper() and self._is_object(node.func, local)
        return False

    def _runs_in_sandbox(self, node: ast.AST, local: frozenset[str]) -> bool:
        """Whether ``node`` (which needs the sandbox) is evaluated there as a whole."""
        if isinstance(node, ast.Starred):
            return self._runs_in_sandbox(node.value, local)
        if isinstance(node, ast.Name):
            return True
        if isinstance(node, ast.Attribute):
            return self._is_object(node.value, local)
        if not isinstance(node, ast.Call):
            return False  # operators, comparisons, containers, subscripts: here, on the values
        arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
        from_solution = all(self._needs_sandbox(a, local) and self._runs_in_sandbox(a, local) for a in arguments)
        func = node.func
        if isinstance(func, ast.Name):
            if self._in_sandbox_name(func.id, local):
                return True  # the solution's function, given the test's arguments
            return func.id in _SANDBOX_BUILTINS and func.id not in self.scope and bool(arguments) and from_solution
        if isinstance(func, ast.Attribute) and self._needs_sandbox(func.value, local):
            # A method of the solution's object runs there; one of a result (f(x).count(3)) runs
            # here on the value, unless it takes nothing of the test's.
            return self._is_object(func.value, local) or from_solution
        return self._needs_sandbox(func, local)  # a callable the solution returned: f(1)(2)

    def _split(self, node: ast.AST, local: frozenset[str]) -> Any:
        """``node`` with each part that needs the sandbox replaced by a probe of its value."""
        if not self._needs_sandbox(node, local):
            return node
        if isinstance(node, ast.expr) and self._runs_in_sandbox(node, local):
            uses = _read_names(node) & local
            if not uses:
                return self._probe(node)
            if self.rows is not None and uses <= self.rows[0]:
                self.rows[1].append(node)
                return ast.Subscript(ast.Name(_ROW, ast.Load()), ast.Constant(len(self.rows[1]) - 1), ast.Load())
            raise ValueError(
                f"code test calls the solution with a lambda variable of the test: {ast.unparse(node)[:120]!r}"
            )
        if isinstance(node, _COMPREHENSIONS):
            self._split_comprehension(node, local)
        inner = local | _bound_names(node)
        for name, value in ast.iter_fields(node):
            if isinstance(value, ast.AST):
                setattr(node, name, self._split(value, inner))
            elif isinstance(value, list):
                setattr(node, name, [self._split(v, inner) if isinstance(v, ast.AST) else v for v in value])
        return node

    def _split_comprehension(self, node: ast.expr, local: frozenset[str]) -> None:
        """``all(f(i) == 2 * i for i in range(5))``: the sandbox evaluates the solution's parts
        that read the loop variables, as rows of one shadow comprehension over the same loops
        (``[(f(i),) for i in range(5)]``); here the comprehension takes one row per iteration
        (``__row__[0] == 2 * i``), so the comparison still runs here."""
        loop, source = frozenset(_bound_names(node)), ast.unparse(node)[:120]
        saved, self.rows = self.rows, (loop, [])
        try:
            parts = ("key", "value") if isinstance(node, ast.DictComp) else ("elt",)
            for part in parts:
                setattr(node, part, self._split(getattr(node, part), local | loop))
            rows = self.rows[1]
        finally:
            self.rows = saved
        if not rows:
            return
        generators: list[ast.comprehension] = node.generators  # type: ignore[attr-defined]
        used = sorted(set().union(*map(_read_names, rows)) & loop)
        # The loops run here, before the run: the sandbox gets only the values the solution's
        # calls read (the x of ``for x, y in cases``, never the expected y).
        values = ast.Tuple([ast.Name(n, ast.Load()) for n in used], ast.Load())
        iterations = ast.ListComp(values, copy.deepcopy(generators))
        if not self._known_here(iterations):
            raise ValueError(
                "code test loops over values only the solution's run produces while calling it; the sandbox would "
                f"have to decide it: {source!r}"
            )
        target = ast.Tuple([ast.Name(n, ast.Store()) for n in used], ast.Store())
        loop_in_sandbox = ast.comprehension(target, self._send_value(iterations), [], 0)
        claims = self._probe(ast.ListComp(ast.Tuple(rows, ast.Load()), [loop_in_sandbox]))
        first = ast.comprehension(
            ast.Name(_ROWS, ast.Store()),
            ast.List([ast.Call(ast.Name("iter", ast.Load()), [claims], [])], ast.Load()),
            [],
            0,
        )
        # One row per element that passes every filter, in the order the sandbox made them.
        last = ast.comprehension(
            ast.Name(_ROW, ast.Store()),
            ast.List([ast.Call(ast.Name("next", ast.Load()), [ast.Name(_ROWS, ast.Load())], [])], ast.Load()),
            [],
            0,
        )
        node.generators = [first, *generators, last]  # type: ignore[attr-defined]

    def _probe(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Starred):
            return ast.Starred(self._probe(node.value), ast.Load())
        node = self._inputs(node)
        for name in sorted(_read_names(node)):
            self._send(name)
        ident = self._new_id()
        self.plan.steps.append([ident, "eval", ast.unparse(node)])
        self.probes += 1
        return ast.Call(ast.Name(_PROBE, ast.Load()), [ast.Constant(ident)], [])

    def _inputs(self, node: Any) -> Any:
        """``node`` with the test data it passes to the solution (``cases[0][0]``) computed here
        and sent on its own, so the rest of that data (``cases[0][1]``, expected) stays here. A
        bare name is sent whole, under its name: the solution may change it in place."""
        if (
            isinstance(node, ast.expr)
            and not isinstance(node, (ast.Name, ast.Lambda, ast.Starred))
            and isinstance(getattr(node, "ctx", ast.Load()), ast.Load)  # never an assignment's target
            and self._known_here(node)
            and any(self._is_test_data(name) for name in _read_names(node))
        ):
            return self._send_value(node)
        for name, value in ast.iter_fields(node):
            if isinstance(value, ast.AST):
                setattr(node, name, self._inputs(value))
            elif isinstance(value, list):
                setattr(node, name, [self._inputs(v) if isinstance(v, ast.AST) else v for v in value])
        return node

    def _is_test_data(self, name: str) -> bool:
        binding = self.scope.get(name)
        return binding is not None and not binding.in_sandbox and binding.known and not binding.sent

    def _send_value(self, node: ast.expr) -> ast.Name:
        """Compute ``node`` (test data) here and bind it in the sandbox under a name of its own."""
        try:
            value = eval(self._compile(ast.Expression(node), "eval"), self.env)  # noqa: S307 - test data, validated
        except Exception:
            self.plan.checks.append(("fail",))  # the assert would raise here, as in Python
            raise _PlanStop from None
        try:
            data = encode_value(value, max_items=MAX_INPUT_ITEMS)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"code test passes {ast.unparse(node)[:80]!r} to the solution, which only plain data can reach: {error}"
            ) from None
        ident = self._new_id()
        name = f"__input_{ident}__"
        self.plan.steps.append([ident, "bind", name, data])
        return ast.Name(name, ast.Load())

    def _compile(self, tree: ast.Module | ast.Expression, mode: str) -> Any:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (node.attr.startswith("_") or node.attr in _FORBIDDEN_ATTRIBUTES):
                raise ValueError(f"code test uses attribute {node.attr!r}, which the reward does not evaluate")
            if isinstance(node, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
                raise ValueError(f"code test uses {type(node).__name__}, which the reward does not evaluate")
        return compile(ast.fix_missing_locations(tree), "<code test>", mode)


class _PlanStop(Exception):
    """A statement of the test failed while planning; the rest of the test is not planned."""


def _plain_target(target: ast.expr) -> bool:
    if isinstance(target, ast.Name):
        return True
    if isinstance(target, ast.Starred):
        return _plain_target(target.value)
    return isinstance(target, (ast.Tuple, ast.List)) and all(map(_plain_target, target.elts))


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

    env[_PROBE] = probe
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
        planner = _Planner()
        plans = [planner.plan_test(source, index) for index, source in enumerate(tests.asserts)]
        spec: dict[str, Any] = {
            "tests": [plan.steps for plan in plans],
            "case_timeout_s": case_timeout_s,
            "max_value_chars": MAX_VALUE_CHARS,
        }
        lines = sum(1 for plan in plans for step in plan.steps if step[1] == "eval")
        output_bytes = lines * (MAX_VALUE_CHARS + 256) + planner.next_id * 256
        files = {"harness.py": _harness_source(), "solution.py": code}
    else:
        spec = {
            "inputs": list(tests.inputs),
            "case_timeout_s": case_timeout_s,
            "max_output_chars": MAX_CASE_OUTPUT_CHARS,
        }
        output_bytes = tests.count * (MAX_CASE_OUTPUT_CHARS * 6 + 256)  # every report in full
        files = {"harness.py": _STDIO_HARNESS, "solution.py": code}
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
        env = dict(_BASE_ENV)
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

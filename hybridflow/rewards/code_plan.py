"""The caller's side of the code reward's assert tests (``code.py``'s docstring says why): each test program
split into steps the sandbox runs (the solution's calls) and checks that run here on the values that
come back, so no expected value enters the sandbox. Refuses, with ``ValueError``, a test it cannot split."""

from __future__ import annotations

import ast
import builtins
import copy
import functools
import importlib
import math
import re
from dataclasses import dataclass, field
from typing import Any

from hybridflow.rewards.code_harness import encode_value


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


BASE_ENV: dict[str, Any] = {
    "__builtins__": {}, "math": math, **{name: getattr(builtins, name) for name in _CALLER_BUILTINS},
}


# Attributes an assert may not use here: ``str.format`` looks attributes up by a string.
_FORBIDDEN_ATTRIBUTES = frozenset({"format", "format_map"})


PROBE, _ROWS, _ROW = "__probe__", "__rows__", "__row__"  # names of the rewritten asserts


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


class Planner:
    """Turns test programs into sandbox steps and checks that run here. A test's scope carries
    over to the next, as in one namespace. Raises ``ValueError`` for a test it cannot split."""

    def __init__(self) -> None:
        self.scope: dict[str, _Binding] = {}
        self.env = dict(BASE_ENV)  # the values computed here while planning
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
            if binding is None and name not in BASE_ENV:
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
        if name in local or name in (PROBE, _ROWS, _ROW):
            return False
        binding = self.scope.get(name)
        return binding.in_sandbox if binding is not None else name not in BASE_ENV

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
        return ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(ident)], [])

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

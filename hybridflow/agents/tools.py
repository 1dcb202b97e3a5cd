"""Tools an agent may call: declaration, argument checks, execution, limits and counters.

A tool is an OpenAI function schema plus a Python callable (sync or ``async``). Declare one
with the ``@tool`` decorator (the schema is derived from the signature and docstring) or in a
YAML file (``rollout.multi_turn.tool_config_path``)::

    max_tool_response_length: 1024      # characters; longer responses are cut
    tools:
      - name: calculator                # a built-in: calculator, python, calc_gsm8k_reward, ...
      - name: python
        timeout_s: 20
      - name: search                    # a built-in with settings: a retrieval server's client
        timeout_s: 30
        config: {retrieval_service_url: "http://127.0.0.1:8000/retrieve", topk: 3, max_concurrency: 120}
      - function: my_package.tools:search   # a @tool function, or a plain function
        timeout_s: 5
        tool_schema:                        # optional: replaces the derived schema
          type: function
          function: {name: search, description: ..., parameters: {...}}

Built-in tools alone need no file: ``tool_config_path: builtin:calculator`` (or
``builtin:calculator,python``); ``load_tools`` reads either form.

verl's tool files are read too (``tools: - class_name: ..., config: {...}, tool_schema: {...}``):
an entry whose verl class has a built-in here with the same meaning becomes that tool under the
entry's ``tool_schema`` (``VERL_TOOL_CLASSES``: SandboxFusionTool, a code interpreter, is
``python``, run in the local sandbox instead of a SandboxFusion service; Gsm8kTool and Geo3kTool
are ``calc_gsm8k_reward`` and ``calc_geo3k_reward``, which score the model's answer against the
row's ground truth; SearchTool is ``search``, a client of a search-R1 retrieval server, its
verl config read by ``search.settings_from_verl``); any other class is refused naming it and
what to write instead (``verl_tool_entry``).

A tool that needs the sample it serves (``Tool.takes_context``) gets a ``call_context``
keyword (``ToolCallContext``: its own name and the row's fields, ``ground_truth`` and
``extra_info`` included), as verl's tools get the row's ``tools_kwargs``.

``ToolRegistry.call`` never raises for the model's mistakes or the tool's failures: an unknown
tool, bad arguments, an exception or a timeout become an error message for the model and a
count in ``ToolRegistry.stats``. A sync tool runs in a daemon thread; a thread cannot be
killed, so one that outlives its timeout keeps running in the background. Tools that run
untrusted or unbounded work should be ``async`` or go through the sandbox (as ``python`` does).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import threading
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from hybridflow.agents.parsers import ToolCall
from hybridflow.agents.registry import resolve_object
from hybridflow.agents.search import RetrievalClient, RetrievalSettings, settings_from_verl
from hybridflow.rewards import geo3k, gsm8k
from hybridflow.rewards.sandbox import Sandbox, SandboxLimits

DEFAULT_TOOL_TIMEOUT_S = 10.0
DEFAULT_MAX_TOOL_RESPONSE_LENGTH = 1024  # characters
TRUNCATION_MARKER = "...(truncated)"

ToolStatus = Literal["ok", "error", "timeout"]

_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


@dataclass
class Tool:
    """A callable tool and the schema the model sees."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]
    timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    max_response_length: int | None = None  # characters; None: the registry's limit
    takes_context: bool = False  # fn also gets call_context=ToolCallContext (not in the schema)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema (what ``apply_chat_template(tools=...)`` takes)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class ToolCallContext:
    """The sample a call serves, for a tool with ``takes_context``: its name (as the model called
    it) and the row's fields (``data_source``, ``ground_truth``, ``extra_info``, ...)."""

    tool_name: str
    row: Mapping[str, Any]

    def create_kwargs(self) -> dict[str, Any]:
        """verl's per-row arguments of this tool: ``extra_info.tools_kwargs.<name>.create_kwargs``
        (verl's multi-turn data puts a tool's ground truth there)."""
        extra = self.row.get("extra_info") or {}
        per_tool = (extra.get("tools_kwargs") or {}).get(self.tool_name) or {}
        return dict(per_tool.get("create_kwargs") or {})

    def ground_truth(self) -> str:
        """The answer a grading tool checks against: verl's per-row ``create_kwargs.ground_truth``,
        else the row's own ``ground_truth``; ``ValueError`` when the sample has neither."""
        truth = self.create_kwargs().get("ground_truth")
        if truth is None:
            truth = self.row.get("ground_truth")
        if truth is None:
            raise ValueError("this sample has no ground truth to check the answer against")
        return str(truth)


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
    timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
) -> Any:
    """Declare a function as a tool (``@tool`` or ``@tool(timeout_s=5)``).

    Without ``parameters``, the schema comes from the signature (``str``, ``int``, ``float``,
    ``bool``, ``list``, ``dict`` annotations; parameters without a default are required) and
    the docstring (first paragraph: the description; an ``Args:`` section: one line per
    parameter).
    """

    def wrap(function: Callable[..., Any]) -> Tool:
        return Tool(
            name=name or function.__name__,
            description=description if description is not None else _doc_summary(function),
            parameters=parameters if parameters is not None else derive_parameters(function),
            fn=function,
            timeout_s=timeout_s,
        )

    return wrap(fn) if fn is not None else wrap


def _doc_summary(function: Callable[..., Any]) -> str:
    doc = inspect.getdoc(function) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def _doc_args(function: Callable[..., Any]) -> dict[str, str]:
    """Google-style ``Args:`` entries (``name: text``), one line each."""
    described: dict[str, str] = {}
    lines = (inspect.getdoc(function) or "").splitlines()
    inside = False
    for line in lines:
        if line.strip() in ("Args:", "Arguments:"):
            inside = True
        elif inside and line and not line.startswith(" "):
            break
        elif inside and ":" in line:
            key, text = line.strip().split(":", 1)
            described[key.split(" ")[0]] = text.strip()
    return described


def derive_parameters(function: Callable[..., Any]) -> dict[str, Any]:
    """A JSON schema for ``function``'s keyword arguments."""
    hints = typing.get_type_hints(function)
    described = _doc_args(function)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        hint = typing.get_origin(hints.get(parameter.name)) or hints.get(parameter.name)
        entry: dict[str, Any] = {"type": _JSON_TYPES.get(hint, "string")}
        if parameter.name in described:
            entry["description"] = described[parameter.name]
        properties[parameter.name] = entry
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    return {"type": "object", "properties": properties, "required": required}


@dataclass(frozen=True)
class ToolResult:
    """What a call returned to the model, and how it went."""

    text: str
    status: ToolStatus
    truncated: bool = False


@dataclass
class ToolStats:
    """Counters per tool since the registry was built (for metrics and tests)."""

    calls: int = 0
    errors: int = 0  # unknown tool, bad arguments, the tool raised
    timeouts: int = 0


def check_arguments(arguments: Mapping[str, Any], parameters: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not fit the schema (required, unknown, primitive types), or None."""
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown and parameters.get("additionalProperties", False) is False:
        return f"unknown argument(s): {', '.join(unknown)}; expected: {', '.join(properties) or 'none'}"
    for name, value in arguments.items():
        expected = properties.get(name, {}).get("type")
        check = _CHECKS.get(expected) if isinstance(expected, str) else None
        if check is not None and not check(value):
            return f"argument {name!r} must be of type {expected}, got {type(value).__name__}"
    return None


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to at most ``limit`` characters (marker included)."""
    if len(text) <= limit:
        return text, False
    keep = max(0, limit - len(TRUNCATION_MARKER))
    return text[:keep] + TRUNCATION_MARKER[: limit - keep], True


def _in_daemon_thread(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Awaitable[Any]:
    """Run a sync tool off the event loop. A daemon thread per call, not a pool: a pool has a
    few workers (tools that sleep would queue behind each other) and is joined at exit (a hung
    tool would hang the process)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # the caller timed out and moved on
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        value, failure = None, None
        try:
            value = fn(**kwargs)
        except BaseException as error:  # noqa: BLE001 - reported to the awaiting coroutine
            failure = error
        try:
            loop.call_soon_threadsafe(settle, value, failure)
        except RuntimeError:
            pass  # the loop is closed: the call timed out long ago and nobody waits

    threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return future


class ToolRegistry:
    """The tools of a run, by name. Safe to share across concurrent episodes."""

    def __init__(self, tools: Iterable[Tool], max_response_length: int = DEFAULT_MAX_TOOL_RESPONSE_LENGTH) -> None:
        if max_response_length < len(TRUNCATION_MARKER):
            raise ValueError(f"max_tool_response_length must be >= {len(TRUNCATION_MARKER)}, got {max_response_length}")
        self._tools: dict[str, Tool] = {}
        for item in tools:
            if item.name in self._tools:
                raise ValueError(f"two tools are named {item.name!r}")
            self._tools[item.name] = item
        self.max_response_length = max_response_length
        self.stats: dict[str, ToolStats] = {name: ToolStats() for name in self._tools}

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas, for the chat template's ``tools`` (the prompt must list them)."""
        return [item.schema() for item in self._tools.values()]

    async def call(self, call: ToolCall, row: Mapping[str, Any] | None = None) -> ToolResult:
        """Run one call; every failure is a result, never an exception. ``row``: the fields of
        the sample the call serves, for a tool that takes them (``Tool.takes_context``)."""
        item = self._tools.get(call.name)
        if item is None:
            return ToolResult(f"Error: unknown tool {call.name!r}; available tools: {', '.join(self._tools)}", "error")
        stats = self.stats[item.name]
        stats.calls += 1
        problem = check_arguments(call.arguments, item.parameters)
        if problem is not None:
            stats.errors += 1
            return ToolResult(f"Error: {problem}", "error")
        try:
            arguments = dict(call.arguments)
            if item.takes_context:
                arguments["call_context"] = ToolCallContext(item.name, row or {})
            value = await asyncio.wait_for(self._invoke(item, arguments), timeout=item.timeout_s)
        except asyncio.TimeoutError:
            stats.timeouts += 1
            return ToolResult(f"Error: tool {item.name!r} timed out after {item.timeout_s:g} s", "timeout")
        except Exception as error:  # the tool's own failure is the model's information
            stats.errors += 1
            return ToolResult(f"Error: {type(error).__name__}: {error}", "error")
        limit = item.max_response_length or self.max_response_length
        text, cut = truncate(_to_text(value), limit)
        return ToolResult(text, "ok", truncated=cut)

    @staticmethod
    async def _invoke(item: Tool, arguments: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(item.fn):
            return await item.fn(**arguments)
        return await _in_daemon_thread(item.fn, arguments)


# ---------------------------------------------------------------------------------------------
# Built-in tools

# Bounds that keep one expression cheap: no 10**10**10.
_MAX_EXPRESSION_CHARS = 1000
_MAX_RESULT_BITS = 4096
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, ``+ - * / // % **`` and parentheses.

    Parsed with ``ast`` and walked node by node; nothing is ever ``eval``-ed, names and calls
    are rejected. Raises ``ValueError`` with a reason for anything else, including results
    too large to be useful.
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an arithmetic expression: {error.msg}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result too large") from None
        if isinstance(value, int) and value.bit_length() > _MAX_RESULT_BITS:
            raise ValueError("result too large")
        if isinstance(value, complex):
            raise ValueError("result is not a real number")
        return value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("'^' is not a power here; use '**'")
    raise ValueError(f"unsupported element {type(node).__name__}: only numbers, + - * / // % ** and parentheses")


def _check_power(base: int | float, exponent: int | float) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if max(1, abs(base).bit_length()) * exponent > _MAX_RESULT_BITS and abs(base) > 1:
            raise ValueError("result too large")


def format_number(value: int | float) -> str:
    """Integers exactly; integral floats as integers; other floats to 12 significant digits."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result is not finite")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    return str(value)


@tool(timeout_s=5.0)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(1234 * 5678) - 9".
    """
    return format_number(evaluate_arithmetic(expression))


def python_tool(sandbox: Sandbox | None = None, timeout_s: float = 10.0) -> Tool:
    """A code interpreter: runs Python in the sandbox and returns what it printed.

    Building it checks that the sandbox works here (``SandboxUnavailableError`` otherwise), so
    a run that names this tool fails at start-up, not on its first call.
    """
    box = sandbox or Sandbox(SandboxLimits(timeout_s=timeout_s, cpu_time_s=timeout_s))

    async def python(code: str) -> str:
        """Run a Python program in a fresh sandbox (no network, no files kept) and return its
        output; print what you want to see.

        Args:
            code: the program's source code.
        """
        result = await box.run_python(code)
        text = result.stdout
        if result.stderr.strip():
            text += ("\n" if text and not text.endswith("\n") else "") + result.stderr
        if result.killed_reason is not None:
            text += f"\n[killed: {result.killed_reason}]"
        elif result.exit_code:
            text += f"\n[exit code {result.exit_code}]"
        return text

    # The sandbox enforces its own time limit; the registry's is a backstop just past it.
    return tool(python, timeout_s=box.limits.timeout_s + 5.0)


def _with_limit(base: Tool, timeout_s: float | None) -> Tool:
    """``base`` with its own time limit, or ``timeout_s`` when one is given."""
    limit = base.timeout_s if timeout_s is None else timeout_s
    return replace(base, timeout_s=limit)


GSM8K_TOOL_NAME = "calc_gsm8k_reward"


async def _calc_gsm8k_reward(answer: str, call_context: ToolCallContext) -> str:
    """verl's Gsm8kTool: the answer, read as a final answer ("#### " prefixed unless it is), scored by
    the GSM8K scorer's flexible extraction (1.0 right, 0.0 otherwise) against the ground truth
    of verl's per-row tools_kwargs, else the row's own ground truth; the reply is verl's text.
    (verl's step penalty, -0.05 for an answer that does not improve, lands in a per-turn list
    its trainer never reads, and verl makes a fresh instance per call: nothing here to carry.)"""
    response = answer if answer.startswith("#### ") else "#### " + answer
    reward = gsm8k.compute_score(response, call_context.ground_truth(), method="flexible", format_score=0.0,
                                 score=1.0)
    return f"Current parsed {answer=} {reward=}"


def _answer_reward_tool(name: str, task: str, fn: Callable[..., Any], timeout_s: float | None) -> Tool:
    """One of verl's reward tools: the model submits its ``answer`` and ``fn`` replies with its
    ``task`` reward, graded against the row's ground truth (the call's context)."""
    return Tool(
        name=name,
        description=f"A tool for calculating the reward of {task}",
        parameters={"type": "object", "properties": {"answer": {"type": "string",
                                                                "description": "The answer to the question"}},
                    "required": ["answer"]},
        fn=fn,
        timeout_s=DEFAULT_TOOL_TIMEOUT_S if timeout_s is None else timeout_s,
        takes_context=True,
    )


def gsm8k_reward_tool(timeout_s: float | None = None) -> Tool:
    """``calc_gsm8k_reward``: the model submits its answer and reads back its GSM8K reward."""
    return _answer_reward_tool(GSM8K_TOOL_NAME, "gsm8k", _calc_gsm8k_reward, timeout_s)


GEO3K_TOOL_NAME = "calc_geo3k_reward"


def _calc_geo3k_reward(answer: str, call_context: ToolCallContext) -> str:
    """verl's Geo3kTool: the whole answer (no box needed) graded against the ground truth of verl's
    per-row tools_kwargs, else the row's own: 1.0 when it states the same value, 0.0 otherwise
    (wrong, or nothing that parses); the reply is verl's text. Sync on purpose: math-verify's
    sympy work runs in the registry's thread, off the event loop, under the tool's time limit.
    (verl's -0.05 step penalty is, as for Gsm8kTool, in a list its trainer never reads.)"""
    reward = geo3k.compute_score(answer, call_context.ground_truth(), use_boxed=False, format_score=0.0)
    return f"Current parsed {answer=} {reward=}"


def geo3k_reward_tool(timeout_s: float | None = None) -> Tool:
    """``calc_geo3k_reward``: the model submits its answer and reads back its Geometry3K reward."""
    return _answer_reward_tool(GEO3K_TOOL_NAME, "geo3k", _calc_geo3k_reward, timeout_s)


SEARCH_TOOL_NAME = "search"
# The client keeps its own time budget (search.RetrievalClient); the registry's limit is a backstop past it.
_SEARCH_BACKSTOP_S = 5.0


def search_tool(timeout_s: float | None, config: Mapping[str, Any]) -> Tool:
    """``search``: the model's queries go to a search-R1 retrieval server (``config``: its
    ``retrieval_service_url``, ``topk``, ``max_concurrency``; ``timeout_s``: each call's whole
    budget), the documents come back as verl's SearchTool shows them. Building it contacts
    nothing: a server that is down costs each call an error message, not the run."""
    client = RetrievalClient(RetrievalSettings.from_config(config, timeout_s))

    def search(query_list: list) -> str:
        """Searches for relevant information based on the given queries.

        Args:
            query_list: fully-formed semantic queries; the tool returns search results for each.
        """
        if not query_list or not all(isinstance(query, str) and query.strip() for query in query_list):
            raise ValueError(f"query_list must be a non-empty list of query strings, got {query_list!r}")
        return client.search(query_list)

    parameters = derive_parameters(search)
    parameters["properties"]["query_list"]["items"] = {"type": "string"}
    return tool(search, name=SEARCH_TOOL_NAME, parameters=parameters,
                timeout_s=client.settings.timeout_s + _SEARCH_BACKSTOP_S)


ToolFactory = Callable[[float | None, Mapping[str, Any]], Tool]


def _without_config(name: str, factory: Callable[[float | None], Tool]) -> ToolFactory:
    """A factory for a built-in that has no settings: an entry that gives it a ``config`` is a mistake."""

    def build(timeout_s: float | None, config: Mapping[str, Any]) -> Tool:
        if config:
            raise ValueError(f"the {name} tool takes no config, got {sorted(config)}")
        return factory(timeout_s)

    return build


# name -> factory(time limit or None for the tool's own, the entry's config): python gives the limit
# to its sandbox, which kills the program itself, and search to its client, which gives up itself
# (the registry's own limit stays a backstop just past it).
BUILTIN_TOOLS: dict[str, ToolFactory] = {
    "calculator": _without_config("calculator", lambda timeout_s: _with_limit(calculator, timeout_s)),
    "python": _without_config(
        "python", lambda timeout_s: python_tool() if timeout_s is None else python_tool(timeout_s=timeout_s)),
    GSM8K_TOOL_NAME: _without_config(GSM8K_TOOL_NAME, gsm8k_reward_tool),
    GEO3K_TOOL_NAME: _without_config(GEO3K_TOOL_NAME, geo3k_reward_tool),
    SEARCH_TOOL_NAME: search_tool,
}

_ENTRY_KEYS = {"name", "function", "timeout_s", "tool_schema", "max_response_length", "config"}

# verl's tool classes (verl/tools/*.py) -> the built-in tool with the same meaning.
VERL_TOOL_CLASSES = {"SandboxFusionTool": "python", "Gsm8kTool": GSM8K_TOOL_NAME, "Geo3kTool": GEO3K_TOOL_NAME,
                     "SearchTool": SEARCH_TOOL_NAME}
# The arguments each of those built-ins takes (verl's tool_schema may rename the tool, not add arguments).
_VERL_TOOL_ARGUMENTS = {"python": {"code"}, GSM8K_TOOL_NAME: {"answer"}, GEO3K_TOOL_NAME: {"answer"},
                        SEARCH_TOOL_NAME: {"query_list"}}
# Those without one, and why: each keeps per-episode state or calls a service hybridflow does not run.
VERL_TOOLS_WITHOUT_BUILTIN = {
    "MCPSearchTool": "it calls a search tool of an MCP server",
    "MCPBaseTool": "it calls the tools of an MCP server",
    "ImageZoomInTool": "it crops the row's image for a vision-language model's next turn",
}
_VERL_INSTEAD = ("write the tool as a Python function (sync or async; @tool from hybridflow.agents.tools sets its "
                 "schema) and name it in the entry as 'function: my_package.tools:my_tool', keeping verl's tool_schema")


def verl_tool_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A verl tool-config entry (``class_name``, ``config``, ``tool_schema``) as hybridflow's, or
    ``ValueError`` naming the class and what to do instead."""
    class_name = str(entry["class_name"])
    short = class_name.rsplit(".", 1)[-1]
    unknown = set(entry) - {"class_name", "config", "tool_schema"}
    if unknown:
        raise ValueError(f"verl tool entry {class_name}: unknown key(s) {sorted(unknown)}; verl's entries hold "
                         f"class_name, config and tool_schema")
    if short not in VERL_TOOL_CLASSES:
        why = VERL_TOOLS_WITHOUT_BUILTIN.get(short, "hybridflow does not run verl's tool classes (create/execute/"
                                                    "release with per-episode state)")
        raise ValueError(f"verl tool class {class_name} has no hybridflow equivalent ({why}); {_VERL_INSTEAD}. "
                         f"Built-in tools: {', '.join(BUILTIN_TOOLS)}")
    config = dict(entry.get("config") or {})
    ours = VERL_TOOL_CLASSES[short]
    language = config.get("default_language", "python")
    if ours == "python" and language != "python":
        raise ValueError(f"verl tool class {class_name} with default_language={language!r}: hybridflow's code "
                         f"interpreter runs Python only")
    made: dict[str, Any] = {"name": ours}
    if "tool_schema" in entry:
        properties = dict((entry["tool_schema"].get("function") or {}).get("parameters", {}).get("properties") or {})
        takes = _VERL_TOOL_ARGUMENTS[ours]
        extra = sorted(set(properties) - takes)
        if extra:
            raise ValueError(f"verl tool class {class_name}: its tool_schema declares {extra}, but hybridflow's "
                             f"{ours} tool takes only {', '.join(repr(p) for p in sorted(takes))}")
        made["tool_schema"] = entry["tool_schema"]
    if ours == SEARCH_TOOL_NAME:
        try:
            made["config"], timeout_s = settings_from_verl(config)
        except ValueError as error:
            raise ValueError(f"verl tool class {class_name}: {error}") from None
        if timeout_s is not None:
            made["timeout_s"] = timeout_s
    elif config.get("default_timeout") is not None:
        made["timeout_s"] = float(config["default_timeout"])
    return made


def build_tool(entry: Mapping[str, Any], default_timeout_s: float | None = None) -> Tool:
    """One tool from a config entry (see the module docstring for the keys). ``default_timeout_s``
    (``rollout.multi_turn.tool_timeout_s``) replaces the tool's own limit unless the entry sets
    ``timeout_s``."""
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise ValueError(f"tool entry {dict(entry)!r}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_ENTRY_KEYS)}")
    limit = entry.get("timeout_s", default_timeout_s)
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise ValueError(f"tool entry {dict(entry)!r}: config must be a mapping of the built-in tool's settings")
    if "function" in entry:
        if config:
            raise ValueError(f"tool entry {dict(entry)!r}: config is for built-in tools (search); a function "
                             f"tool reads its own settings")
        target = resolve_object(str(entry["function"]), "tool function")
        base = _with_limit(target if isinstance(target, Tool) else tool(target), limit)
    elif entry.get("name") in BUILTIN_TOOLS:
        base = BUILTIN_TOOLS[entry["name"]](None if limit is None else float(limit), config)
    else:
        raise ValueError(
            f"tool entry {dict(entry)!r} needs 'function: module:function' or the name of a built-in tool "
            f"({', '.join(BUILTIN_TOOLS)})"
        )
    made = replace(base)
    if "tool_schema" in entry:
        function = entry["tool_schema"].get("function", {})
        made.name = function.get("name", made.name)
        made.description = function.get("description", made.description)
        made.parameters = function.get("parameters", made.parameters)
    made.max_response_length = entry.get("max_response_length", made.max_response_length)
    return made


def load_tool_config(
    path: str | Path,
    max_response_length: int = DEFAULT_MAX_TOOL_RESPONSE_LENGTH,
    default_timeout_s: float | None = None,
) -> ToolRegistry:
    """The tools declared in a YAML file (``rollout.multi_turn.tool_config_path``). The file's
    own ``max_tool_response_length`` wins over ``max_response_length``."""
    file = Path(path)
    try:
        config = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read the tool config {file}: {error}") from error
    if not isinstance(config, dict) or not isinstance(config.get("tools"), list):
        raise ValueError(f"tool config {file} must be a mapping with a 'tools' list")
    tools = []
    for index, entry in enumerate(config["tools"]):
        try:
            if isinstance(entry, dict) and "class_name" in entry:  # verl's format
                entry = verl_tool_entry(entry)
            tools.append(build_tool(entry if isinstance(entry, dict) else {"name": entry}, default_timeout_s))
        except (ValueError, TypeError) as error:
            raise ValueError(f"tool config {file}, tools[{index}]: {error}") from error
    limit = int(config.get("max_tool_response_length", max_response_length))
    return ToolRegistry(tools, max_response_length=limit)


BUILTIN_PREFIX = "builtin:"


def load_tools(
    source: str | None,
    max_response_length: int = DEFAULT_MAX_TOOL_RESPONSE_LENGTH,
    default_timeout_s: float | None = None,
) -> ToolRegistry | None:
    """The tools named by ``rollout.multi_turn.tool_config_path``: ``None`` (no tools),
    ``builtin:calculator,python`` (built-in tools by name) or the path of a YAML tool file."""
    if source is None:
        return None
    if not source.startswith(BUILTIN_PREFIX):
        return load_tool_config(source, max_response_length, default_timeout_s)
    names = [name.strip() for name in source[len(BUILTIN_PREFIX) :].split(",") if name.strip()]
    unknown = [name for name in names if name not in BUILTIN_TOOLS]
    if unknown or not names:
        raise ValueError(
            f"{source!r}: unknown built-in tool(s) {', '.join(unknown) or '(none named)'}; built-in tools: "
            f"{', '.join(BUILTIN_TOOLS)}"
        )
    return ToolRegistry([build_tool({"name": name}, default_timeout_s) for name in names], max_response_length)


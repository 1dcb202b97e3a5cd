"""Tools: the safe calculator, schema derivation, YAML declaration, and the registry's
argument checks, timeouts, truncation and counters."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from hybridflow.agents.parsers import ToolCall
from hybridflow.agents.tools import (
    TRUNCATION_MARKER,
    ToolRegistry,
    calculator,
    evaluate_arithmetic,
    load_tool_config,
    python_tool,
    tool,
)
from hybridflow.rewards.sandbox import sandbox_unavailable_reason


def call(registry: ToolRegistry, name: str, **arguments):
    return asyncio.run(registry.call(ToolCall(name, arguments)))


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("123456789 * 987654321", "121932631112635269"),  # exact, beyond float precision
        ("7 / 2", "3.5"),
        ("8 / 2", "4"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 100", "1267650600228229401496703205376"),
        ("-(3)", "-3"),
        ("1 / 3", "0.333333333333"),
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('true')", "unsupported element Call"),
        ("().__class__", "unsupported element Attribute"),
        ("x + 1", "unsupported element Name"),
        ("'a' * 3", "unsupported element Constant"),
        ("True + 1", "unsupported element Constant"),
        ("2 ** 10 ** 10", "result too large"),
        ("9 ** 9999", "result too large"),
        ("10.0 ** 400", "result too large"),
        ("1 / 0", "division by zero"),
        ("2 ^ 3", r"use '\*\*'"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 2000, "longer than"),
    ],
)
def test_calculator_rejects(expression: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        evaluate_arithmetic(expression)


def test_calculator_is_fast_on_hostile_input() -> None:
    started = time.monotonic()
    for expression in ("9 ** 9 ** 9", "(2 ** 4000) * (2 ** 4000)", "((((2 ** 64) ** 64) ** 64) ** 64)"):
        with pytest.raises(ValueError, match="too large"):
            evaluate_arithmetic(expression)
    assert time.monotonic() - started < 0.5


def test_decorated_function_schema() -> None:
    @tool(timeout_s=3)
    def search(query: str, limit: int = 5, exact: bool = False) -> str:
        """Search the index.

        Args:
            query: what to look for.
            limit: how many hits to return.
        """
        return query

    assert search.timeout_s == 3
    assert search.schema() == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the index.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for."},
                    "limit": {"type": "integer", "description": "how many hits to return."},
                    "exact": {"type": "boolean"},
                },
                "required": ["query"],
            },
        },
    }
    assert search("x") == "x"  # still callable


@tool
def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


@tool
def explode(text: str) -> str:
    """Always fails."""
    raise RuntimeError(f"cannot handle {text}")


@tool(timeout_s=0.2)
async def slow_async(seconds: float) -> str:
    """Sleeps."""
    await asyncio.sleep(seconds)
    return "done"


@tool(timeout_s=0.2)
def slow_sync(seconds: float) -> str:
    """Sleeps in a thread."""
    time.sleep(seconds)
    return "done"


@tool
def listing(count: int) -> list:
    """A long JSON result."""
    return list(range(count))


REGISTRY_TOOLS = [shout, explode, slow_async, slow_sync, listing, calculator]


def test_registry_results_and_counters() -> None:
    registry = ToolRegistry(REGISTRY_TOOLS, max_response_length=40)
    assert call(registry, "shout", text="hi").text == "HI"
    unknown = call(registry, "nope", text="hi")
    assert unknown.status == "error" and "unknown tool 'nope'" in unknown.text and "shout" in unknown.text
    assert "missing required argument(s): text" in call(registry, "shout").text
    assert "unknown argument(s): loud" in call(registry, "shout", text="a", loud=True).text
    assert "must be of type string, got int" in call(registry, "shout", text=3).text
    raised = call(registry, "explode", text="x")
    assert raised.status == "error" and raised.text == "Error: RuntimeError: cannot handle x"
    for name in ("slow_async", "slow_sync"):
        assert call(registry, name, seconds=0.01).text == "done"
        late = call(registry, name, seconds=5)
        assert late.status == "timeout" and "timed out after 0.2 s" in late.text
    long = call(registry, "listing", count=100)
    assert long.truncated and len(long.text) == 40 and long.text.endswith(TRUNCATION_MARKER)
    assert call(registry, "calculator", expression="1 +").status == "error"
    stats = registry.stats
    assert (stats["shout"].calls, stats["shout"].errors) == (4, 3)
    assert (stats["explode"].calls, stats["explode"].errors) == (1, 1)
    assert (stats["slow_async"].calls, stats["slow_async"].timeouts) == (2, 1)
    assert (stats["slow_sync"].calls, stats["slow_sync"].timeouts) == (2, 1)


def test_registry_rejects_duplicate_names() -> None:
    with pytest.raises(ValueError, match="two tools are named 'shout'"):
        ToolRegistry([shout, shout])


def test_yaml_config(tmp_path: Path) -> None:
    config = tmp_path / "tools.yaml"
    config.write_text(
        f"""
max_tool_response_length: 100
tools:
  - name: calculator
    timeout_s: 2
  - function: {__name__}:shout
    max_response_length: 50
  - function: {__name__}:plain_function
    tool_schema:
      type: function
      function:
        name: reverse
        description: Reverse a string.
        parameters: {{type: object, properties: {{text: {{type: string}}}}, required: [text]}}
"""
    )
    registry = load_tool_config(config)
    assert registry.names == ["calculator", "shout", "reverse"]
    assert registry.max_response_length == 100
    assert registry.schemas()[2]["function"]["description"] == "Reverse a string."
    assert call(registry, "reverse", text="abc").text == "cba"
    assert call(registry, "calculator", expression="6*7").text == "42"


def plain_function(text: str) -> str:
    return text[::-1]


@pytest.mark.parametrize(
    "body, message",
    [
        ("tools:\n  - name: nope\n", "needs 'function: module:function' or the name of a built-in"),
        ("tools:\n  - name: calculator\n    timeout: 3\n", "unknown key"),
        ("tools:\n  - function: no_such_module_xyz:f\n", "cannot import module"),
        ("tool: []\n", "'tools' list"),
    ],
)
def test_yaml_config_errors_name_the_entry(tmp_path: Path, body: str, message: str) -> None:
    config = tmp_path / "tools.yaml"
    config.write_text(body)
    with pytest.raises(ValueError, match=message):
        load_tool_config(config)


@pytest.mark.skipif(sandbox_unavailable_reason() is not None, reason="no sandbox isolation here")
def test_python_tool_runs_in_the_sandbox() -> None:
    # A generous limit where the program must finish: starting an interpreter took over a second
    # on a loaded machine (parallel test workers); the loop gets the short one.
    registry = ToolRegistry([python_tool(timeout_s=30.0)])
    assert call(registry, "python", code="print(sum(range(10)))").text == "45\n"
    failed = call(registry, "python", code="import os\nprint(len(os.environ))\nraise ValueError('bad')")
    assert failed.status == "ok"  # the program failed, not the tool: the model reads why
    assert failed.text.startswith("5\n") and "ValueError: bad" in failed.text and "[exit code 1]" in failed.text
    short = ToolRegistry([python_tool(timeout_s=1.0)])
    assert "[killed: timeout]" in call(short, "python", code="while True: pass").text

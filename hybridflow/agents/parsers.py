"""Tool-call parsers: find the tool calls in one assistant turn's text.

A parser never raises on model output. A call it cannot read becomes a ``MalformedCall`` whose
message goes back to the model as that call's tool response, so the model can learn to fix
its format instead of the episode crashing.

``TOOL_PARSERS`` maps a config name (``rollout.multi_turn.format``) to a ``module:Class`` path;
any other ``module:Class`` path works too. A parser class takes no arguments and has
``parse(text: str) -> ParsedTurn``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hybridflow.agents.registry import resolve_object

TOOL_PARSERS: dict[str, str] = {
    "hermes": "hybridflow.agents.parsers:HermesToolParser",
    "qwen": "hybridflow.agents.parsers:HermesToolParser",  # Qwen2.5/3 use the Hermes format
}


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A call the parser could not read; ``error`` is what the model is told."""

    error: str
    raw: str


@dataclass(frozen=True)
class ParsedTurn:
    """The calls of one turn, well-formed or not, in the order the model wrote them."""

    items: tuple[ToolCall | MalformedCall, ...] = ()
    content: str = ""  # the text outside the calls

    @property
    def calls(self) -> list[ToolCall]:
        return [item for item in self.items if isinstance(item, ToolCall)]

    @property
    def malformed(self) -> list[MalformedCall]:
        return [item for item in self.items if isinstance(item, MalformedCall)]


@runtime_checkable
class ToolParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn.

    ``arguments`` may be an object or a JSON string holding one (some models quote it), and
    may be called ``parameters``; a call without arguments gets ``{}``.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        items: list[ToolCall | MalformedCall] = []
        for match in self._CALL.finditer(text):
            body, closed = match.group(1), bool(match.group(2))
            if not closed:
                items.append(MalformedCall(f"{self.OPEN} without a closing {self.CLOSE}", match.group(0)))
            else:
                items.append(_read_call(body.strip(), match.group(0)))
        content = self._CALL.sub("", text).strip()
        return ParsedTurn(items=tuple(items), content=content)


def _read_call(body: str, raw: str) -> ToolCall | MalformedCall:
    expected = 'expected {"name": "<tool name>", "arguments": {...}}'
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return MalformedCall(f"the tool call is not valid JSON ({error.msg} at position {error.pos}); {expected}", raw)
    if not isinstance(value, dict):
        return MalformedCall(f"the tool call is a JSON {type(value).__name__}, not an object; {expected}", raw)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(f"the tool call has no 'name'; {expected}", raw)
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return MalformedCall(f"the 'arguments' of {name!r} are a string that is not JSON; {expected}", raw)
    if not isinstance(arguments, dict):
        return MalformedCall(f"the 'arguments' of {name!r} must be a JSON object; {expected}", raw)
    return ToolCall(name=name, arguments=arguments)


def build_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``, or the class at a ``module:Class`` path."""
    parser_class = resolve_object(TOOL_PARSERS.get(name, name), "tool parser", known=TOOL_PARSERS)
    parser = parser_class()
    if not isinstance(parser, ToolParser):
        raise TypeError(f"tool parser {name!r} ({parser_class!r}) has no parse(text) method")
    return parser

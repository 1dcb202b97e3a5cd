"""The Hermes/Qwen ``<tool_call>`` parser: good calls, several per turn, malformed ones."""

from __future__ import annotations

import pytest

from hybridflow.agents.parsers import HermesToolParser, MalformedCall, ToolCall, build_tool_parser

parser = HermesToolParser()


def test_one_good_call_and_the_text_around_it() -> None:
    turn = parser.parse('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>')
    assert turn.items == (ToolCall("calculator", {"expression": "2+2"}),)
    assert turn.content == "Let me compute."


def test_several_calls_keep_their_order() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "c", "arguments": {"y": [1, 2]}}</tool_call>'
    )
    assert [call.name for call in parser.parse(text).calls] == ["a", "b", "c"]
    assert parser.parse(text).calls[2].arguments == {"y": [1, 2]}


@pytest.mark.parametrize(
    "body, arguments",
    [
        ('{"name": "f", "arguments": "{\\"x\\": 1}"}', {"x": 1}),  # arguments as a JSON string
        ('{"name": "f", "parameters": {"x": 1}}', {"x": 1}),  # another common key
        ('{"name": "f"}', {}),
        ('{"name": "f", "arguments": ""}', {}),
    ],
)
def test_argument_variants(body: str, arguments: dict) -> None:
    assert parser.parse(f"<tool_call>{body}</tool_call>").items == (ToolCall("f", arguments),)


@pytest.mark.parametrize(
    "text, message",
    [
        ('<tool_call>{"name": "f", "arguments": {</tool_call>', "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "JSON list, not an object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "no 'name'"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', "string that is not JSON"),
        ('<tool_call>{"name": "f", "arguments": {}}', "without a closing"),
    ],
)
def test_malformed_calls_become_messages_not_crashes(text: str, message: str) -> None:
    (item,) = parser.parse(text).items
    assert isinstance(item, MalformedCall)
    assert message in item.error
    assert "expected" in item.error or "closing" in item.error  # tells the model the format


def test_good_and_malformed_calls_mix_in_order() -> None:
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>oops</tool_call><tool_call>{"name": "b"}</tool_call>'
    items = parser.parse(text).items
    assert [type(item) for item in items] == [ToolCall, MalformedCall, ToolCall]


def test_no_call() -> None:
    turn = parser.parse("The answer is 4.")
    assert turn.items == () and turn.content == "The answer is 4."


class UpperParser:
    """A pluggable parser: every turn is a call to ``echo`` with the text."""

    def parse(self, text: str):
        from hybridflow.agents.parsers import ParsedTurn

        return ParsedTurn(items=(ToolCall("echo", {"text": text.upper()}),))


def test_registry_names_and_module_paths() -> None:
    assert isinstance(build_tool_parser("hermes"), HermesToolParser)
    assert isinstance(build_tool_parser("qwen"), HermesToolParser)
    custom = build_tool_parser(f"{__name__}:UpperParser")
    assert custom.parse("hi").calls == [ToolCall("echo", {"text": "HI"})]
    with pytest.raises(ValueError, match="known names: hermes, qwen"):
        build_tool_parser("nope")
    with pytest.raises(ValueError, match="has no attribute"):
        build_tool_parser(f"{__name__}:Missing")

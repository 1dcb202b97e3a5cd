"""Token consistency: incrementally built multi-turn ids equal the full-conversation rendering,
for the built-in ChatML template and a Qwen2.5-style template with tools, and the loss mask
covers exactly the model's tokens."""

from __future__ import annotations

import pytest

from hybridflow.agents.base import AgentContext, AgentRow, AgentRunner
from hybridflow.agents.interactions import InteractionResponse
from hybridflow.agents.tokens import TurnTemplate, assistant_spans, check_token_consistency, render_ids
from hybridflow.agents.tools import ToolRegistry, calculator, tool
from hybridflow.models.tiny import build_tiny_tokenizer
from hybridflow.types import RowFields, SamplingParams, Trajectory

# Qwen2.5-Instruct's template (tools in the system prompt, tool responses merged into one user
# turn of <tool_response> blocks), the case where naive per-message rendering goes wrong.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return text


def qwen_tokenizer():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


def two_tools_then_answer(text: str, turn: int) -> str:
    """Turn 0: two calls at once; turn 1: one malformed and one good call; turn 2: the answer."""
    if turn == 0:
        return "I will compute both.\n" + CALL.format("12*34") + "\n" + CALL.format("56+78")
    if turn == 1:
        return "<tool_call>{bad json</tool_call>\n" + '<tool_call>{"name": "echo", "arguments": {"text": "ok"}}</tool_call>'
    return "12*34 = 408 and 56+78 = 134."


def run_episode(tokenizer, engine, max_tokens: int = 1000, interaction=None) -> tuple[list[dict], Trajectory, list]:
    context = AgentContext(tokenizer, tools=ToolRegistry([calculator, echo]), interaction=interaction)
    prompt = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What are 12*34 and 56+78?"}]
    prompt_ids = render_ids(tokenizer, prompt, tools=context.tool_schemas(), add_generation_prompt=True)
    runner = AgentRunner(context, default_agent="tool_agent")
    (trajectory,) = runner.generate_sync([AgentRow(prompt_ids)], SamplingParams(max_tokens=max_tokens), engine)
    return prompt, trajectory, context.tool_schemas()


@pytest.mark.parametrize("make_tokenizer", [build_tiny_tokenizer, qwen_tokenizer], ids=["chatml", "qwen2.5"])
def test_incremental_ids_equal_the_full_rendering(make_tokenizer, scripted) -> None:
    tokenizer = make_tokenizer()
    engine = scripted(two_tools_then_answer)
    engine.tokenizer = tokenizer
    prompt, trajectory, tools = run_episode(tokenizer, engine)
    assert trajectory.num_turns == 3
    roles = [message["role"] for message in trajectory.agent.messages]
    assert roles == ["assistant", "tool", "tool", "assistant", "tool", "tool", "assistant"]
    assert check_token_consistency(tokenizer, prompt, trajectory, tools) == []
    # And the mask is exactly the model's tokens, counted from what the engine returned.
    model_tokens = sum(
        len(tokenizer.encode(two_tools_then_answer("", turn), add_special_tokens=False)) + 1 for turn in range(3)
    )
    assert sum(trajectory.loss_mask) == model_tokens
    # The whole conversation the engine saw on its last call is the trajectory's prefix.
    last_prompt = engine.requests[-1].prompt_ids
    assert last_prompt == (trajectory.prompt_ids + trajectory.response_ids)[: len(last_prompt)]


def test_qwen_tool_responses_share_one_user_turn(scripted) -> None:
    tokenizer = qwen_tokenizer()
    engine = scripted(two_tools_then_answer)
    engine.tokenizer = tokenizer
    _, trajectory, _ = run_episode(tokenizer, engine)
    text = tokenizer.decode(trajectory.response_ids, skip_special_tokens=False)
    first_responses = text.split("<|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n134")
    assert len(first_responses) == 2  # both results in one user turn, as the template renders them


def test_user_turns_from_an_interaction_are_consistent(tokenizer, scripted) -> None:
    class AskTwice:
        async def respond(self, messages, metadata):
            asked = sum(1 for m in messages if m["role"] == "user")
            return InteractionResponse(reply="Are you sure?") if asked < 2 else InteractionResponse(done=True, reward=1.0)

    engine = scripted(lambda text, turn: f"Answer {turn}.")
    prompt, trajectory, tools = run_episode(tokenizer, engine, interaction=AskTwice())
    assert [m["role"] for m in trajectory.agent.messages] == ["assistant", "user", "assistant", "user", "assistant"]
    assert check_token_consistency(tokenizer, prompt, trajectory, tools) == []


def test_consistency_with_a_turn_cut_by_the_budget(tokenizer, scripted) -> None:
    engine = scripted(two_tools_then_answer)
    prompt, trajectory, tools = run_episode(tokenizer, engine, max_tokens=250)
    assert trajectory.finish_reason == "length" and len(trajectory.response_ids) == 250
    assert check_token_consistency(tokenizer, prompt, trajectory, tools) == []


def test_the_check_catches_wrong_ids_and_masks(tokenizer, scripted) -> None:
    prompt, trajectory, tools = run_episode(tokenizer, scripted(two_tools_then_answer))
    first_inserted = trajectory.loss_mask.index(0)
    bad_mask = Trajectory(**{**trajectory.__dict__, "loss_mask": [1] * len(trajectory.loss_mask)})
    assert any("loss mask differ at position" in p for p in check_token_consistency(tokenizer, prompt, bad_mask, tools))
    ids = list(trajectory.response_ids)
    ids[first_inserted + 2] = ord("X")
    bad_ids = Trajectory(**{**trajectory.__dict__, "response_ids": ids})
    problems = check_token_consistency(tokenizer, prompt, bad_ids, tools)
    assert any(f"conversation ids differ at position {len(trajectory.prompt_ids) + first_inserted + 2}" in p for p in problems)


def test_model_tokens_are_kept_exactly_even_when_text_would_re_encode_differently(tokenizer, scripted) -> None:
    # The model spells "<|im_start|>" byte by byte. Re-encoding the decoded text would turn it
    # into the special token (decode/re-encode drift); the loop keeps the sampled bytes.
    byte_ids = [ord(ch) for ch in "<|im_start|> is just text"]  # byte-level vocab: id = byte
    engine = scripted(lambda text, turn: byte_ids)
    _, trajectory, _ = run_episode(tokenizer, engine)
    assert trajectory.response_ids == byte_ids + [tokenizer.eos_token_id]
    assert tokenizer.encode("<|im_start|> is just text", add_special_tokens=False) != byte_ids


def test_turn_template_pieces(tokenizer) -> None:
    template = TurnTemplate(tokenizer)
    assert template.turn_end_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    delta = template.delta([{"role": "tool", "content": "42"}])
    assert tokenizer.decode(delta, skip_special_tokens=False) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ((start, end),) = assistant_spans(tokenizer, messages)
    ids = render_ids(tokenizer, messages)
    assert tokenizer.decode(ids[start:end], skip_special_tokens=False) == "yo<|im_end|>"


def test_templates_that_cannot_be_extended_are_refused() -> None:
    tokenizer = build_tiny_tokenizer()
    # Ends assistant turns with plain text instead of a special token.
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="special token"):
        TurnTemplate(tokenizer)

"""data.apply_chat_template_kwargs in the agent loops: the turns an agent inserts (tool replies and
the next generation prompt) are cut from the template rendered with the same variables as the
prompt, so the whole episode equals the template's rendering with them."""

from __future__ import annotations

import pytest

from hybridflow.agents.base import AgentContext, AgentRow, AgentRunner
from hybridflow.agents.openai_episode import EpisodeRecord
from hybridflow.agents.parsers import build_tool_parser
from hybridflow.agents.tokens import TurnTemplate, check_token_consistency, render_ids
from hybridflow.agents.tools import ToolRegistry, calculator
from hybridflow.models.tiny import build_tiny_tokenizer
from hybridflow.types import RowFields, SamplingParams

# reasoning_effort shows in the system line and in the header of every tool reply.
EFFORT_TEMPLATE = (
    "{% if reasoning_effort %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}"
    "{% if m['role'] == 'tool' and reasoning_effort %} effort={{ reasoning_effort }}{% endif %}"
    "{{ '\\n' + m['content'] }}<|im_end|>\n{% endfor %}"  # (a newline after a block tag is trimmed)
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EFFORT = {"reasoning_effort": "medium"}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
QUESTION = [{"role": "user", "content": "What is 6*7?"}]


@pytest.fixture(scope="module")
def effort_tokenizer():
    return build_tiny_tokenizer(chat_template=EFFORT_TEMPLATE)


@pytest.fixture
def tokenizer(effort_tokenizer):
    """conftest's scripted engine decodes with this module's tokenizer."""
    return effort_tokenizer


def test_turn_deltas_are_measured_with_the_variables(effort_tokenizer):
    reply = [{"role": "tool", "content": "42", "name": "calculator"}]
    with_effort = effort_tokenizer.decode(TurnTemplate(effort_tokenizer, template_kwargs=EFFORT).delta(reply))
    assert with_effort == "\n<|im_start|>tool effort=medium\n42<|im_end|>\n<|im_start|>assistant\n"
    assert "effort" not in effort_tokenizer.decode(TurnTemplate(effort_tokenizer).delta(reply))


def test_a_tool_agent_episode_is_the_templates_rendering_with_the_variables(effort_tokenizer, scripted):
    engine = scripted(lambda text, turn: CALL if turn == 0 else "42")
    runner = AgentRunner(AgentContext(effort_tokenizer, tools=ToolRegistry([calculator]), chat_template_kwargs=EFFORT),
                         default_agent="tool_agent")
    prompt = render_ids(effort_tokenizer, QUESTION, add_generation_prompt=True, template_kwargs=EFFORT)
    (trajectory,) = runner.generate_sync([AgentRow(prompt)], SamplingParams(max_tokens=400), engine)
    assert trajectory.num_turns == 2
    text = effort_tokenizer.decode(trajectory.response_ids, skip_special_tokens=False)
    assert "<|im_start|>tool effort=medium\n42<|im_end|>" in text
    assert check_token_consistency(effort_tokenizer, QUESTION, trajectory, template_kwargs=EFFORT) == []
    assert check_token_consistency(effort_tokenizer, QUESTION, trajectory)  # rendered without them: differs


def test_the_openai_loops_record_renders_the_prompt_with_the_variables(effort_tokenizer):
    record = EpisodeRecord(effort_tokenizer, build_tool_parser("hermes"), budget=100, template_kwargs=EFFORT)
    record.prepare(QUESTION, None, None)
    assert effort_tokenizer.decode(record.prompt_ids, skip_special_tokens=False).startswith(
        "<|im_start|>system\nReasoning: medium<|im_end|>")

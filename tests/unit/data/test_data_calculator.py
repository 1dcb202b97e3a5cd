"""The built-in tool task: questions the tool answers, rows in verl's agent schema, disjoint
splits, and warm-start examples whose tool call the real parser and calculator answer."""

from __future__ import annotations

import asyncio
import re

import pytest

from hybridflow.agents.parsers import HermesToolParser, ToolCall
from hybridflow.agents.tools import ToolRegistry, calculator
from hybridflow.data.dataset import RLDataset
from hybridflow.data.tasks.calculator import (
    CALCULATOR_DATA_SOURCE,
    MIN_PRODUCT,
    calculator_sft_pairs,
    make_calculator_rows,
    tool_call_text,
    uses_tool,
    write_calculator_task,
)
from hybridflow.models.tiny import build_tiny_tokenizer

QUESTION = re.compile(r"What is (\d\d) \* (\d\d)\?")


def questions(rows) -> set[str]:
    return {r["prompt"][0]["content"] for r in rows}


def test_rows_are_products_in_verl_agent_schema():
    rows = make_calculator_rows(300, seed=0, split="train")
    for index, row in enumerate(rows):
        match = QUESTION.fullmatch(row["prompt"][0]["content"])
        assert match, row
        answer = int(match[1]) * int(match[2])
        assert answer >= MIN_PRODUCT  # four digits: one shape of answer to copy
        assert row["data_source"] == CALCULATOR_DATA_SOURCE and row["agent_name"] == "tool_agent"
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(answer)}
        assert row["extra_info"] == {"split": "train", "index": index, "question": match[0], "answer": answer}
    assert len(questions(rows)) == len(rows)


def test_deterministic_prefix_stable_and_disjoint_splits():
    assert make_calculator_rows(40, 0, "test") == make_calculator_rows(60, 0, "test")[:40]
    assert make_calculator_rows(40, 0, "test") != make_calculator_rows(40, 1, "test")
    assert not questions(make_calculator_rows(4096, 0, "train")) & questions(make_calculator_rows(256, 0, "test"))
    with pytest.raises(ValueError, match="split"):
        make_calculator_rows(1, 0, "val")


def test_warm_start_mixes_direct_answers_and_tool_calls_the_calculator_answers():
    rows = make_calculator_rows(2000, 0, "train")
    pairs = calculator_sft_pairs(rows, tool_call_rate=0.25)
    conversations = [(row, completion) for row, (_, completion) in zip(rows, pairs) if isinstance(completion, list)]
    assert 0.2 < len(conversations) / len(rows) < 0.3
    assert all(completion == row["reward_model"]["ground_truth"] for row, (_, completion) in zip(rows, pairs)
               if isinstance(completion, str))  # direct answers are right: the model just cannot learn them
    tools = ToolRegistry([calculator])
    for row, (call, reply, answer) in conversations[:20]:
        (parsed,) = HermesToolParser().parse(call["content"]).items
        assert isinstance(parsed, ToolCall)
        result = asyncio.run(tools.call(parsed))
        # The example shows exactly what the tool will say, and the answer copies it.
        assert result.text == reply["content"] == answer["content"] == row["reward_model"]["ground_truth"]
        assert [call["role"], reply["role"], answer["role"]] == ["assistant", "tool", "assistant"]
    assert calculator_sft_pairs(rows[:50], 0.0) == [(r["prompt"], r["reward_model"]["ground_truth"]) for r in rows[:50]]
    assert all(uses_tool(q, 1.0) for q in questions(rows[:50]))


def test_tool_call_text_is_compact_hermes():
    assert tool_call_text("47*38") == '<tool_call>{"name":"calculator","arguments":{"expression":"47*38"}}</tool_call>'


def test_files_load_as_a_dataset_with_the_agent_column(tmp_path):
    train, test = write_calculator_task(tmp_path, train_size=32, val_size=8)
    ds = RLDataset.from_files([str(train)], build_tiny_tokenizer(), max_prompt_length=64)
    assert len(ds) == 32 and {row.agent_name for row in ds} == {"tool_agent"}
    assert ds[0].row_fields().as_dict()["agent_name"] == "tool_agent"
    assert write_calculator_task(tmp_path, train_size=32, val_size=8) == (train, test)

"""The built-in tool task: "What is 47 * 38?", answerable by calling the calculator tool.

Why this task: the built-in tiny model cannot multiply two-digit numbers in its head, but it
can learn to *call the calculator and copy its result*.
So the reward is low for a direct answer and high for a tool call, and RL with the tool agent
has something to find: raise the tool-call rate, and with it the reward.

Rows are in verl's schema with ``agent_name: tool_agent`` (the loop that runs them) and
``data_source: hybridflow/calculator`` (an exact-integer reward on the final answer). The
prompt names no tool: the tiny model's chat template does not render tool schemas, and the
warm start teaches the one call format the task needs (Hermes ``<tool_call>`` JSON).

The warm start ends on a mix of two kinds of examples (``calculator_sft_pairs``): a direct
answer (the correct number, which the model cannot compute, so its own direct answers are
mostly wrong) and, for a fixed fraction of the questions, the tool-using conversation
``<tool_call>{...}</tool_call>`` → tool result → the result copied. Which questions get the
tool call is decided by a hash, so the model learns a tool-call *rate*, not a rule. Before
that mix comes a stage of tool-using conversations only (``calculator_warm_start``), because
copying is learned only from many of them (see ``TOOL_ONLY_SHARE``).

Splits: questions come from a seeded generator; a hash of each question puts 1 in
``TEST_SHARE`` of them in the test split and the rest in the train split, so the splits never
share a question, and a split's first ``n`` rows stay the same when ``n`` grows.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from hybridflow.data.writing import verl_row, verl_row_schema, write_train_test

CALCULATOR_DATA_SOURCE = "hybridflow/calculator"
CALCULATOR_ABILITY = "arithmetic"
CALCULATOR_AGENT = "tool_agent"  # hybridflow.agents AGENT_LOOPS name
TOOL_NAME = "calculator"  # the built-in tool (hybridflow.agents.tools.calculator)
SPLITS = ("train", "test")
TEST_SHARE = 16  # one question in 16 belongs to the test split
# Products of two two-digit numbers with a four-digit result: far beyond the 0.9M-parameter
# model (it needs about 500 SFT steps for carry-free two-digit sums), while a copied calculator
# result is always right. One shape of question and of answer means each character the model
# copies (the operands into the call, the result into the answer) comes from a fixed distance
# back, the easiest kind of copy for it to learn. 6,610 questions.
OPERAND_RANGE = (11, 99)
MIN_PRODUCT = 1000
# The warm start is a curriculum: this share of its steps shows tool-using conversations only,
# the rest mixes in direct answers. Copying is what the tiny model finds hard, and it learns it
# abruptly, after about 350 steps of 32 tool-using conversations at lr 2e-3 (exact episodes:
# 0% at step 300, 55% at 350, 86% at 500; another shuffle: 0% at 350, 63% at 450, 75% at 500),
# later or not at all at lr 3e-3 or 6e-3, and not within 600 steps when only a quarter of
# each batch shows a tool call. The mixed stage then sets the tool-call rate in about 100 steps;
# at half the learning rate it keeps the copying (80% exact), at the full rate it first loses
# most of it (4% after 50 steps).
TOOL_ONLY_SHARE = 0.8
MIXED_STAGE_LR_SCALE = 0.5

_SCHEMA = verl_row_schema(
    [("split", pa.string()), ("index", pa.int64()), ("question", pa.string()), ("answer", pa.int64())], agent_name=True
)

Problem = tuple[int, str, int]  # (a, op, b)
Message = dict[str, Any]


def _fraction(text: str) -> float:
    """A number in [0, 1) from a hash of ``text``: the same on every platform and Python."""
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _draw(rng: random.Random) -> Problem:
    while True:
        a, b = rng.randint(*OPERAND_RANGE), rng.randint(*OPERAND_RANGE)
        if a * b >= MIN_PRODUCT:
            return a, "*", b


def question_text(a: int, op: str, b: int) -> str:
    """The user message, e.g. ``What is 47 * 38?`` (the arithmetic task's wording)."""
    return f"What is {a} {op} {b}?"


def _split_of(question: str, seed: int) -> str:
    return "test" if _fraction(f"split|{seed}|{question}") < 1 / TEST_SHARE else "train"


def _problems(seed: int, split: str) -> Iterator[Problem]:
    """Distinct problems of ``split`` in a fixed order. ``random.Random`` seeded with a string
    hashes it with SHA-512, so the order is the same on every platform."""
    rng = random.Random(f"hybridflow-calculator|{seed}")
    seen: set[Problem] = set()
    while True:
        problem = _draw(rng)
        if problem not in seen and _split_of(question_text(*problem), seed) == split:
            seen.add(problem)
            yield problem


def make_calculator_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """``n`` distinct problems of ``split`` ("train" or "test") as rows in verl's schema."""
    if split not in SPLITS:
        raise ValueError(f"calculator split must be one of {SPLITS}, got {split!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"make_calculator_rows: n must be a non-negative int, got {n!r}")
    rows = []
    for index, (a, op, b) in zip(range(n), _problems(seed, split)):
        question, answer = question_text(a, op, b), a * b
        rows.append(verl_row(CALCULATOR_DATA_SOURCE, question, CALCULATOR_ABILITY, str(answer),
                             {"split": split, "index": index, "question": question, "answer": answer},
                             agent_name=CALCULATOR_AGENT))
    return rows


def write_calculator_task(
    out_dir: str | os.PathLike[str], train_size: int = 4096, val_size: int = 256, seed: int = 0
) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir`` (idempotent, atomic)."""
    return write_train_test(out_dir, _SCHEMA, make_calculator_rows, train_size, val_size, seed)


def tool_call_text(expression: str) -> str:
    """A Hermes-format call of the calculator, compact JSON: every character is a token the
    byte-level model has to generate."""
    call = {"name": TOOL_NAME, "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def expression_of(question: str) -> str:
    """``What is 47 * 38?`` -> ``47*38``: the operands copied from the question."""
    return question.removeprefix("What is ").removesuffix("?").replace(" ", "")


def uses_tool(question: str, tool_call_rate: float) -> bool:
    """Whether the warm start shows a tool call for this question (a fixed, arbitrary-looking
    fraction ``tool_call_rate`` of the questions)."""
    return _fraction(f"tool|{question}") < tool_call_rate


def calculator_sft_pairs(
    rows: list[dict[str, Any]], tool_call_rate: float
) -> list[tuple[list[Message], str | list[Message]]]:
    """(prompt messages, completion) per row for the warm start.

    The completion is the bare answer (a direct answer), or, for ``tool_call_rate`` of the
    questions, the turns of a tool-using episode: the call, the tool's reply (the exact value,
    as the built-in calculator writes it) and the reply copied as the answer.
    """
    if not 0.0 <= tool_call_rate <= 1.0:
        raise ValueError(f"calculator_sft_pairs: tool_call_rate must be in [0, 1], got {tool_call_rate}")
    pairs: list[tuple[list[Message], str | list[Message]]] = []
    for row in rows:
        messages = [dict(m) for m in row["prompt"]]
        question, answer = str(messages[-1]["content"]), str(row["reward_model"]["ground_truth"])
        if not uses_tool(question, tool_call_rate):
            pairs.append((messages, answer))
            continue
        turns: list[Message] = [
            {"role": "assistant", "content": tool_call_text(expression_of(question))},
            {"role": "tool", "name": TOOL_NAME, "content": answer},
            {"role": "assistant", "content": answer},
        ]
        pairs.append((messages, turns))
    return pairs


def calculator_warm_start(
    rows: list[dict[str, Any]], tool_call_rate: float
) -> tuple[list[tuple[list[Message], str | list[Message]]], list[tuple[list[Message], str | list[Message]]]]:
    """The warm start's two stages: every row as a tool-using conversation (``TOOL_ONLY_SHARE``
    of the steps), then the mix of direct answers and conversations at ``tool_call_rate``."""
    return calculator_sft_pairs(rows, 1.0), calculator_sft_pairs(rows, tool_call_rate)

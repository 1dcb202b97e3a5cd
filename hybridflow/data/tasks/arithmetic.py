"""The built-in task: "What is 23 + 45?", generated deterministically, in verl's row schema.

Why this task: a tiny model learns it in minutes on a CPU, its reward is exact, and RL has
something to improve (two-digit carries are hard for a model that only saw a short warm
start). It is the default run's data, so it must never need a download.

The question space is every ``a + b`` and every ``a - b`` with ``a >= b`` (no negative
answers) for operands 0..99: 10,000 + 5,050 = 15,050 distinct questions, answers in 0..198.
The space is put in a seeded order (a hash of seed and question, so the order is the same on
every platform and Python version) and cut once into a test pool and a train pool. Each split
draws from its own pool only, so train and test never share a question, whatever sizes are
asked for, and a split's first ``n`` rows stay the same when ``n`` grows.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pyarrow as pa

from hybridflow.data.writing import write_parquet_atomic

ARITHMETIC_DATA_SOURCE = "hybridflow/arithmetic"
ARITHMETIC_ABILITY = "arithmetic"
MAX_OPERAND = 99  # operands have one or two digits
OPERATORS = ("+", "-")
SPLITS = ("train", "test")
# Held-out pool: room for validation sets of up to 2,048 questions while leaving 13,002 for
# training, three times the default train size (4,096).
TEST_POOL_SIZE = 2048

_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [("split", pa.string()), ("index", pa.int64()), ("question", pa.string()), ("answer", pa.int64())]
            ),
        ),
    ]
)

Problem = tuple[int, str, int]  # (a, op, b)


def format_arithmetic_question(a: int, op: str, b: int) -> str:
    """The user message for one problem, e.g. ``What is 23 + 45?``."""
    if op not in OPERATORS:
        raise ValueError(f"arithmetic operator must be one of {OPERATORS}, got {op!r}")
    for name, value in (("a", a), ("b", b)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"arithmetic operand {name} must be an int, got {value!r}")
    return f"What is {a} {op} {b}?"


def _answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def _all_problems() -> list[Problem]:
    problems: list[Problem] = []
    for a in range(MAX_OPERAND + 1):
        for b in range(MAX_OPERAND + 1):
            problems.append((a, "+", b))
            if a >= b:
                problems.append((a, "-", b))
    return problems


def _seeded_order(seed: int) -> list[Problem]:
    def key(problem: Problem) -> bytes:
        return hashlib.sha256(f"{seed}|{format_arithmetic_question(*problem)}".encode()).digest()

    return sorted(_all_problems(), key=key)


def _split_pool(seed: int, split: str) -> list[Problem]:
    if split not in SPLITS:
        raise ValueError(f"arithmetic split must be one of {SPLITS}, got {split!r}")
    order = _seeded_order(seed)
    return order[:TEST_POOL_SIZE] if split == "test" else order[TEST_POOL_SIZE:]


def make_arithmetic_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """``n`` distinct problems of ``split`` ("train" or "test") as rows in verl's schema.

    The same arguments always give the same rows; the two splits never share a question.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"make_arithmetic_rows: n must be a non-negative int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"make_arithmetic_rows: seed must be an int, got {seed!r}")
    pool = _split_pool(seed, split)
    if n > len(pool):
        raise ValueError(
            f"make_arithmetic_rows: asked for {n} {split} rows but the {split} split has only "
            f"{len(pool)} distinct questions"
        )
    rows = []
    for index, (a, op, b) in enumerate(pool[:n]):
        question = format_arithmetic_question(a, op, b)
        answer = _answer(a, op, b)
        rows.append(
            {
                "data_source": ARITHMETIC_DATA_SOURCE,
                "prompt": [{"role": "user", "content": question}],
                "ability": ARITHMETIC_ABILITY,
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
            }
        )
    return rows


def write_arithmetic_task(
    out_dir: str | os.PathLike[str],
    train_size: int = 4096,
    val_size: int = 256,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir``; return their paths.

    Idempotent (same arguments, same bytes) and atomic (each file appears complete or not at
    all), so concurrent processes may call it on the same directory.
    """
    out = Path(out_dir).expanduser()
    train_rows = make_arithmetic_rows(train_size, seed, "train")
    test_rows = make_arithmetic_rows(val_size, seed, "test")
    train_path = write_parquet_atomic(train_rows, _SCHEMA, out / "train.parquet")
    test_path = write_parquet_atomic(test_rows, _SCHEMA, out / "test.parquet")
    return train_path, test_path


def arithmetic_sft_pairs(rows: list[dict[str, Any]]) -> list[tuple[list[dict[str, Any]], str]]:
    """(prompt messages, answer text) for each row, for the supervised warm start.

    The answer text is the bare number (the ground truth): the shortest correct response, so
    the warm start teaches the answer format without teaching any extra text.
    """
    pairs: list[tuple[list[dict[str, Any]], str]] = []
    for i, row in enumerate(rows):
        try:
            messages = row["prompt"]
            answer = row["reward_model"]["ground_truth"]
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"arithmetic_sft_pairs: row {i} is not in the task's schema (needs 'prompt' and "
                f"'reward_model.ground_truth'): missing {exc}"
            ) from exc
        pairs.append(([dict(m) for m in messages], str(answer)))
    return pairs

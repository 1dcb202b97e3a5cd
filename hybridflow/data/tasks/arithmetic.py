"""The built-in task: "What is 23 + 45?", generated deterministically, in verl's row schema.

Why this task: a tiny model learns it in minutes on a CPU, its reward is exact, and RL has
something to improve. It is the default run's data, so it must never need a download.

The problems are *digit-wise*: sums without a carry and differences without a borrow, operands
0..99 (no negative answers). Each answer digit then depends only on the two digits above it,
a skill the 0.8M-parameter built-in model picks up within a few hundred SFT steps (18% greedy
accuracy after 300 steps, 85% after 500, measured with scripts/make_warm_start.py). With
carries it reached 16% after 600 steps (lr 1e-3) and plateaued near 6% at lr 3e-3 over 1,250
steps: too slow for a laptop demo. Carries are what a calculator tool is
for, which is the agent task's business. 3,025 sums + 3,025 differences = 6,050 distinct
questions.
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

from hybridflow.data.writing import verl_row, verl_row_schema, write_train_test

ARITHMETIC_DATA_SOURCE = "hybridflow/arithmetic"
ARITHMETIC_ABILITY = "arithmetic"
MAX_OPERAND = 99  # operands have one or two digits
OPERATORS = ("+", "-")
SPLITS = ("train", "test")
# Held-out pool: room for validation sets of up to 1,024 questions while leaving 5,026 for
# training, more than the default train size (4,096).
TEST_POOL_SIZE = 1024
NUM_PROBLEMS = 6050  # 3,025 carry-free sums + 3,025 borrow-free differences
ARITHMETIC_TRAIN_QUESTIONS = NUM_PROBLEMS - TEST_POOL_SIZE  # the train split's pool: the most train rows

_SCHEMA = verl_row_schema(
    [("split", pa.string()), ("index", pa.int64()), ("question", pa.string()), ("answer", pa.int64())]
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


def _digit_wise(a: int, op: str, b: int) -> bool:
    """True when the problem needs no carry (addition) or borrow (subtraction): each answer
    digit depends only on the two digits above it."""
    ones_a, tens_a, ones_b, tens_b = a % 10, a // 10, b % 10, b // 10
    if op == "+":
        return ones_a + ones_b <= 9 and tens_a + tens_b <= 9
    return a >= b and ones_a >= ones_b


def _all_problems() -> list[Problem]:
    return [
        (a, op, b)
        for a in range(MAX_OPERAND + 1)
        for b in range(MAX_OPERAND + 1)
        for op in OPERATORS
        if _digit_wise(a, op, b)
    ]


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
        rows.append(verl_row(ARITHMETIC_DATA_SOURCE, question, ARITHMETIC_ABILITY, str(answer),
                             {"split": split, "index": index, "question": question, "answer": answer}))
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
    return write_train_test(out_dir, _SCHEMA, make_arithmetic_rows, train_size, val_size, seed)


def teacher_slips(question: str, slip_rate: float) -> bool:
    """Whether the flawed teacher slips on this question: a fixed fraction ``slip_rate`` of
    questions, chosen by a hash so the choice looks arbitrary to the model."""
    digest = hashlib.sha256(f"slip|{question}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < slip_rate


def slipped_answer(answer: int) -> int:
    """The teacher's systematic slip: the last digit one too high (9 wraps to 0, staying
    within the digit-wise answers)."""
    return answer - 9 if answer % 10 == 9 else answer + 1


def arithmetic_sft_pairs(
    rows: list[dict[str, Any]], slip_rate: float = 0.0
) -> list[tuple[list[dict[str, Any]], str]]:
    """(prompt messages, answer text) for each row, for the supervised warm start.

    The answer text is the bare number: the shortest response, so the warm start teaches the
    answer format without extra text. With ``slip_rate`` > 0 the answers come from a *flawed
    teacher* that writes ``slipped_answer`` on that fraction of the questions. A model imitating
    it learns the skill and the slip together, so its greedy answer is often wrong while its
    samples are often right: the situation RL with an exact reward is for (a verifier fixing a
    biased SFT policy), and what makes the built-in run show RL's effect within minutes.
    """
    if not 0.0 <= slip_rate < 1.0:
        raise ValueError(f"arithmetic_sft_pairs: slip_rate must be in [0, 1), got {slip_rate}")
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
        question = str(messages[-1]["content"]) if messages else ""
        if slip_rate > 0 and teacher_slips(question, slip_rate):
            answer = slipped_answer(int(answer))
        pairs.append(([dict(m) for m in messages], str(answer)))
    return pairs

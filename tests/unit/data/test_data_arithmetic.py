"""The built-in arithmetic task: exact format, determinism, disjoint splits, loadable rows."""

from __future__ import annotations

import re

import pytest

from hybridflow.data.dataset import RLDataset
from hybridflow.data.row_files import load_rows
from hybridflow.data.tasks.arithmetic import (
    ARITHMETIC_DATA_SOURCE,
    NUM_PROBLEMS,
    TEST_POOL_SIZE,
    arithmetic_sft_pairs,
    format_arithmetic_question,
    make_arithmetic_rows,
    write_arithmetic_task,
)
from hybridflow.models.tiny import build_tiny_tokenizer

QUESTION = re.compile(r"What is (\d{1,2}) ([+-]) (\d{1,2})\?")


def questions(rows) -> list[str]:
    return [r["prompt"][0]["content"] for r in rows]


def test_question_format():
    assert format_arithmetic_question(23, "+", 45) == "What is 23 + 45?"
    assert format_arithmetic_question(7, "-", 0) == "What is 7 - 0?"
    with pytest.raises(ValueError, match="operator"):
        format_arithmetic_question(1, "*", 2)


def test_rows_are_correct_problems_in_schema():
    rows = make_arithmetic_rows(500, seed=0, split="train")
    for index, row in enumerate(rows):
        match = QUESTION.fullmatch(row["prompt"][0]["content"])
        assert match, row
        a, op, b = int(match[1]), match[2], int(match[3])
        answer = a + b if op == "+" else a - b
        assert op == "+" or a >= b
        assert 0 <= answer <= 198
        assert row["data_source"] == ARITHMETIC_DATA_SOURCE
        assert row["ability"] == "arithmetic"
        assert row["prompt"] == [{"role": "user", "content": row["extra_info"]["question"]}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(answer)}
        assert row["extra_info"] == {"split": "train", "index": index, "question": match[0], "answer": answer}
    assert {r["prompt"][0]["content"].split()[3] for r in rows} == {"+", "-"}
    assert len(set(questions(rows))) == len(rows)


def test_generation_is_deterministic_and_prefix_stable():
    assert make_arithmetic_rows(50, 1, "test") == make_arithmetic_rows(50, 1, "test")
    assert make_arithmetic_rows(50, 1, "test") == make_arithmetic_rows(80, 1, "test")[:50]
    assert make_arithmetic_rows(50, 1, "test") != make_arithmetic_rows(50, 2, "test")


def test_splits_never_share_a_question_even_at_full_size():
    test = set(questions(make_arithmetic_rows(TEST_POOL_SIZE, 0, "test")))
    train_rows = make_arithmetic_rows(NUM_PROBLEMS - TEST_POOL_SIZE, 0, "train")
    train = set(questions(train_rows))
    assert len(test) == TEST_POOL_SIZE and len(train) == len(train_rows)
    assert not test & train
    assert len(test | train) == NUM_PROBLEMS  # the whole digit-wise space


def test_asking_for_more_than_a_split_holds_is_an_error():
    with pytest.raises(ValueError, match=f"only {TEST_POOL_SIZE} distinct questions"):
        make_arithmetic_rows(TEST_POOL_SIZE + 1, 0, "test")
    with pytest.raises(ValueError, match="split must be one of"):
        make_arithmetic_rows(1, 0, "validation")


def test_written_files_are_byte_identical_and_idempotent(tmp_path):
    a_train, a_test = write_arithmetic_task(tmp_path / "a", train_size=64, val_size=16, seed=3)
    b_train, b_test = write_arithmetic_task(tmp_path / "b", train_size=64, val_size=16, seed=3)
    assert (a_train.name, a_test.name) == ("train.parquet", "test.parquet")
    assert a_train.read_bytes() == b_train.read_bytes()
    assert a_test.read_bytes() == b_test.read_bytes()

    first = a_train.read_bytes()
    write_arithmetic_task(tmp_path / "a", train_size=64, val_size=16, seed=3)
    assert a_train.read_bytes() == first
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["test.parquet", "train.parquet"]  # no temp files
    assert load_rows(a_train) == make_arithmetic_rows(64, 3, "train")


def test_written_rows_load_through_rl_dataset(tmp_path):
    train, test = write_arithmetic_task(tmp_path, train_size=32, val_size=8)
    tokenizer = build_tiny_tokenizer()
    ds = RLDataset.from_files([train], tokenizer, max_prompt_length=64)
    assert len(ds) == 32 and ds.stats.num_filtered_overlong == 0
    assert ds[0].data_source == ARITHMETIC_DATA_SOURCE
    assert ds[0].ground_truth == str(ds[0].extra_info["answer"])
    assert len(RLDataset.from_files([test], tokenizer, max_prompt_length=64)) == 8


def test_sft_pairs_are_messages_and_answer_text():
    rows = make_arithmetic_rows(3, 0, "train")
    pairs = arithmetic_sft_pairs(rows)
    assert [answer for _, answer in pairs] == [r["reward_model"]["ground_truth"] for r in rows]
    assert pairs[0][0] == rows[0]["prompt"]
    with pytest.raises(ValueError, match="row 0 is not in the task's schema"):
        arithmetic_sft_pairs([{"prompt": []}])

"""RLDataset and load_rows: good files, each malformed-row kind, overlong prompts."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data.dataset import RLDataset
from hybridflow.data.row_files import MAX_ROW_DEPTH, BadRowReason, DataError, load_rows
from hybridflow.models.tiny import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def good_row(i: int, content: str | None = None) -> dict[str, Any]:
    return {
        "data_source": "test/source",
        "prompt": [{"role": "user", "content": content if content is not None else f"question {i}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"index": i},
    }


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def template_ids(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------------------------
# Good files


def test_parquet_rows_are_validated_and_chat_templated(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "train.parquet", [good_row(i) for i in range(3)])
    ds = RLDataset.from_files([str(path)], tokenizer, max_prompt_length=64)

    assert len(ds) == 3
    row = ds[1]
    assert row.messages == [{"role": "user", "content": "question 1"}]
    assert row.prompt_ids == template_ids(tokenizer, row.messages)
    assert row.data_source == "test/source"
    assert row.ground_truth == "1"
    assert row.ability == "math"
    assert row.extra_info == {"index": 1}
    assert row.source == f"{path}:1"
    assert row.row_fields().as_dict()["ground_truth"] == "1"
    assert ds.stats.num_rows == 3 and ds.stats.num_kept == 3
    assert ds.stats.bad_rows == {} and ds.stats.num_filtered_overlong == 0
    assert [r.ground_truth for r in ds] == ["0", "1", "2"]


def test_jsonl_blank_lines_and_optional_fields(tmp_path, tokenizer):
    minimal = {"data_source": "s", "prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": 7}}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(good_row(0)) + "\n\n" + json.dumps(minimal) + "\n\n", encoding="utf-8")
    ds = RLDataset.from_files(path, tokenizer, max_prompt_length=64)

    assert len(ds) == 2
    assert ds[1].ground_truth == "7"
    assert ds[1].ability == "" and ds[1].extra_info == {}
    assert ds[1].source == f"{path}:1"  # row index, not line number (line 3)


def test_agent_name_and_tools_kwargs_reach_the_trajectory_metadata(tmp_path, tokenizer):
    """verl's agent rows: a top-level agent_name column (null in rows without one, as parquet
    stores it) and per-row tool arguments inside extra_info."""
    tools_kwargs = {"calculator": {"create_kwargs": {"ground_truth": "0"}}}
    rows = [
        {**good_row(0), "agent_name": "tool_agent", "extra_info": {"index": 0, "tools_kwargs": tools_kwargs}},
        {**good_row(1), "agent_name": None},
    ]
    ds = RLDataset.from_files([str(write_parquet(tmp_path / "agent.parquet", rows))], tokenizer, max_prompt_length=64)
    first, second = ds[0].row_fields().as_dict(), ds[1].row_fields().as_dict()
    assert ds[0].agent_name == "tool_agent" and first["agent_name"] == "tool_agent"
    assert first["extra_info"]["tools_kwargs"] == tools_kwargs
    assert ds[1].agent_name is None and "agent_name" not in second  # the run's default loop


def test_json_lines_and_json_array_files(tmp_path, tokenizer):
    lines = write_jsonl(tmp_path / "a.json", [good_row(0), good_row(1)])
    array = tmp_path / "b.json"
    array.write_text(json.dumps([good_row(2), good_row(3)], indent=2), encoding="utf-8")
    ds = RLDataset.from_files([lines, array], tokenizer, max_prompt_length=64)
    assert [r.ground_truth for r in ds] == ["0", "1", "2", "3"]
    assert ds[2].source == f"{array}:0"
    assert "4 prompts from 2 file(s)" in ds.describe()


@pytest.mark.parametrize(
    ("ground_truth", "expected"),
    [("42", "42"), (42, "42"), (72.0, "72"), (0.5, "0.5"), (["a", 1], '["a", 1]'),
     ({"target": ["Paris"]}, '{"target": ["Paris"]}')],  # verl's search-R1 rows
)
def test_ground_truth_is_stored_as_text(tmp_path, tokenizer, ground_truth, expected):
    row = good_row(0)
    row["reward_model"]["ground_truth"] = ground_truth
    ds = RLDataset.from_files(write_jsonl(tmp_path / "t.jsonl", [row]), tokenizer, max_prompt_length=64)
    assert ds[0].ground_truth == expected


def test_custom_prompt_key(tmp_path, tokenizer):
    row = good_row(0)
    row["messages"] = row.pop("prompt")
    path = write_jsonl(tmp_path / "t.jsonl", [row])
    assert RLDataset.from_files(path, tokenizer, max_prompt_length=64, prompt_key="messages")[0].messages
    with pytest.raises(DataError, match=r"no row has the prompt column 'prompt' \(columns: .*messages"):
        RLDataset.from_files(path, tokenizer, max_prompt_length=64, on_bad_row="skip")


# --------------------------------------------------------------------------------------------
# Malformed rows, one kind at a time


def _set(path: tuple[str, ...], value: Any):
    def mutate(row: dict[str, Any]) -> Any:
        target = row
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return row

    return mutate


def _delete(key: str):
    def mutate(row: dict[str, Any]) -> Any:
        del row[key]
        return row

    return mutate


MALFORMED = [
    (_delete("prompt"), BadRowReason.PROMPT_MISSING, "'prompt' is missing"),
    (_set(("prompt",), "What is 1 + 1?"), BadRowReason.PROMPT_INVALID, "got a plain string"),
    (_set(("prompt",), []), BadRowReason.PROMPT_INVALID, "'prompt' is an empty list"),
    (_set(("prompt",), {"role": "user"}), BadRowReason.PROMPT_INVALID, "must be a list of chat messages, got dict"),
    (_set(("prompt",), ["hi"]), BadRowReason.MESSAGE_INVALID, "'prompt' message 0 is not a dict (got str)"),
    (_set(("prompt",), [{"role": "user"}]), BadRowReason.MESSAGE_INVALID, "'prompt' message 0 has no 'content'"),
    (_set(("prompt",), [{"content": "x"}]), BadRowReason.MESSAGE_INVALID, "'prompt' message 0 has no 'role'"),
    (
        _set(("prompt",), [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]),
        BadRowReason.MESSAGE_INVALID,
        "'prompt' message 1 'content' must be a string, got int",
    ),
    (_set(("prompt",), [{"role": "bot", "content": "x"}]), BadRowReason.ROLE_INVALID, "has role 'bot'; expected"),
    (_delete("data_source"), BadRowReason.DATA_SOURCE_MISSING, "'data_source' is missing"),
    (_set(("data_source",), 3), BadRowReason.DATA_SOURCE_INVALID, "'data_source' must be a non-empty string"),
    (_set(("ability",), 1), BadRowReason.ABILITY_INVALID, "'ability' must be a string, got int"),
    (_delete("reward_model"), BadRowReason.REWARD_MODEL_MISSING, "'reward_model' is missing"),
    (_set(("reward_model",), "42"), BadRowReason.REWARD_MODEL_INVALID, "'reward_model' must be a dict"),
    (_set(("reward_model",), {"style": "rule"}), BadRowReason.GROUND_TRUTH_MISSING, "has no 'ground_truth'"),
    (_set(("reward_model", "ground_truth"), {}), BadRowReason.GROUND_TRUTH_INVALID, "is an empty mapping"),
    (_set(("reward_model", "ground_truth"), True), BadRowReason.GROUND_TRUTH_INVALID, "got bool"),
    (_set(("reward_model", "ground_truth"), " "), BadRowReason.GROUND_TRUTH_INVALID, "is an empty string"),
    (_set(("extra_info",), [1]), BadRowReason.EXTRA_INFO_INVALID, "'extra_info' must be a dict, got list"),
    (_set(("agent_name",), 7), BadRowReason.AGENT_NAME_INVALID, "'agent_name' must name an agent loop"),
    (_set(("agent_name",), " "), BadRowReason.AGENT_NAME_INVALID, "'agent_name' must name an agent loop"),
    (lambda row: [row], BadRowReason.NOT_AN_OBJECT, "expected an object, got list"),
]
MALFORMED_IDS = [f"{reason}-{i}" for i, (_, reason, _) in enumerate(MALFORMED)]


def _file_with_bad_row_2(tmp_path: Path, mutate) -> Path:
    rows = [good_row(i) for i in range(4)]
    rows[2] = mutate(copy.deepcopy(rows[2]))
    return write_jsonl(tmp_path / "train.jsonl", rows)


@pytest.mark.parametrize(("mutate", "reason", "message"), MALFORMED, ids=MALFORMED_IDS)
def test_malformed_row_strict_names_file_row_and_problem(tmp_path, tokenizer, mutate, reason, message):
    path = _file_with_bad_row_2(tmp_path, mutate)
    with pytest.raises(DataError) as info:
        RLDataset.from_files([path], tokenizer, max_prompt_length=64)
    text = str(info.value)
    assert text.startswith(f"{path} row 2 (line 3): "), text
    assert message in text


@pytest.mark.parametrize(("mutate", "reason", "message"), MALFORMED, ids=MALFORMED_IDS)
def test_malformed_row_skip_drops_and_counts_by_reason(tmp_path, tokenizer, caplog, mutate, reason, message):
    path = _file_with_bad_row_2(tmp_path, mutate)
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.dataset"):
        ds = RLDataset.from_files([path], tokenizer, max_prompt_length=64, on_bad_row="skip")
    assert [r.ground_truth for r in ds] == ["0", "1", "3"]
    assert ds.stats.bad_rows == {reason: 1}
    assert ds.stats.num_rows == 4 and ds.stats.num_kept == 3
    assert "skipped 1 malformed rows of 4" in caplog.text
    assert message in caplog.text


def test_invalid_json_line(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(good_row(0)) + "\n" + '{"prompt": [\n' + json.dumps(good_row(2)) + "\n")
    with pytest.raises(DataError, match=r"train\.jsonl row 1 \(line 2\): invalid JSON"):
        RLDataset.from_files(path, tokenizer, max_prompt_length=64)
    with pytest.raises(DataError, match=r"train\.jsonl row 1 \(line 2\): invalid JSON"):
        load_rows(path)
    ds = RLDataset.from_files(path, tokenizer, max_prompt_length=64, on_bad_row="skip")
    assert ds.stats.bad_rows == {BadRowReason.INVALID_JSON: 1} and len(ds) == 2


def test_skip_counts_mixed_reasons(tmp_path, tokenizer):
    rows: list[Any] = [good_row(i) for i in range(6)]
    del rows[1]["prompt"]
    del rows[3]["prompt"]
    rows[4]["extra_info"] = "oops"
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    ds = RLDataset.from_files(path, tokenizer, max_prompt_length=64, on_bad_row="skip")
    assert ds.stats.bad_rows == {"extra_info_invalid": 1, "prompt_missing": 2}
    assert len(ds) == 3
    assert "3 malformed skipped (extra_info_invalid=1, prompt_missing=2)" in ds.describe()


def test_parquet_message_without_content_names_row(tmp_path, tokenizer):
    rows = [good_row(i) for i in range(20)]
    rows[17]["prompt"] = [{"role": "user", "content": None}]
    path = write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError) as info:
        RLDataset.from_files([path], tokenizer, max_prompt_length=64)
    assert str(info.value) == f"{path} row 17: 'prompt' message 0 has no 'content'"


def test_parquet_null_ground_truth_and_nan(tmp_path, tokenizer):
    rows = [good_row(i) for i in range(3)]
    rows[0]["reward_model"]["ground_truth"] = None
    path = write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError, match=r"row 0: 'reward_model' has no 'ground_truth'"):
        RLDataset.from_files(path, tokenizer, max_prompt_length=64)

    nan_rows = [good_row(i) for i in range(2)]
    for i, r in enumerate(nan_rows):
        r["reward_model"]["ground_truth"] = float("nan") if i == 1 else 3.0
    ds = RLDataset.from_files(
        write_parquet(tmp_path / "nan.parquet", nan_rows), tokenizer, max_prompt_length=64, on_bad_row="skip"
    )
    assert [r.ground_truth for r in ds] == ["3"]
    assert ds.stats.bad_rows == {BadRowReason.GROUND_TRUTH_INVALID: 1}


def test_chat_template_failure_is_a_bad_row(tmp_path):
    strict_tokenizer = build_tiny_tokenizer()
    strict_tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    rows = [good_row(0), good_row(1)]
    rows[1]["prompt"].insert(0, {"role": "system", "content": "be brief"})
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(DataError, match=r"row 1 \(line 2\): the chat template failed: .*no system role"):
        RLDataset.from_files(path, strict_tokenizer, max_prompt_length=64)
    ds = RLDataset.from_files(path, strict_tokenizer, max_prompt_length=64, on_bad_row="skip")
    assert ds.stats.bad_rows == {BadRowReason.CHAT_TEMPLATE_FAILED: 1} and len(ds) == 1


# --------------------------------------------------------------------------------------------
# Overlong prompts


@pytest.fixture()
def mixed_length_file(tmp_path, tokenizer):
    contents = ["ab", "a much longer question that will not fit", "cd"]
    rows = [good_row(i, content=c) for i, c in enumerate(contents)]
    lengths = [len(template_ids(tokenizer, r["prompt"])) for r in rows]
    limit = max(lengths[0], lengths[2])
    assert lengths[1] > limit
    return write_jsonl(tmp_path / "train.jsonl", rows), rows, lengths, limit


def test_overlong_prompts_are_filtered_and_counted(mixed_length_file, tokenizer):
    path, _, _, limit = mixed_length_file
    ds = RLDataset.from_files(path, tokenizer, max_prompt_length=limit)
    assert [r.ground_truth for r in ds] == ["0", "2"]
    assert ds.stats.num_filtered_overlong == 1 and ds.stats.num_truncated == 0
    assert f"1 overlong filtered > {limit} tokens" in ds.describe()


@pytest.mark.parametrize("side", ["left", "right"])
def test_overlong_prompts_are_truncated(mixed_length_file, tokenizer, side):
    path, rows, _, limit = mixed_length_file
    ds = RLDataset.from_files(
        path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False, truncation=side
    )
    full = template_ids(tokenizer, rows[1]["prompt"])
    expected = full[-limit:] if side == "left" else full[:limit]
    assert len(ds) == 3
    assert ds[1].prompt_ids == expected
    assert ds[0].prompt_ids == template_ids(tokenizer, rows[0]["prompt"])  # short prompts untouched
    assert ds.stats.num_truncated == 1 and ds.stats.num_filtered_overlong == 0


def test_overlong_prompt_error_names_row_length_and_limit(mixed_length_file, tokenizer):
    path, _, lengths, limit = mixed_length_file
    with pytest.raises(DataError) as info:
        RLDataset.from_files(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False)
    assert str(info.value).startswith(
        f"{path} row 1 (line 2): prompt is {lengths[1]} tokens after the chat template, "
        f"over max_prompt_length {limit}"
    )


def test_empty_after_filtering_says_why(mixed_length_file, tokenizer):
    path, _, _, _ = mixed_length_file
    expected = r"no prompts left .*3 rows read, 3 filtered as longer than max_prompt_length 5, 0 skipped"
    with pytest.raises(DataError, match=expected):
        RLDataset.from_files(path, tokenizer, max_prompt_length=5)


# --------------------------------------------------------------------------------------------
# Files and arguments


def test_unknown_extension_and_missing_file(tmp_path, tokenizer):
    csv = tmp_path / "train.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match=r"train\.csv: unsupported file type '\.csv'; expected \.parquet, \.jsonl"):
        load_rows(csv)
    with pytest.raises(DataError, match=r"missing\.parquet: no such file"):
        RLDataset.from_files([tmp_path / "missing.parquet"], tokenizer, max_prompt_length=64)
    with pytest.raises(DataError, match="no files given"):
        RLDataset.from_files([], tokenizer, max_prompt_length=64)


def test_corrupt_parquet_is_a_clear_error(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"train\.parquet: not a readable parquet file"):
        load_rows(path)


def test_load_rows_returns_dicts_in_file_order(tmp_path):
    rows = [good_row(i) for i in range(3)]
    assert load_rows(write_parquet(tmp_path / "a.parquet", rows)) == rows
    assert load_rows(write_jsonl(tmp_path / "a.jsonl", rows)) == rows
    with pytest.raises(DataError, match=r"a2\.jsonl row 1 \(line 2\): expected an object, got int"):
        load_rows(write_jsonl(tmp_path / "a2.jsonl", [rows[0], 5]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"truncation": "middle"}, "truncation must be one of error, left, right"),
        ({"on_bad_row": "ignore"}, "on_bad_row must be one of error, skip"),
        ({"max_prompt_length": 0}, "max_prompt_length must be a positive int"),
    ],
)
def test_invalid_arguments(tmp_path, tokenizer, kwargs, message):
    path = write_jsonl(tmp_path / "t.jsonl", [good_row(0)])
    with pytest.raises(ValueError, match=message):
        RLDataset.from_files(path, tokenizer, **{"max_prompt_length": 64, **kwargs})


# --------------------------------------------------------------------------------------------
# Rows whose data_source no reward function scores (found at load time, not at the first step
# that samples them)


def test_a_row_without_a_scorer_is_named_at_load_time(tokenizer, tmp_path: Path) -> None:
    rows = [good_row(0), {**good_row(1), "data_source": "nobody/scores-this"}, good_row(2)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError) as info:
        RLDataset.from_files(path, tokenizer, max_prompt_length=64, data_sources={"test/source"})
    message = str(info.value)
    assert message.startswith(f"{path} row 1 (line 2): no reward function scores data_source 'nobody/scores-this'")
    assert "known: test/source" in message and "reward.custom_reward_function.path" in message


def test_skip_mode_counts_rows_without_a_scorer(tokenizer, tmp_path: Path) -> None:
    rows = [good_row(0), {**good_row(1), "data_source": "nobody/scores-this"}, good_row(2)]
    path = write_parquet(tmp_path / "train.parquet", rows)
    data = RLDataset.from_files(path, tokenizer, max_prompt_length=64, on_bad_row="skip", data_sources={"test/source"})
    assert [row.ground_truth for row in data] == ["0", "2"]
    assert data.stats.bad_rows == {BadRowReason.DATA_SOURCE_UNKNOWN: 1}
    # Without a set of scorable sources (a custom reward decides per call) every source loads.
    assert len(RLDataset.from_files(path, tokenizer, max_prompt_length=64)) == 3


# --------------------------------------------------------------------------------------------
# Hostile input: nesting, text that is not Unicode, files that are not files

DEEP = 200_000  # far past Python's recursion limit: json.loads raises RecursionError on it


def _deep_line(depth: int) -> str:
    """A good row whose containers nest ``depth`` deep (the row, extra_info, then lists): valid
    JSON, one line."""
    row = json.dumps(good_row(1) | {"extra_info": {"deep": None}})
    return row.replace("null", "[" * (depth - 2) + "]" * (depth - 2))


def _one_line_error(error: pytest.ExceptionInfo[DataError]) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("depth", [DEEP, 150], ids=["past-the-parser", "past-the-row-limit"])
def test_a_deeply_nested_line_is_a_bad_row_naming_file_and_row(tmp_path, tokenizer, depth):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(good_row(0)) + "\n" + _deep_line(depth) + "\n" + json.dumps(good_row(2)) + "\n")
    with pytest.raises(DataError) as error:
        RLDataset.from_files(path, tokenizer, max_prompt_length=64)
    text = _one_line_error(error)
    assert text.startswith(f"{path} row 1 (line 2): nested more than ") and "levels deep" in text
    with pytest.raises(DataError, match=r"train\.jsonl row 1 \(line 2\): nested more than"):
        load_rows(path)
    ds = RLDataset.from_files(path, tokenizer, max_prompt_length=64, on_bad_row="skip")
    assert ds.stats.bad_rows == {BadRowReason.NESTED_TOO_DEEP: 1}
    assert [r.ground_truth for r in ds] == ["0", "2"]
    assert "1 malformed skipped (nested_too_deep=1)" in ds.describe()


def test_the_depth_limit_counts_every_container(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text(_deep_line(MAX_ROW_DEPTH) + "\n" + _deep_line(MAX_ROW_DEPTH + 1) + "\n")
    ds = RLDataset.from_files(path, tokenizer, max_prompt_length=64, on_bad_row="skip")
    assert len(ds) == 1 and ds.stats.bad_rows == {BadRowReason.NESTED_TOO_DEEP: 1}
    assert ds.stats.num_rows == 2


def test_a_deeply_nested_json_array_file_names_the_file(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("[" * DEEP + "]" * DEEP)
    with pytest.raises(DataError) as error:
        load_rows(path)
    assert _one_line_error(error).startswith(f"{path}: nested more than ")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_set(("prompt",), [{"role": "user", "content": "one \ud800 two"}]), "'prompt[0].content'"),
        (_set(("prompt",), [{"role": "user", "content": "x"}, {"role": "user", "content": "\udfff"}]),
         "'prompt[1].content'"),
        (_set(("data_source",), "gsm8k\udc80"), "'data_source'"),
        (_set(("reward_model", "ground_truth"), "4\ud83d"), "'reward_model.ground_truth'"),
        (_set(("extra_info",), {"notes": ["ok", "bad \ud800"]}), "'extra_info.notes[1]'"),
    ],
    ids=["content", "second-message", "data_source", "ground_truth", "extra_info"],
)
def test_a_lone_surrogate_is_a_bad_row_naming_file_row_and_field(tmp_path, tokenizer, mutate, field):
    # json.dumps writes a lone surrogate as the escape "\ud800", which JSON allows and Python
    # reads back as a str that no tokenizer (and no UTF-8 writer) accepts.
    path = _file_with_bad_row_2(tmp_path, mutate)
    assert "\\ud" in path.read_text()
    with pytest.raises(DataError) as error:
        RLDataset.from_files([path], tokenizer, max_prompt_length=64)
    text = _one_line_error(error)
    assert text.startswith(f"{path} row 2 (line 3): {field} has a lone surrogate"), text
    assert "TypeError" not in text
    ds = RLDataset.from_files([path], tokenizer, max_prompt_length=64, on_bad_row="skip")
    assert ds.stats.bad_rows == {BadRowReason.TEXT_INVALID: 1}
    assert [r.ground_truth for r in ds] == ["0", "1", "3"]


def test_a_surrogate_pair_is_text(tmp_path, tokenizer):
    # "\ud83d\ude00" is how JSON escapes one emoji: Python joins the pair into one character.
    path = tmp_path / "emoji.jsonl"
    path.write_text(json.dumps(good_row(0)).replace("question 0", "smile \\ud83d\\ude00") + "\n")
    (row,) = RLDataset.from_files(path, tokenizer, max_prompt_length=64)
    assert row.messages[0]["content"] == "smile \U0001f600"
    path.write_text(json.dumps(good_row(0, content="a backslash, then ud800: \\ud800")) + "\n")
    (row,) = RLDataset.from_files(path, tokenizer, max_prompt_length=64)
    assert row.messages[0]["content"] == "a backslash, then ud800: \\ud800"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX named pipes")
@pytest.mark.parametrize("name", ["train.jsonl", "train.parquet"])
def test_a_fifo_is_not_a_regular_file(tmp_path, tokenizer, name):
    fifo = tmp_path / name
    os.mkfifo(fifo)  # opening it would block until a writer came: it must be refused unopened
    with pytest.raises(DataError) as error:
        RLDataset.from_files([fifo], tokenizer, max_prompt_length=64)
    assert _one_line_error(error).startswith(f"{fifo}: a FIFO (named pipe), not a regular file")
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    with pytest.raises(DataError, match=r"folder\.jsonl: a directory, not a regular file"):
        load_rows(folder)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX named pipes")
def test_the_config_check_says_a_fifo_is_not_a_regular_file(tmp_path):
    from hybridflow.config import ConfigError, load_config, validate_config

    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    cfg = load_config(overrides=[f"data.train_files=[{fifo}]", f"data.val_files=[{tmp_path / 'missing.jsonl'}]"])
    with pytest.raises(ConfigError) as error:
        validate_config(cfg)
    text = str(error.value)
    assert f"data.train_files[0]={str(fifo)!r} is a FIFO (named pipe), not a regular file" in text
    assert f"data.val_files[0]={str(tmp_path / 'missing.jsonl')!r} does not exist" in text

"""SFT examples: loss on assistant tokens only (multi-turn), both row schemas, truncation and
the errors a bad file gets."""

from __future__ import annotations

import json
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.config import load_config
from hybridflow.data.dataset import DataError
from hybridflow.data.sft import SFTColumns, assistant_masked_tokens, load_sft_examples, sft_example
from hybridflow.models.tiny import build_tiny_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "tool", "content": "calc: 8"},
    {"role": "assistant", "content": "8"},
]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def masked_text(tok, ids, mask, weight):
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m == weight])


def test_only_assistant_turns_carry_loss_in_a_multi_turn_conversation(tok):
    ids, mask = assistant_masked_tokens(tok, CONVERSATION)
    # The tokens are the template's rendering of the whole conversation, nothing added or lost.
    whole = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert tok.decode(ids) == whole
    # Each assistant turn's content and end-of-turn text count; its role header does not.
    assert masked_text(tok, ids, mask, 1) == "5<|im_end|>\n8<|im_end|>\n"
    context = masked_text(tok, ids, mask, 0)
    for masked_out in ("Be brief.", "What is 2 + 3?", "And 4 + 4?", "calc: 8", "<|im_start|>assistant\n"):
        assert masked_out in context


def test_the_trajectory_starts_its_response_at_the_first_assistant_token(tok):
    traj, truncated = sft_example(tok, CONVERSATION, max_length=None)
    assert traj is not None and not truncated
    assert tok.decode(traj.prompt_ids).endswith("<|im_start|>assistant\n")
    assert traj.loss_mask[0] == 1 and len(traj.loss_mask) == len(traj.response_ids)
    # The second user turn and the tool reply sit inside the response, masked out.
    assert "And 4 + 4?" in masked_text(tok, traj.response_ids, traj.loss_mask, 0)


def test_a_chat_template_override_is_used(tok):
    other = build_tiny_tokenizer()
    other.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>{% endfor %}"
                           "{% if add_generation_prompt %}[assistant] {% endif %}")
    ids, mask = assistant_masked_tokens(other, CONVERSATION[1:3])
    assert other.decode(ids) == "[user] What is 2 + 3?<|im_end|>[assistant] 5<|im_end|>"
    assert masked_text(other, ids, mask, 1) == "5<|im_end|>"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_response_columns_equal_the_same_messages(tok, tmp_path):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [
        {"question": "What is 2 + 3?", "answer": "5"},
        {"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "answer": "Hello"},
    ])
    conversations = tmp_path / "conv.parquet"
    pq.write_table(pa.table({"messages": [
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}],
    ]}), conversations)
    from_pairs, _ = load_sft_examples([pairs], tok, SFTColumns(prompt_key="question", response_key="answer"),
                                      max_length=None)
    from_messages, stats = load_sft_examples([str(conversations)], tok, SFTColumns(), max_length=None)
    assert stats.kept == stats.rows == 2
    assert [(t.prompt_ids, t.response_ids, t.loss_mask) for t in from_pairs] == [
        (t.prompt_ids, t.response_ids, t.loss_mask) for t in from_messages]


def test_a_missing_column_names_the_file_the_row_and_the_columns(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"text": "no columns"},
    ])
    with pytest.raises(DataError, match=r"bad.jsonl row 1 \(line 2\): no column 'messages'.*'text'"):
        load_sft_examples([path], tok, SFTColumns(), max_length=None)
    half = write_jsonl(tmp_path / "half.jsonl", [{"prompt": "a"}])
    with pytest.raises(DataError, match=r"half.jsonl row 0 \(line 1\): column 'response' is missing"):
        load_sft_examples([half], tok, SFTColumns(), max_length=None)


@pytest.mark.parametrize(("row", "message"), [
    ({"messages": [{"role": "user", "content": "a"}]}, "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "a"}]}, "column 'messages' message 0 has role 'robot'"),
    ({"messages": "hello"}, "column 'messages' must be a non-empty list"),
    ({"prompt": "a", "response": 3}, "column 'response' must be a string"),
])
def test_malformed_rows_are_named(tok, tmp_path, row, message):
    path = write_jsonl(tmp_path / "rows.jsonl", [row])
    with pytest.raises(DataError, match="rows.jsonl row 0") as info:
        load_sft_examples([path], tok, SFTColumns(), max_length=None)
    assert message in str(info.value)


def test_an_example_with_no_assistant_token_left_is_skipped_counted_and_warned(tok, tmp_path, caplog):
    long_prompt = {"prompt": "x" * 200, "response": "y"}
    short = {"prompt": "2+2", "response": "4"}
    path = write_jsonl(tmp_path / "mixed.jsonl", [long_prompt, short, long_prompt])
    with caplog.at_level(logging.WARNING):
        examples, stats = load_sft_examples([path], tok, SFTColumns(), max_length=64)
    assert len(examples) == stats.kept == 1 and stats.rows == 3
    assert sum(stats.skipped.values()) == 2
    assert "1 of 3 examples kept" in caplog.text and "no assistant token" in caplog.text
    # A kept example cut at max_length keeps its first assistant tokens.
    cut, truncated = sft_example(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "z" * 50}],
                                 max_length=30)
    assert truncated and cut is not None and len(cut.prompt_ids) + len(cut.response_ids) == 30
    with pytest.raises(DataError, match="sft.truncation=error"):
        sft_example(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "z" * 50}],
                    max_length=20, truncation="error")
    only_long = write_jsonl(tmp_path / "long.jsonl", [long_prompt])
    with pytest.raises(DataError, match="no usable SFT example"):
        load_sft_examples([only_long], tok, SFTColumns(), max_length=64)


def test_verl_sft_spellings_and_a_single_file_string():
    cfg = load_config("grpo", None, ["data.multiturn.messages_key=conversation", "data.response_key=output",
                                     "data.max_length=256", "data.train_files=train.parquet"])
    assert cfg.sft.messages_key == "conversation" and cfg.sft.response_key == "output"
    assert cfg.sft.max_length == 256 and cfg.data.train_files == ["train.parquet"]


# Hostile input: the reader is RLDataset's, the row checks are SFT's own.

@pytest.mark.parametrize(("line", "message"), [
    ('{"messages": ' + "[" * 200_000 + "]" * 200_000 + "}", "row 1 (line 2): nested more than "),
    (json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\ud800"}]}),
     "row 1 (line 2): 'messages[1].content' has a lone surrogate"),
    (json.dumps({"prompt": "a\udfff", "response": "b"}), "row 1 (line 2): 'prompt' has a lone surrogate"),
    (json.dumps({"prompt": "a", "response": "\udc00b"}), "row 1 (line 2): 'response' has a lone surrogate"),
])
def test_deep_nesting_and_lone_surrogates_are_one_line_errors_naming_the_row(tok, tmp_path, line, message):
    path = tmp_path / "rows.jsonl"
    good = {"prompt": "a", "response": "b"}
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(DataError) as info:
        load_sft_examples([path], tok, SFTColumns(), max_length=None)
    text = str(info.value)
    assert text.startswith(f"{path} {message}") and "\n" not in text, text
    # data.on_bad_row=skip drops that row, counts it and keeps the good one.
    examples, stats = load_sft_examples([path], tok, SFTColumns(), max_length=None, on_bad_row="skip")
    assert len(examples) == stats.kept == 1 and stats.skipped == {"malformed (data.on_bad_row=skip)": 1}


def test_a_fifo_is_not_a_regular_file(tok, tmp_path):
    fifo = tmp_path / "sft.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=r"sft\.jsonl: a FIFO \(named pipe\), not a regular file"):
        load_sft_examples([fifo], tok, SFTColumns(), max_length=None)

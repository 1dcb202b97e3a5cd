"""Preference pairs: TRL's three row forms from parquet and JSON lines, tokenised as SFT tokenises a
conversation; errors name file, row and column; data.on_bad_row=skip drops and counts a bad row."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data.row_files import DataError
from hybridflow.data.preference import PreferenceColumns, load_preference_pairs
from hybridflow.models.tiny import build_tiny_tokenizer

COLUMNS = PreferenceColumns()
USER = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def response_text(tok, traj):
    return tok.decode([i for i, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m])


def test_standard_conversational_and_implicit_prompt_rows_give_the_same_pair(tok, tmp_path):
    rows = [
        {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"},
        {"prompt": USER, "chosen": [{"role": "assistant", "content": "5"}],
         "rejected": [{"role": "assistant", "content": "6"}]},
        {"chosen": USER + [{"role": "assistant", "content": "5"}], "rejected": USER + [{"role": "assistant", "content": "6"}]},
    ]
    pairs, stats = load_preference_pairs([write_jsonl(tmp_path / "p.jsonl", rows)], tok, COLUMNS, max_length=None)
    assert stats.kept == 3 and stats.rows == 3
    first = pairs[0]
    for pair in pairs:
        assert pair.chosen.prompt_ids == pair.rejected.prompt_ids == first.chosen.prompt_ids
        assert pair.chosen.response_ids == first.chosen.response_ids
        assert pair.rejected.response_ids == first.rejected.response_ids
    assert tok.decode(first.chosen.prompt_ids).endswith("<|im_start|>assistant\n")
    assert response_text(tok, first.chosen) == "5<|im_end|>\n"
    assert response_text(tok, first.rejected) == "6<|im_end|>\n"


def test_parquet_with_a_multi_turn_prompt_masks_the_earlier_assistant_turn(tok, tmp_path):
    prompt = USER + [{"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 + 4?"}]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": [prompt], "chosen": ["8"], "rejected": ["9"]}), path)
    (pair,), _ = load_preference_pairs([path], tok, COLUMNS, max_length=None)
    assert response_text(tok, pair.chosen) == "8<|im_end|>\n"  # the prompt's "5" carries no loss
    assert "And 4 + 4?" in tok.decode(pair.chosen.prompt_ids)


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "chosen": "a"}, "column 'rejected' is missing"),
    ({"prompt": "q", "chosen": "a", "rejected": [{"role": "user", "content": "x"}]},
     "column 'rejected''s response has a 'user' turn"),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
     "share no opening turn"),
    ({"prompt": "q", "chosen": [{"role": "wizard", "content": "a"}], "rejected": "b"}, "column 'chosen' message 0"),
])
def test_a_bad_row_names_file_row_and_column(tok, tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(DataError, match=message) as info:
        load_preference_pairs([path], tok, COLUMNS, max_length=None)
    assert f"{path} row 1" in str(info.value)


def test_on_bad_row_skip_counts_and_keeps_the_rest(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q"}])
    (tmp_path / "p.jsonl").write_text((tmp_path / "p.jsonl").read_text() + "{not json\n")
    pairs, stats = load_preference_pairs([path], tok, COLUMNS, max_length=None, on_bad_row="skip")
    assert len(pairs) == 1 and stats.rows == 3
    assert stats.skipped["malformed (data.on_bad_row=skip)"] == 2


def test_max_length_keeps_the_start_and_skips_a_pair_left_without_a_response(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 2 + 3?", "chosen": "5" * 40, "rejected": "6"}])
    (pair,), stats = load_preference_pairs([path], tok, COLUMNS, max_length=len(pair_prompt(tok)) + 3)
    assert len(pair.chosen.response_ids) == 3 and stats.truncated == 1
    with pytest.raises(DataError, match="no usable preference pair"):
        load_preference_pairs([path], tok, COLUMNS, max_length=len(pair_prompt(tok)))


def pair_prompt(tok):
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_other_column_names(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "q", "good": "a", "bad": "b"}])
    pairs, _ = load_preference_pairs([path], tok, PreferenceColumns("question", "good", "bad"), max_length=None)
    assert response_text(tok, pairs[0].chosen) == "a<|im_end|>\n"

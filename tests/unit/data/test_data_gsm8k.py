"""GSM8K conversion on a tiny hand-made input (no download) and the script's entry point."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data.dataset import RLDataset
from hybridflow.data.row_files import DataError, load_rows
from hybridflow.data.gsm8k import GSM8K_DATA_SOURCE, convert_gsm8k, extract_gsm8k_answer
from hybridflow.models.tiny import build_tiny_tokenizer

SUFFIX = ' Let\'s think step by step and output the final answer after "####".'
TRAIN = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,000 ... total?", "answer": "It is 1,000 dollars.\n#### 1,000"},
    {"question": "Temperature drops from 2 by 5?", "answer": "2 - 5 = -3\n#### -3"},
]
TEST = [{"question": "What is half of 5?", "answer": "5 / 2 = 2.5\n#### 2.5"}]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def write_hf_parquet(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(TRAIN), directory / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(TEST), directory / "test-00000-of-00001.parquet")


@pytest.mark.parametrize("layout", ["jsonl", "parquet", "hf_snapshot"])
def test_conversion_to_verl_schema(tmp_path, layout):
    src = tmp_path / "gsm8k"
    if layout == "jsonl":
        src.mkdir()
        write_jsonl(src / "train.jsonl", TRAIN)
        write_jsonl(src / "test.jsonl", TEST)
    else:
        write_hf_parquet(src / "main" if layout == "hf_snapshot" else src)

    written = convert_gsm8k(src, tmp_path / "out")
    assert written == {"train": tmp_path / "out" / "train.parquet", "test": tmp_path / "out" / "test.parquet"}

    train = load_rows(written["train"])
    assert len(train) == 3
    assert train[0] == {
        "data_source": GSM8K_DATA_SOURCE,
        "prompt": [{"role": "user", "content": TRAIN[0]["question"] + SUFFIX}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"split": "train", "index": 0, "answer": TRAIN[0]["answer"], "question": TRAIN[0]["question"]},
    }
    assert [r["reward_model"]["ground_truth"] for r in train] == ["7", "1000", "-3"]
    assert [r["extra_info"]["index"] for r in train] == [0, 1, 2]
    test = load_rows(written["test"])
    assert test[0]["reward_model"]["ground_truth"] == "2.5" and test[0]["extra_info"]["split"] == "test"

    ds = RLDataset.from_files([written["train"]], build_tiny_tokenizer(), max_prompt_length=256)
    assert [r.ground_truth for r in ds] == ["7", "1000", "-3"]


def test_answer_without_final_number_names_file_and_row(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    write_jsonl(src / "train.jsonl", TRAIN[:1] + [{"question": "q?", "answer": "no marker here"}])
    write_jsonl(src / "test.jsonl", TEST)
    with pytest.raises(DataError, match=r"train\.jsonl row 1: 'answer' does not end in '#### <number>'"):
        convert_gsm8k(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written when any row is bad


def test_missing_split_and_ambiguous_formats(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    write_jsonl(src / "train.jsonl", TRAIN)
    with pytest.raises(DataError, match=r"no GSM8K test files in .*it contains: train\.jsonl"):
        convert_gsm8k(src, tmp_path / "out")
    write_jsonl(src / "test.jsonl", TEST)
    pq.write_table(pa.Table.from_pylist(TRAIN), src / "train.parquet")
    with pytest.raises(DataError, match="several formats"):
        convert_gsm8k(src, tmp_path / "out")


def test_refuses_to_overwrite_its_input(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    pq.write_table(pa.Table.from_pylist(TRAIN), src / "train.parquet")
    pq.write_table(pa.Table.from_pylist(TEST), src / "test.parquet")
    with pytest.raises(DataError, match="is also an input file"):
        convert_gsm8k(src, src)


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("x\n#### 72", "72"),
        ("#### 1,234,567", "1234567"),
        ("#### -3 ", "-3"),
        ("#### 0.5", "0.5"),
        ("72", None),
        ("#### $5", None),
    ],
)
def test_extract_answer(solution, expected):
    assert extract_gsm8k_answer(solution) == expected


def test_script_main(tmp_path, capsys):
    script = Path(__file__).resolve().parents[3] / "scripts" / "preprocess_gsm8k.py"
    spec = importlib.util.spec_from_file_location("preprocess_gsm8k", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    src = tmp_path / "in"
    src.mkdir()
    write_jsonl(src / "train.jsonl", TRAIN)
    write_jsonl(src / "test.jsonl", TEST)
    assert module.main(["--input_dir", str(src), "--local_save_dir", str(tmp_path / "out")]) == 0
    assert "train: 3 rows" in capsys.readouterr().out
    assert module.main(["--input_dir", str(tmp_path / "nowhere"), "--local_save_dir", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err

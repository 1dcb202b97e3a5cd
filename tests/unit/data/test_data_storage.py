"""Dataset files in object storage: parquet read by pyarrow through fsspec, JSON lines read whole,
against moto's S3 server (the ``s3`` fixture, tests/conftest.py)."""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data.dataset import RLDataset
from hybridflow.data.row_files import DataError, load_rows
from hybridflow.models.tiny import build_tiny_tokenizer
from hybridflow.utils.storage import Storage


def row(i: int) -> dict:
    return {"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{i}+1="}],
            "reward_model": {"ground_truth": str(i + 1)}}


@pytest.fixture
def bucket(s3, tmp_path):
    store = Storage(endpoint_url=s3.endpoint_url)
    name = f"data-{uuid.uuid4().hex[:12]}"
    fs, _ = store.filesystem(f"s3://{name}")
    fs.mkdir(name)
    pq.write_table(pa.Table.from_pylist([row(i) for i in range(5)]), tmp_path / "train.parquet")
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(row(i)) + "\n" for i in range(3)))
    fs.put_file(str(tmp_path / "train.parquet"), f"{name}/gsm/train.parquet")
    fs.put_file(str(tmp_path / "val.jsonl"), f"{name}/gsm/val.jsonl")
    return store, f"s3://{name}", tmp_path


def test_parquet_and_jsonl_read_from_s3_match_the_local_files(bucket):
    store, root, local = bucket
    assert load_rows(f"{root}/gsm/train.parquet", store) == load_rows(local / "train.parquet")
    assert load_rows(f"{root}/gsm/val.jsonl", store) == load_rows(local / "val.jsonl")
    tokenizer = build_tiny_tokenizer()
    remote = RLDataset.from_files([f"{root}/gsm/train.parquet", f"{root}/gsm/val.jsonl"], tokenizer,
                                  max_prompt_length=64, storage=store)
    here = RLDataset.from_files([local / "train.parquet", local / "val.jsonl"], tokenizer, max_prompt_length=64)
    assert len(remote) == 8 and [r.prompt_ids for r in remote] == [r.prompt_ids for r in here]
    assert remote.files[0] == f"{root}/gsm/train.parquet"


def test_a_missing_remote_file_is_a_data_error_naming_it(bucket):
    store, root, _ = bucket
    with pytest.raises(DataError, match=r"gsm/test.parquet does not exist"):
        load_rows(f"{root}/gsm/test.parquet", store)
    with pytest.raises(DataError, match=r"unsupported file type '.csv'"):
        load_rows(f"{root}/gsm/train.csv", store)

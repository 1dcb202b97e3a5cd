"""Atomic, reproducible parquet writing for the files this package generates.

Generated datasets (the built-in task, converted GSM8K) are written by whichever process gets
there first and read by every other one, possibly while a second writer is racing the first.
Writing to a uniquely named temporary file in the target directory and then ``os.replace``-ing
it over the destination means a reader sees either the old complete file or the new complete
file, never a half-written one, and a crash leaves no truncated parquet behind.

The bytes are a pure function of the rows and the schema (no timestamps; pyarrow stores only
its version string), so writing the same rows twice gives identical files.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet_atomic(rows: list[dict[str, Any]], schema: pa.Schema, path: str | os.PathLike[str]) -> Path:
    """Write ``rows`` as one parquet file at ``path`` with a fixed ``schema``, atomically.

    An explicit schema keeps column types stable (no inference that changes with the data,
    e.g. an all-null column) and therefore keeps the bytes reproducible. Parent directories are
    created. Returns the destination path.
    """
    dest = Path(path).expanduser()
    dest.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema)
    # A unique sibling name (same filesystem, so the rename is atomic). Not mkstemp: that
    # creates the file with mode 0600, which would make the final file private to this user.
    tmp_name = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(table, tmp_name, compression="snappy")
        os.replace(tmp_name, dest)
    except BaseException:
        # Leave nothing behind on failure (including KeyboardInterrupt mid-write).
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return dest


def verl_row_schema(
    extra_info: list[tuple[str, pa.DataType]], *, agent_name: bool = False, images: bool = False
) -> pa.Schema:
    """The parquet schema of a generated dataset in verl's row layout: ``data_source``, the
    ``prompt`` messages, ``ability``, ``reward_model`` (style, ground truth as text) and the task's
    ``extra_info`` fields in the order given; ``agent_name`` (after the data source) and ``images``
    (last, verl's bytes-and-path structs) when the task has them. One definition, so every
    generated file types its shared columns the same way."""
    columns: list[tuple[str, pa.DataType]] = [("data_source", pa.string())]
    if agent_name:
        columns.append(("agent_name", pa.string()))
    columns += [
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct(extra_info)),
    ]
    if images:
        columns.append(("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))))
    return pa.schema(columns)


def verl_row(
    data_source: str,
    question: str,
    ability: str,
    ground_truth: str,
    extra_info: dict[str, Any],
    *,
    agent_name: str | None = None,
    images: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One generated row in verl's layout (``verl_row_schema``): the question as the one user
    message, scored by a rule against ``ground_truth``."""
    row: dict[str, Any] = {"data_source": data_source}
    if agent_name is not None:
        row["agent_name"] = agent_name
    row |= {
        "prompt": [{"role": "user", "content": question}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra_info,
    }
    if images is not None:
        row["images"] = images
    return row


def write_train_test(
    out_dir: str | os.PathLike[str],
    schema: pa.Schema,
    make_rows: Callable[[int, int, str], list[dict[str, Any]]],
    train_size: int,
    val_size: int,
    seed: int,
) -> tuple[Path, Path]:
    """A built-in task's two splits, ``make_rows(n, seed, split)``, as ``train.parquet`` and
    ``test.parquet`` under ``out_dir``, each written atomically (the same bytes for the same
    arguments); returns their paths."""
    out = Path(out_dir).expanduser()
    train_rows, test_rows = make_rows(train_size, seed, "train"), make_rows(val_size, seed, "test")
    return (write_parquet_atomic(train_rows, schema, out / "train.parquet"),
            write_parquet_atomic(test_rows, schema, out / "test.parquet"))

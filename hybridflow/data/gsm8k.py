"""Convert a local copy of GSM8K into verl's row schema (what verl's gsm8k preprocessing writes).

Input: a directory holding GSM8K's ``main`` config as parquet (``train-00000-of-00001.parquet``,
the Hugging Face layout) or JSON lines (``train.jsonl``, the original GitHub layout), each row
``{"question": ..., "answer": "...reasoning...\\n#### 72"}``. A Hugging Face snapshot directory
that holds ``main/`` is accepted too. Nothing is downloaded: the caller brings the files.

Output rows, one per problem::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},      # after "####", no commas
     "extra_info": {"split": "train", "index": 0, "answer": <raw answer>, "question": <raw>}}
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pyarrow as pa

from hybridflow.data.row_files import DataError, load_rows
from hybridflow.data.writing import verl_row, verl_row_schema, write_parquet_atomic

GSM8K_DATA_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_SPLITS = ("train", "test")
_ANSWER_MARK = "####"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_EXTENSIONS = ("parquet", "jsonl", "json")

_SCHEMA = verl_row_schema(
    [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]
)


def extract_gsm8k_answer(solution: str) -> str | None:
    """The final answer of a GSM8K solution: the number after the last "####", commas removed.

    ``None`` when there is no "####" or what follows it is not a plain number.
    """
    if _ANSWER_MARK not in solution:
        return None
    tail = solution.rsplit(_ANSWER_MARK, 1)[1].strip().replace(",", "")
    return tail if _NUMBER.fullmatch(tail) else None


def gsm8k_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One GSM8K problem as a row in verl's schema. Raises ``ValueError`` on an answer without a
    final "#### <number>" (the row would be unscorable)."""
    ground_truth = extract_gsm8k_answer(answer)
    if ground_truth is None:
        tail = answer[-60:].replace("\n", "\\n")
        raise ValueError(f"'answer' does not end in '#### <number>' (ends with {tail!r})")
    return verl_row(GSM8K_DATA_SOURCE, f"{question} {GSM8K_INSTRUCTION}", "math", ground_truth,
                    {"split": split, "index": index, "answer": answer, "question": question})


def find_split_files(input_dir: str | os.PathLike[str], split: str) -> list[Path]:
    """The files of one split in ``input_dir`` (or its ``main/`` folder), sorted by name.

    Matches ``<split>.<ext>`` and sharded ``<split>-*.<ext>`` for parquet, jsonl and json.
    Both formats for the same split is refused: concatenating them would double every row.
    """
    root = Path(input_dir).expanduser()
    if not root.is_dir():
        raise DataError(f"GSM8K input directory {root} does not exist or is not a directory")
    candidates = [root, root / "main"]
    for directory in candidates:
        if not directory.is_dir():
            continue
        patterns = [f"{split}{shard}.{ext}" for ext in _EXTENSIONS for shard in ("", "-*")]
        files = sorted({p for pattern in patterns for p in directory.glob(pattern)})
        if files:
            formats = {p.suffix for p in files}
            if len(formats) > 1:
                raise DataError(
                    f"GSM8K {split} split in {directory} has files in several formats "
                    f"({', '.join(p.name for p in files)}); keep one copy"
                )
            return files
    listing = sorted(p.name for p in root.iterdir())[:20]
    raise DataError(
        f"no GSM8K {split} files in {root} (looked for {split}.<ext> and {split}-*.<ext> with ext "
        f"parquet, jsonl or json, there and under main/); it contains: {', '.join(listing) or '(nothing)'}"
    )


def _convert_split(files: list[Path], split: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in files:
        for i, raw in enumerate(load_rows(path)):
            question, answer = raw.get("question"), raw.get("answer")
            for key, value in (("question", question), ("answer", answer)):
                if not isinstance(value, str) or not value.strip():
                    raise DataError(f"{path} row {i}: {key!r} must be a non-empty string, got {value!r}")
            try:
                rows.append(gsm8k_row(question, answer, split, len(rows)))
            except ValueError as exc:
                raise DataError(f"{path} row {i}: {exc}") from exc
    if not rows:
        raise DataError(f"GSM8K {split} files {', '.join(map(str, files))} have no rows")
    return rows


def convert_gsm8k(input_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Convert the local GSM8K ``train`` and ``test`` files; return ``{split: written parquet}``.

    Every row is checked before anything is written, and each output file is written
    atomically, so a failed conversion leaves no partial output.
    """
    out = Path(output_dir).expanduser()
    split_files = {split: find_split_files(input_dir, split) for split in GSM8K_SPLITS}
    inputs = {p.resolve() for files in split_files.values() for p in files}
    for split in GSM8K_SPLITS:
        target = (out / f"{split}.parquet").resolve()
        if target in inputs:
            raise DataError(f"output {target} is also an input file; choose a different output directory")
    converted = {split: _convert_split(files, split) for split, files in split_files.items()}
    return {
        split: write_parquet_atomic(rows, _SCHEMA, out / f"{split}.parquet") for split, rows in converted.items()
    }

"""Reading a dataset file's records (parquet, JSON lines, a JSON array; local or in object storage), each
record either a row or the reason it cannot be one: invalid JSON, nesting past ``MAX_ROW_DEPTH``, a lone
surrogate. ``load_rows`` is the one entry point; ``dataset.py`` validates and tokenizes what it returns."""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from hybridflow.utils.files import special_file_kind
from hybridflow.utils.storage import Storage, StorageError, is_remote


PARQUET_SUFFIXES = (".parquet",)
JSON_SUFFIXES = (".jsonl", ".json")
# Containers (objects, lists) a JSON row may nest. verl's schema needs three (row, prompt list,
# message) and tool schemas in extra_info a dozen or so; near 1000, Python's json and pickle hit
# the recursion limit, so a deeper row that parsed here could still fail minutes later when a
# rank pickles it or a logger writes it, from deeper in the stack.
MAX_ROW_DEPTH = 100


# A lone surrogate reaches a JSON line only as an escape (strict UTF-8 decoding refuses an encoded
# one), so a line without one (or with only pairs, which then pass) holds none.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class DataError(ValueError):
    """A dataset file or row is unusable. The message names the file, the row and the problem."""


class BadRowReason:
    """Reason codes for malformed rows: the keys of ``DatasetStats.bad_rows``.

    Stable short strings (not an Enum) so that counts print and serialise as plain text.
    """

    INVALID_JSON = "invalid_json"
    NESTED_TOO_DEEP = "nested_too_deep"  # more than MAX_ROW_DEPTH containers inside each other
    TEXT_INVALID = "text_invalid"  # a string that is not Unicode text (a lone surrogate)
    NOT_AN_OBJECT = "not_an_object"
    PROMPT_MISSING = "prompt_missing"
    PROMPT_INVALID = "prompt_invalid"
    MESSAGE_INVALID = "message_invalid"
    ROLE_INVALID = "role_invalid"
    DATA_SOURCE_MISSING = "data_source_missing"
    DATA_SOURCE_INVALID = "data_source_invalid"
    DATA_SOURCE_UNKNOWN = "data_source_unknown"
    ABILITY_INVALID = "ability_invalid"
    REWARD_MODEL_MISSING = "reward_model_missing"
    REWARD_MODEL_INVALID = "reward_model_invalid"
    GROUND_TRUTH_MISSING = "ground_truth_missing"
    GROUND_TRUTH_INVALID = "ground_truth_invalid"
    EXTRA_INFO_INVALID = "extra_info_invalid"
    AGENT_NAME_INVALID = "agent_name_invalid"
    CHAT_TEMPLATE_FAILED = "chat_template_failed"
    IMAGES_INVALID = "images_invalid"  # not a list, or a count that differs from the <image> placeholders
    IMAGE_UNREADABLE = "image_unreadable"  # a missing file, or bytes that do not decode
    IMAGES_UNSUPPORTED = "images_unsupported"  # images for a text-only model


@dataclass(frozen=True)
class Record:
    """One record of a file before validation."""

    row: int  # 0-based position among the file's records
    where: str  # "row 17", or "row 17 (line 18)" for JSON lines
    value: Any  # the parsed object (None when parse_error is set)
    parse_error: str | None = None
    parse_reason: str = BadRowReason.INVALID_JSON  # the BadRowReason of parse_error


def value_type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _read_parquet(path: Path | str, storage: Storage | None = None) -> list[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if is_remote(path):
            # pyarrow reads through the fsspec filesystem: row groups are fetched by range, no local copy.
            assert storage is not None
            fs, inner = storage.filesystem(str(path))
            table = pq.read_table(inner, filesystem=fs)
        else:
            table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable parquet file ({exc})") from exc
    except StorageError as exc:
        raise DataError(str(exc)) from exc
    return [Record(row=i, where=f"row {i}", value=v) for i, v in enumerate(table.to_pylist())]


def _read_json_lines(fh: BinaryIO) -> list[Record]:
    records: list[Record] = []
    for line_number, raw in enumerate(fh, start=1):
        row = len(records)
        where = f"row {row} (line {line_number})"
        try:
            # utf-8-sig on the first line tolerates a byte-order mark from Windows editors.
            text = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            records.append(Record(row, where, None, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"))
            continue
        if not text.strip():
            continue  # blank lines (a trailing newline, spacing) are not records
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            records.append(Record(row, where, None, f"invalid JSON: {exc.msg} at column {exc.colno}"))
            continue
        except RecursionError:
            records.append(Record(row, where, None, _TOO_DEEP, BadRowReason.NESTED_TOO_DEEP))
            continue
        records.append(_json_record(row, where, value, text))
    return records


def _read_json_array(path: Path | str, data: bytes) -> list[Record]:
    try:
        values = json.loads(data.decode("utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f"line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "decoding"
        raise DataError(f"{path}: invalid JSON array ({where}: {exc})") from exc
    except RecursionError:  # the whole file is one value: no row to blame
        raise DataError(f"{path}: {_TOO_DEEP}") from None
    return [_json_record(i, f"row {i}", v) for i, v in enumerate(values)]


_TOO_DEEP = (
    f"nested more than {MAX_ROW_DEPTH} levels deep (objects and lists inside each other); "
    "a row in verl's schema needs a few levels: flatten or drop the deep value"
)


def _json_record(row: int, where: str, value: Any, text: str | None = None) -> Record:
    """A parsed JSON record, or its problem when JSON allowed what a row must not hold."""
    if text is None or _may_hold_a_problem(text):
        if (problem := _value_problem(value)) is not None:
            reason, message = problem
            return Record(row, where, None, message, reason)
    return Record(row, where, value)


def _may_hold_a_problem(text: str) -> bool:
    """False when a record's JSON text can neither nest past ``MAX_ROW_DEPTH`` (it has no more
    brackets than that) nor hold a lone surrogate (it has no surrogate escape): nearly every row,
    which then skips the walk over its values (walking every row doubled the CPU time of reading
    a JSON lines file; this test adds a tenth)."""
    return text.count("[") + text.count("{") > MAX_ROW_DEPTH or SURROGATE_ESCAPE.search(text) is not None


def _value_problem(value: Any) -> tuple[str, str] | None:
    """(BadRowReason, message) for the first value nested past ``MAX_ROW_DEPTH`` or string that is
    not Unicode text, in file order; None when there is none. Iterative: a recursive walk would
    overflow on the very depth it guards against."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]  # (value, its dotted path, containers above it)
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            if (problem := _text_problem(node)) is not None:
                return BadRowReason.TEXT_INVALID, f"{repr(path) if path else 'the row'} {problem}"
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth >= MAX_ROW_DEPTH:
            return BadRowReason.NESTED_TOO_DEEP, _TOO_DEEP
        if isinstance(node, list):
            children = [(item, f"{path}[{i}]") for i, item in enumerate(node)]
        else:
            children = []
            for key, item in node.items():
                if (problem := _text_problem(key)) is not None:
                    return BadRowReason.TEXT_INVALID, f"the key {ascii(key)}{f' of {path!r}' if path else ''} {problem}"
                children.append((item, f"{path}.{key}" if path else key))
        stack.extend((item, child, depth + 1) for item, child in reversed(children))
    return None


def _text_problem(text: str) -> str | None:
    """Why ``text`` is not Unicode text (a lone UTF-16 surrogate), or None. The message shows the
    surrogate escaped: the character itself cannot be printed or written as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"has a lone surrogate (\\u{ord(text[exc.start]):04x}) at character {exc.start}: not "
            "Unicode text, so no tokenizer can encode it; fix the text in the file (a character beyond U+FFFF "
            "is escaped as a pair, like \\ud83d\\ude00)"
        )
    return None


def _starts_with_bracket(data: bytes) -> bool:
    return data[:4096].lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def read_records(path: str | os.PathLike[str], storage: Storage | None = None) -> list[Record]:
    """Parse a file (a local path, or a URL read through ``storage``) into records; a record
    that does not parse carries its error instead."""
    remote = is_remote(path)
    p: Path | str = str(path) if remote else Path(path).expanduser()
    suffix = PurePosixPath(str(p)).suffix.lower()
    if suffix not in PARQUET_SUFFIXES + JSON_SUFFIXES:
        raise DataError(
            f"{path}: unsupported file type {suffix or '(no extension)'!r}; "
            "expected .parquet, .jsonl or .json (JSON lines, or one JSON array)"
        )
    if remote:
        storage = storage or Storage()
        try:
            storage.check(str(p), "file")
        except StorageError as exc:
            raise DataError(str(exc)) from exc
    else:
        assert isinstance(p, Path)
        if (kind := special_file_kind(p)) is not None:  # refused unopened: a FIFO would block the run
            raise DataError(f"{path}: {kind}, not a regular file; give a .parquet, .jsonl or .json file")
        if not p.is_file():
            raise DataError(f"{path}: no such file")
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet(p, storage)
    try:
        # JSON files are read whole: they are small next to the parquet a large dataset comes in.
        with (storage.open(str(p)) if remote and storage else open(p, "rb")) as fh:
            data = fh.read()
    except StorageError as exc:
        raise DataError(str(exc)) from exc
    except OSError as exc:  # permissions, a file removed or unreadable since the check above
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc}); check the path and its permissions") from exc
    # A .json file is read as JSON lines unless it is one top-level array: both are common
    # exports, and telling them apart by the first character is unambiguous.
    if suffix == ".json" and _starts_with_bracket(data):
        return _read_json_array(p, data)
    return _read_json_lines(io.BytesIO(data))


def load_rows(path: str | os.PathLike[str], storage: Storage | None = None) -> list[dict[str, Any]]:
    """All rows of a .parquet, .jsonl or .json file as dicts, in file order.

    Raises ``DataError`` naming the file and the row (and line, for JSON lines) on the first
    record that is not valid JSON or not an object, on a missing file and on an unknown
    extension. Row contents are not validated here; ``RLDataset.from_files`` does that.
    """
    rows: list[dict[str, Any]] = []
    for record in read_records(path, storage):
        if record.parse_error is not None:
            raise DataError(f"{path} {record.where}: {record.parse_error}")
        if not isinstance(record.value, dict):
            raise DataError(f"{path} {record.where}: expected an object, got {value_type_name(record.value)}")
        rows.append(record.value)
    return rows

"""Prompt datasets in verl's row schema, validated and tokenized once, up front.

A row (one line of JSONL, one parquet row) looks like::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],          # the column named by prompt_key
     "ability": "math",                                         # optional
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...},        # optional
     "agent_name": "tool_agent",                                # optional: the agent loop
     "images": [{"bytes": b"...", "path": "a.png"}]}            # optional: see below

A vision-language row has ``images`` (verl's column: bytes, a ``{"bytes", "path"}`` dict or a
path each; ``hybridflow.data.images``) and one ``<image>`` in its messages' text per image, in
order. The placeholders become image parts of the message content (``[{"type": "image"},
{"type": "text", ...}]``, what a VL chat template expects) and, after the template, each image's
placeholder token is repeated once per merged patch of that image (``ImageInputs``), so
``prompt_ids`` holds the model's real image tokens and ``max_prompt_length`` counts them.

Why everything happens in ``RLDataset.from_files``: a malformed row found at reward time (after
minutes of rollout) or an overlong prompt found mid-epoch inside a loader worker is the
classic way an RL run dies late with a bare ``KeyError``. Here every row is checked and
chat-templated before the first step, and every problem names the file, the row and what is
wrong, e.g. ``train.parquet row 17: 'prompt' message 0 has no 'content'``.

Row numbers are 0-based positions among the file's records (the index ``load_rows(path)``
gives). For JSON lines the 1-based line number is added, because that is what an editor shows.

JSON lets a file say things no row should: values nested thousands deep (Python's parser gives
up with ``RecursionError``) and lone UTF-16 surrogates (``"\\ud800"``, a str no tokenizer or
UTF-8 writer accepts). The reader turns both into a record's problem, like invalid JSON, so they
name the file and row and ``on_bad_row="skip"`` skips them.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Protocol, overload

from hybridflow.utils.files import special_file_kind
from hybridflow.utils.storage import Storage, StorageError, is_remote

from hybridflow.data.images import IMAGE_PLACEHOLDER, ImageProblem, decode_image, image_bytes, split_placeholders
from hybridflow.types import MultiModalInputs

logger = logging.getLogger(__name__)

VALID_ROLES = frozenset({"system", "user", "assistant", "tool"})
TRUNCATION_MODES = ("error", "left", "right")
ON_BAD_ROW_MODES = ("error", "skip")
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


# apply_chat_template arguments hybridflow sets itself or that change what it returns: data.
# apply_chat_template_kwargs may not set them (the rest reach the template as variables).
RESERVED_TEMPLATE_KWARGS = ("conversation", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
                            "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding", "truncation",
                            "max_length")


def check_chat_template_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``data.apply_chat_template_kwargs`` as a plain dict; ValueError naming a reserved key."""
    reserved = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"data.apply_chat_template_kwargs.{reserved[0]}: hybridflow sets {reserved[0]!r} itself "
                         f"when it renders a chat; the keyword arguments are for the template's own variables "
                         f"(reasoning_effort, enable_thinking, ...)")
    return dict(kwargs)


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


class ChatTokenizer(Protocol):
    """The two tokenizer methods the dataset uses (a Hugging Face tokenizer satisfies it)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


class ImageInputs(Protocol):
    """What the dataset needs of a vision-language model's processor
    (``hybridflow.models.vision.VisionProcessor`` satisfies it)."""

    image_token_id: int

    def process(self, images: list[Any]) -> dict[str, Any]: ...

    def expand_image_tokens(self, ids: list[int], grid_thw: Any) -> list[int]: ...


@dataclass
class PromptRow:
    """One validated, chat-templated prompt and the fields its reward needs."""

    prompt_ids: list[int]  # chat-templated, generation prompt appended, possibly truncated
    messages: list[dict[str, Any]] | None  # the raw chat; None when not kept (data.return_raw_chat=false)
    data_source: str
    ground_truth: str  # scalars as text; a list or mapping ground truth as its JSON text
    ability: str  # "" when the row has none
    extra_info: dict[str, Any]  # verl keeps per-row tool arguments here too (extra_info.tools_kwargs)
    source: str  # "<file>:<row>", to trace a sample back to its row
    agent_name: str | None = None  # the agent loop for this row (None: the run's default)
    # The row's images, encoded as read (compact; decoded again where pixels are needed), and
    # each image's patch grid (t, h, w) from the image processor: prompt_ids holds
    # t*h*w / merge_size**2 image tokens for image k.
    images: tuple[bytes, ...] = ()
    image_grid_thw: tuple[tuple[int, int, int], ...] = ()

    def metadata(self) -> dict[str, Any]:
        """The row fields a ``Trajectory.metadata`` carries to the agent loop, the reward and
        the metrics (``agent_name`` only when the row names a loop)."""
        fields = {
            "data_source": self.data_source,
            "ground_truth": self.ground_truth,
            "ability": self.ability,
            "extra_info": self.extra_info,
            "source": self.source,
        }
        if self.messages is not None:
            # The prompt as chat messages, for agent loops that hand it to an agent (openai) and the reward
            # model, which renders prompts with its own template.
            fields["prompt_messages"] = self.messages
        if self.agent_name is not None:
            fields["agent_name"] = self.agent_name
        return fields


@dataclass
class DatasetStats:
    """What loading did: rows read, and how many were dropped or changed, and why."""

    num_rows: int = 0  # rows read from the files, before anything was dropped
    num_filtered_overlong: int = 0
    num_truncated: int = 0
    bad_rows: dict[str, int] = field(default_factory=dict)  # BadRowReason -> count

    @property
    def num_bad_rows(self) -> int:
        return sum(self.bad_rows.values())

    @property
    def num_kept(self) -> int:
        return self.num_rows - self.num_filtered_overlong - self.num_bad_rows


# --------------------------------------------------------------------------------------------
# Reading files


@dataclass(frozen=True)
class _Record:
    """One record of a file before validation."""

    row: int  # 0-based position among the file's records
    where: str  # "row 17", or "row 17 (line 18)" for JSON lines
    value: Any  # the parsed object (None when parse_error is set)
    parse_error: str | None = None
    parse_reason: str = BadRowReason.INVALID_JSON  # the BadRowReason of parse_error


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _read_parquet(path: Path | str, storage: Storage | None = None) -> list[_Record]:
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
    return [_Record(row=i, where=f"row {i}", value=v) for i, v in enumerate(table.to_pylist())]


def _read_json_lines(fh: BinaryIO) -> list[_Record]:
    records: list[_Record] = []
    for line_number, raw in enumerate(fh, start=1):
        row = len(records)
        where = f"row {row} (line {line_number})"
        try:
            # utf-8-sig on the first line tolerates a byte-order mark from Windows editors.
            text = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            records.append(_Record(row, where, None, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"))
            continue
        if not text.strip():
            continue  # blank lines (a trailing newline, spacing) are not records
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            records.append(_Record(row, where, None, f"invalid JSON: {exc.msg} at column {exc.colno}"))
            continue
        except RecursionError:
            records.append(_Record(row, where, None, _TOO_DEEP, BadRowReason.NESTED_TOO_DEEP))
            continue
        records.append(_json_record(row, where, value, text))
    return records


def _read_json_array(path: Path | str, data: bytes) -> list[_Record]:
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


def _json_record(row: int, where: str, value: Any, text: str | None = None) -> _Record:
    """A parsed JSON record, or its problem when JSON allowed what a row must not hold."""
    if text is None or _may_hold_a_problem(text):
        if (problem := _value_problem(value)) is not None:
            reason, message = problem
            return _Record(row, where, None, message, reason)
    return _Record(row, where, value)


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


def _read_records(path: str | os.PathLike[str], storage: Storage | None = None) -> list[_Record]:
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
    for record in _read_records(path, storage):
        if record.parse_error is not None:
            raise DataError(f"{path} {record.where}: {record.parse_error}")
        if not isinstance(record.value, dict):
            raise DataError(f"{path} {record.where}: expected an object, got {_type_name(record.value)}")
        rows.append(record.value)
    return rows


# --------------------------------------------------------------------------------------------
# Validating rows


class _RowProblem(Exception):
    """Internal: a row is malformed. Carries the reason code and a message without location."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class _ValidRow:
    messages: list[dict[str, Any]]
    data_source: str
    ground_truth: str
    ability: str
    extra_info: dict[str, Any]
    agent_name: str | None


def _check_messages(value: Any, prompt_key: str) -> list[dict[str, Any]]:
    if value is None:
        raise _RowProblem(BadRowReason.PROMPT_MISSING, f"{prompt_key!r} is missing")
    if isinstance(value, str):
        raise _RowProblem(
            BadRowReason.PROMPT_INVALID,
            f"{prompt_key!r} must be a list of chat messages, got a plain string "
            f'(wrap it as [{{"role": "user", "content": ...}}])',
        )
    if not isinstance(value, list):
        raise _RowProblem(
            BadRowReason.PROMPT_INVALID, f"{prompt_key!r} must be a list of chat messages, got {_type_name(value)}"
        )
    if not value:
        raise _RowProblem(BadRowReason.PROMPT_INVALID, f"{prompt_key!r} is an empty list of messages")
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        label = f"{prompt_key!r} message {i}"
        if not isinstance(message, dict):
            raise _RowProblem(BadRowReason.MESSAGE_INVALID, f"{label} is not a dict (got {_type_name(message)})")
        for key in ("role", "content"):
            if message.get(key) is None:
                raise _RowProblem(BadRowReason.MESSAGE_INVALID, f"{label} has no {key!r}")
            if not isinstance(message[key], str):
                raise _RowProblem(
                    BadRowReason.MESSAGE_INVALID,
                    f"{label} {key!r} must be a string, got {_type_name(message[key])}",
                )
        if message["role"] not in VALID_ROLES:
            raise _RowProblem(
                BadRowReason.ROLE_INVALID,
                f"{label} has role {message['role']!r}; expected one of {', '.join(sorted(VALID_ROLES))}",
            )
        messages.append(dict(message))
    return messages


def _ground_truth_text(value: Any) -> str:
    """The ground truth as text: scalars as written, a list or a mapping as its JSON text (verl's
    search-R1 rows hold ``{"target": [golden answers]}``; the scorer reads the JSON back).

    An integral float becomes an integer string ("72", not "72.0"): parquet writers promote an
    integer column with a missing value to float64, and "72.0" would fail exact-match scorers.
    """
    label = "'reward_model.ground_truth'"
    if isinstance(value, bool):  # bool is an int subclass; True is never a meant answer
        raise _RowProblem(BadRowReason.GROUND_TRUTH_INVALID,
                          f"{label} must be a string, number, list or mapping, got bool")
    if isinstance(value, str):
        if not value.strip():
            raise _RowProblem(BadRowReason.GROUND_TRUTH_INVALID, f"{label} is an empty string")
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _RowProblem(BadRowReason.GROUND_TRUTH_INVALID, f"{label} is {value} (a missing value?)")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, (list, dict)):
        kind = "list" if isinstance(value, list) else "mapping"
        if not value:
            raise _RowProblem(BadRowReason.GROUND_TRUTH_INVALID, f"{label} is an empty {kind}")
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise _RowProblem(BadRowReason.GROUND_TRUTH_INVALID, f"{label} {kind} is not JSON-serialisable: {exc}")
    raise _RowProblem(
        BadRowReason.GROUND_TRUTH_INVALID,
        f"{label} must be a string, number, list or mapping, got {_type_name(value)}",
    )


def _validate_row(value: Any, prompt_key: str) -> _ValidRow:
    """Check one row against the schema; raise ``_RowProblem`` for the first problem found.

    A null optional field (``ability``, ``extra_info``, ``agent_name``) counts as absent:
    parquet stores a field that some rows lack as null in the others.
    """
    if not isinstance(value, dict):
        raise _RowProblem(BadRowReason.NOT_AN_OBJECT, f"expected an object, got {_type_name(value)}")
    messages = _check_messages(value.get(prompt_key), prompt_key)

    data_source = value.get("data_source")
    if data_source is None:
        raise _RowProblem(BadRowReason.DATA_SOURCE_MISSING, "'data_source' is missing")
    if not isinstance(data_source, str) or not data_source:
        raise _RowProblem(
            BadRowReason.DATA_SOURCE_INVALID,
            f"'data_source' must be a non-empty string, got {_type_name(data_source)} {data_source!r}",
        )

    ability = value.get("ability")
    if ability is None:
        ability = ""
    elif not isinstance(ability, str):
        raise _RowProblem(BadRowReason.ABILITY_INVALID, f"'ability' must be a string, got {_type_name(ability)}")

    reward_model = value.get("reward_model")
    if reward_model is None:
        raise _RowProblem(BadRowReason.REWARD_MODEL_MISSING, "'reward_model' is missing")
    if not isinstance(reward_model, dict):
        raise _RowProblem(
            BadRowReason.REWARD_MODEL_INVALID,
            f"'reward_model' must be a dict like {{'style': 'rule', 'ground_truth': ...}}, "
            f"got {_type_name(reward_model)}",
        )
    if reward_model.get("ground_truth") is None:
        raise _RowProblem(BadRowReason.GROUND_TRUTH_MISSING, "'reward_model' has no 'ground_truth'")
    ground_truth = _ground_truth_text(reward_model["ground_truth"])

    extra_info = value.get("extra_info")
    if extra_info is None:
        extra_info = {}
    elif not isinstance(extra_info, dict):
        raise _RowProblem(
            BadRowReason.EXTRA_INFO_INVALID, f"'extra_info' must be a dict, got {_type_name(extra_info)}"
        )
    agent_name = value.get("agent_name")
    if agent_name is not None and (not isinstance(agent_name, str) or not agent_name.strip()):
        raise _RowProblem(
            BadRowReason.AGENT_NAME_INVALID,
            f"'agent_name' must name an agent loop (e.g. 'tool_agent'), got {_type_name(agent_name)} {agent_name!r}",
        )
    return _ValidRow(messages, data_source, ground_truth, ability, dict(extra_info), agent_name)


def _check_prompt_column(path: str, records: list[_Record], prompt_key: str) -> None:
    """Fail fast when no row of a file has the prompt column: a wrong ``prompt_key`` (or the
    wrong file), not thousands of individually bad rows, and never something to skip."""
    objects = [r.value for r in records if isinstance(r.value, dict)]
    if not objects or any(prompt_key in obj for obj in objects):
        return
    columns = sorted({key for obj in objects[:100] for key in obj})
    raise DataError(
        f"{path}: no row has the prompt column {prompt_key!r} (columns: {', '.join(columns)}); "
        "is prompt_key right, and is this a file in verl's row schema?"
    )


# --------------------------------------------------------------------------------------------
# The dataset


class RLDataset(Sequence[PromptRow]):
    """Validated, chat-templated prompts (a ``Sequence[PromptRow]``) and the loading stats."""

    def __init__(
        self,
        rows: list[PromptRow],
        stats: DatasetStats,
        *,
        files: Sequence[str] = (),
        max_prompt_length: int | None = None,
    ) -> None:
        self._rows = rows
        self.stats = stats
        self.files = list(files)
        self.max_prompt_length = max_prompt_length

    @classmethod
    def from_files(
        cls,
        files: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        tokenizer: ChatTokenizer,
        *,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        truncation: str = "error",
        filter_overlong_prompts: bool = True,
        on_bad_row: str = "error",
        data_sources: Collection[str] | None = None,
        storage: Storage | None = None,
        vision: ImageInputs | None = None,
        image_key: str = "images",
        return_raw_chat: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> RLDataset:
        """Load, validate and tokenize every row of ``files`` (concatenated in order).

        - A malformed row raises ``DataError`` (``on_bad_row="error"``) or is dropped and
          counted by reason in ``stats.bad_rows`` with one warning (``"skip"``).
        - A prompt longer than ``max_prompt_length`` tokens after the chat template is dropped
          and counted when ``filter_overlong_prompts``; otherwise ``truncation`` decides:
          ``"error"`` raises, ``"left"`` keeps the last tokens, ``"right"`` the first.
        - A row whose ``data_source`` is not in ``data_sources`` (when given: the sources the
          run's reward can score) is malformed too: found here, not at the first step that
          samples it, minutes into the run.
        - ``vision`` (a vision-language model's processor) reads the ``image_key`` column; a
          row with images and no ``vision`` (a text-only model), a missing or corrupt image, or
          a count of images that differs from the ``<image>`` placeholders is malformed. A
          prompt with images is never truncated (that would cut its image tokens).
        - A dataset left empty raises ``DataError`` saying what removed the rows.
        - A file given as a URL (``s3://``, ``gs://``) is read through ``storage`` (its endpoint).
        - ``return_raw_chat`` keeps each row's chat messages (``PromptRow.messages``, the samples'
          ``prompt_messages``) beside its token ids; False keeps the token ids only.
        - ``chat_template_kwargs`` (``data.apply_chat_template_kwargs``) are passed to every
          ``apply_chat_template`` call: the template reads them as variables (``reasoning_effort``).
        """
        template_kwargs = check_chat_template_kwargs(chat_template_kwargs or {})
        file_list = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        if not file_list:
            raise DataError("RLDataset.from_files: no files given")
        if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be a positive int, got {max_prompt_length!r}")
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {', '.join(TRUNCATION_MODES)}; got {truncation!r}")
        if on_bad_row not in ON_BAD_ROW_MODES:
            raise ValueError(f"on_bad_row must be one of {', '.join(ON_BAD_ROW_MODES)}; got {on_bad_row!r}")

        stats = DatasetStats()
        bad_rows: Counter[str] = Counter()
        first_problem: dict[str, str] = {}  # reason -> first full message, for the warning
        rows: list[PromptRow] = []

        def reject(location: str, problem: _RowProblem) -> None:
            message = f"{location}: {problem.message}"
            if on_bad_row == "error":
                raise DataError(message) from problem
            bad_rows[problem.reason] += 1
            first_problem.setdefault(problem.reason, message)

        for path in map(str, file_list):
            records = _read_records(path, storage)
            if not records:
                logger.warning("dataset file %s has no rows", path)
            _check_prompt_column(path, records, prompt_key)
            stats.num_rows += len(records)
            for record in records:
                location = f"{path} {record.where}"
                if record.parse_error is not None:
                    reject(location, _RowProblem(record.parse_reason, record.parse_error))
                    continue
                try:
                    valid = _validate_row(record.value, prompt_key)
                    if data_sources is not None and valid.data_source not in data_sources:
                        raise _RowProblem(
                            BadRowReason.DATA_SOURCE_UNKNOWN,
                            f"no reward function scores data_source {valid.data_source!r} (known: "
                            f"{', '.join(sorted(data_sources))}); fix the row's data_source, or set "
                            "reward.custom_reward_function.path to a function that scores it",
                        )
                except _RowProblem as problem:
                    reject(location, problem)
                    continue
                try:
                    images, template_messages = _row_images(
                        record.value.get(image_key), valid.messages, vision, image_key, Path(path).parent
                    )
                except _RowProblem as problem:
                    reject(location, problem)
                    continue
                try:
                    text = tokenizer.apply_chat_template(
                        template_messages, tokenize=False, add_generation_prompt=True, **template_kwargs
                    )
                    prompt_ids = list(tokenizer.encode(text, add_special_tokens=False))
                except Exception as exc:  # templates raise arbitrary errors (jinja raise_exception)
                    problem = _RowProblem(
                        BadRowReason.CHAT_TEMPLATE_FAILED, f"the chat template failed: {type(exc).__name__}: {exc}"
                    )
                    problem.__cause__ = exc
                    reject(location, problem)
                    continue
                grid: tuple[tuple[int, int, int], ...] = ()
                if images:
                    assert vision is not None  # _row_images refuses images without it
                    try:
                        grid_thw = vision.process([image for _, image in images])["image_grid_thw"]
                        prompt_ids = vision.expand_image_tokens(prompt_ids, grid_thw)
                    except Exception as exc:  # the processor's errors are arbitrary (sizes, modes)
                        problem = _RowProblem(
                            BadRowReason.IMAGE_UNREADABLE,
                            f"the image processor failed on {image_key!r}: {type(exc).__name__}: {exc}",
                        )
                        problem.__cause__ = exc
                        reject(location, problem)
                        continue
                    grid = tuple((int(t), int(h), int(w)) for t, h, w in grid_thw.tolist())
                if len(prompt_ids) > max_prompt_length:
                    if filter_overlong_prompts:
                        stats.num_filtered_overlong += 1
                        continue
                    if images:
                        raise DataError(
                            f"{location}: prompt is {len(prompt_ids)} tokens with its image tokens, over "
                            f"max_prompt_length {max_prompt_length}; a prompt with images is not truncated "
                            "(that would cut its image tokens): raise max_prompt_length or filter overlong prompts"
                        )
                    if truncation == "error":
                        raise DataError(
                            f"{location}: prompt is {len(prompt_ids)} tokens after the chat template, "
                            f"over max_prompt_length {max_prompt_length}; raise max_prompt_length, "
                            "filter overlong prompts, or truncate (left or right)"
                        )
                    if truncation == "left":
                        prompt_ids = prompt_ids[-max_prompt_length:]  # keep the latest turn and the generation prompt
                    else:
                        prompt_ids = prompt_ids[:max_prompt_length]
                    stats.num_truncated += 1
                rows.append(
                    PromptRow(
                        prompt_ids=prompt_ids,
                        messages=valid.messages if return_raw_chat else None,
                        data_source=valid.data_source,
                        ground_truth=valid.ground_truth,
                        ability=valid.ability,
                        extra_info=valid.extra_info,
                        source=f"{path}:{record.row}",
                        agent_name=valid.agent_name,
                        images=tuple(data for data, _ in images),
                        image_grid_thw=grid,
                    )
                )

        stats.bad_rows = dict(sorted(bad_rows.items()))
        if bad_rows:
            examples = "; ".join(
                f"{reason} x{bad_rows[reason]}, e.g. {first_problem[reason]}" for reason in stats.bad_rows
            )
            logger.warning("skipped %d malformed rows of %d: %s", stats.num_bad_rows, stats.num_rows, examples)
        if stats.num_filtered_overlong:
            logger.warning(
                "filtered %d of %d prompts longer than max_prompt_length %d tokens",
                stats.num_filtered_overlong,
                stats.num_rows,
                max_prompt_length,
            )
        if not rows:
            raise DataError(
                f"no prompts left from {', '.join(map(str, file_list))}: {stats.num_rows} rows read, "
                f"{stats.num_filtered_overlong} filtered as longer than max_prompt_length {max_prompt_length}, "
                f"{stats.num_bad_rows} skipped as malformed"
                + (f" ({_format_counts(stats.bad_rows)})" if stats.bad_rows else "")
            )
        return cls(rows, stats, files=[str(f) for f in file_list], max_prompt_length=max_prompt_length)

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> PromptRow: ...

    @overload
    def __getitem__(self, index: slice) -> list[PromptRow]: ...

    def __getitem__(self, index: int | slice) -> PromptRow | list[PromptRow]:
        return self._rows[index]

    def __iter__(self) -> Iterator[PromptRow]:
        return iter(self._rows)

    def describe(self) -> str:
        """One line for the start-of-run log: what was kept, dropped and why, prompt lengths."""
        s = self.stats
        lengths = [len(r.prompt_ids) for r in self._rows]
        limit = f" > {self.max_prompt_length} tokens" if self.max_prompt_length is not None else ""
        mean = sum(lengths) / len(lengths) if lengths else 0.0
        bad = f" ({_format_counts(s.bad_rows)})" if s.bad_rows else ""
        return (
            f"{len(self._rows)} prompts from {len(self.files)} file(s), {s.num_rows} rows read: "
            f"{s.num_filtered_overlong} overlong filtered{limit}, {s.num_truncated} truncated, "
            f"{s.num_bad_rows} malformed skipped{bad}; prompt tokens "
            f"min/mean/max {min(lengths, default=0)}/{mean:.1f}/{max(lengths, default=0)}"
        )


def row_multi_modal(row: PromptRow, vision: ImageInputs | None) -> MultiModalInputs | None:
    """The row's images as model inputs (pixels and grids), None for a text-only row. Computed when
    a request is made, not kept: a dataset's pixels would be far larger than its encoded images."""
    if not row.images:
        return None
    if vision is None:
        raise DataError(f"{row.source}: the row has images but no image processor was given")
    out = vision.process([decode_image(data, f"{row.source} image {i}") for i, data in enumerate(row.images)])
    return MultiModalInputs(out["pixel_values"], out["image_grid_thw"])


def _row_images(
    value: Any,
    messages: list[dict[str, Any]],
    vision: ImageInputs | None,
    image_key: str,
    base_dir: Path,
) -> tuple[list[tuple[bytes, Any]], list[dict[str, Any]]]:
    """A row's images as (encoded bytes, decoded image) pairs, and the messages to render: with
    images, each ``<image>`` placeholder turned into an image part. Raises ``_RowProblem``."""
    if value is None or (isinstance(value, list) and not value):
        if vision is not None and any(IMAGE_PLACEHOLDER in m["content"] for m in messages):
            count = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
            raise _RowProblem(
                BadRowReason.IMAGES_INVALID, f"the prompt has {count} {IMAGE_PLACEHOLDER} placeholders but no {image_key!r}"
            )
        return [], messages
    if not isinstance(value, list):
        raise _RowProblem(BadRowReason.IMAGES_INVALID, f"{image_key!r} must be a list of images, got {_type_name(value)}")
    if vision is None:
        raise _RowProblem(
            BadRowReason.IMAGES_UNSUPPORTED,
            f"the row has {len(value)} images in {image_key!r} but model.path is a text-only model "
            "(no image processor); use a vision-language model (qwen2_vl, qwen2_5_vl)",
        )
    count = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if count != len(value):
        raise _RowProblem(
            BadRowReason.IMAGES_INVALID,
            f"{image_key!r} has {len(value)} images but the prompt has {count} {IMAGE_PLACEHOLDER} "
            "placeholders; put one placeholder where each image goes",
        )
    images = []
    for index, entry in enumerate(value):
        try:
            data, label = image_bytes(entry, index, base_dir)
            images.append((data, decode_image(data, label)))
        except ImageProblem as problem:
            raise _RowProblem(BadRowReason.IMAGE_UNREADABLE, f"{image_key!r} {problem}") from problem
    rendered = [
        {**m, "content": split_placeholders(m["content"])} if IMAGE_PLACEHOLDER in m["content"] else m
        for m in messages
    ]
    return images, rendered


def _format_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key}={value}" for key, value in counts.items())

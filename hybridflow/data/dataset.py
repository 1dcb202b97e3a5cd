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

Files are read by ``row_files.py`` (``load_rows``) and each row checked against the schema by
``row_schema.py``; this module turns valid rows into ``PromptRow``s.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, overload

from hybridflow.data.images import IMAGE_PLACEHOLDER, ImageProblem, decode_image, image_bytes, split_placeholders
from hybridflow.data.row_files import BadRowReason, DataError, read_records, value_type_name
from hybridflow.data.row_schema import RowProblem, check_prompt_column, validate_row
from hybridflow.types import MultiModalInputs, RowFields
from hybridflow.utils.storage import Storage


logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right")
ON_BAD_ROW_MODES = ("error", "skip")


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

    def row_fields(self) -> RowFields:
        """The fields its requests carry to the agent loop, the reward, the metrics and the dumps
        (``prompt_messages`` only when the raw chat is kept; ``agent_name`` only when the row names a loop)."""
        return RowFields(data_source=self.data_source, ground_truth=self.ground_truth, ability=self.ability,
                         extra_info=self.extra_info, source=self.source, prompt_messages=self.messages,
                         agent_name=self.agent_name)


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

        def reject(location: str, problem: RowProblem) -> None:
            message = f"{location}: {problem.message}"
            if on_bad_row == "error":
                raise DataError(message) from problem
            bad_rows[problem.reason] += 1
            first_problem.setdefault(problem.reason, message)

        for path in map(str, file_list):
            records = read_records(path, storage)
            if not records:
                logger.warning("dataset file %s has no rows", path)
            check_prompt_column(path, records, prompt_key)
            stats.num_rows += len(records)
            for record in records:
                location = f"{path} {record.where}"
                if record.parse_error is not None:
                    reject(location, RowProblem(record.parse_reason, record.parse_error))
                    continue
                try:
                    valid = validate_row(record.value, prompt_key)
                    if data_sources is not None and valid.data_source not in data_sources:
                        raise RowProblem(
                            BadRowReason.DATA_SOURCE_UNKNOWN,
                            f"no reward function scores data_source {valid.data_source!r} (known: "
                            f"{', '.join(sorted(data_sources))}); fix the row's data_source, or set "
                            "reward.custom_reward_function.path to a function that scores it",
                        )
                except RowProblem as problem:
                    reject(location, problem)
                    continue
                try:
                    images, template_messages = _row_images(
                        record.value.get(image_key), valid.messages, vision, image_key, Path(path).parent
                    )
                except RowProblem as problem:
                    reject(location, problem)
                    continue
                try:
                    text = tokenizer.apply_chat_template(
                        template_messages, tokenize=False, add_generation_prompt=True, **template_kwargs
                    )
                    prompt_ids = list(tokenizer.encode(text, add_special_tokens=False))
                except Exception as exc:  # templates raise arbitrary errors (jinja raise_exception)
                    problem = RowProblem(
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
                        problem = RowProblem(
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
    images, each ``<image>`` placeholder turned into an image part. Raises ``RowProblem``."""
    if value is None or (isinstance(value, list) and not value):
        if vision is not None and any(IMAGE_PLACEHOLDER in m["content"] for m in messages):
            count = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
            raise RowProblem(
                BadRowReason.IMAGES_INVALID, f"the prompt has {count} {IMAGE_PLACEHOLDER} placeholders but no {image_key!r}"
            )
        return [], messages
    if not isinstance(value, list):
        raise RowProblem(BadRowReason.IMAGES_INVALID, f"{image_key!r} must be a list of images, got {value_type_name(value)}")
    if vision is None:
        raise RowProblem(
            BadRowReason.IMAGES_UNSUPPORTED,
            f"the row has {len(value)} images in {image_key!r} but model.path is a text-only model "
            "(no image processor); use a vision-language model (qwen2_vl, qwen2_5_vl)",
        )
    count = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if count != len(value):
        raise RowProblem(
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
            raise RowProblem(BadRowReason.IMAGE_UNREADABLE, f"{image_key!r} {problem}") from problem
    rendered = [
        {**m, "content": split_placeholders(m["content"])} if IMAGE_PLACEHOLDER in m["content"] else m
        for m in messages
    ]
    return images, rendered


def _format_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key}={value}" for key, value in counts.items())

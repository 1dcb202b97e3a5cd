"""A dataset row's images, in verl's schema, read and checked.

A row's ``images`` column is a list; each entry is one of what parquet files and HF datasets
hold for an image:

- raw encoded bytes (PNG, JPEG, ...);
- a dict ``{"bytes": ..., "path": ...}`` (the HF ``datasets.Image`` feature as stored in
  parquet): the bytes when present, else the path;
- a path string (absolute, or relative to the data file's folder).

Each image is decoded in full when the dataset loads (``PIL.Image.load``, not just the header),
so a truncated or corrupt file fails at start-up naming its file and row, not mid-run. The
dataset keeps the encoded bytes (compact), and decodes again where pixels are needed.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

IMAGE_PLACEHOLDER = "<image>"  # verl's spelling of "an image goes here" in a prompt's content


class ImageProblem(ValueError):
    """One image of a row is missing or unreadable; the message says which and why."""


def image_bytes(value: Any, index: int, base_dir: Path | None) -> tuple[bytes, str]:
    """The encoded bytes of one ``images`` entry and a label for messages (its path, or
    ``image k``). Raises ``ImageProblem`` for a wrong type or a missing file."""
    label = f"image {index}"
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data:
            value = data
            label = f"image {index} ({path})" if path else label
        elif path:
            value = path
        else:
            raise ImageProblem(f"{label} is a dict with neither 'bytes' nor 'path'")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), label
    if isinstance(value, str):
        if not value:
            raise ImageProblem(f"{label} is an empty path")
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise ImageProblem(f"{label}: no such file {str(path)!r}")
        try:
            return path.read_bytes(), f"{label} ({path})"
        except OSError as exc:
            raise ImageProblem(f"{label}: cannot read {str(path)!r} ({exc})") from exc
    raise ImageProblem(f"{label} must be bytes, a path or a {{'bytes', 'path'}} dict, got {type(value).__name__}")


def decode_image(data: bytes, label: str = "image"):
    """The RGB ``PIL.Image`` of encoded bytes, decoded in full. Raises ``ImageProblem``."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # decode every pixel now: a truncated file fails here, not later
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageProblem(f"{label} is not a readable image ({type(exc).__name__}: {exc})") from exc


def split_placeholders(content: str) -> list[dict[str, str]]:
    """A message's text as chat-template parts, each ``<image>`` an image part, as verl builds
    them: ``"<image>Which colour?"`` -> ``[{"type": "image"}, {"type": "text", "text": "Which colour?"}]``
    (empty text between placeholders is dropped)."""
    parts: list[dict[str, str]] = []
    for i, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
        if i > 0:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts

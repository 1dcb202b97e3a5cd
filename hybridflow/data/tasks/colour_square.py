"""The built-in visual task: "Which colour is the square?", one generated image per row.

Each image is a 56 x 56 PNG (four image tokens for the tiny Qwen2-VL's image processor): a plain
background with one filled square of another colour, of random size and place. The answer is
the square's colour name, one of ``COLOURS``; the reward (``hybridflow/rewards/colour_square.py``)
is an exact match. Why this task: a vision-language policy can only solve it by looking (the
text is the same on every row), so a rising score means the pixels reach the policy.

Rows are drawn from a seeded ``random.Random`` per split (train and test use different streams,
so they share the recipe, not the images), in verl's row schema with the image bytes stored as
HF datasets store an ``Image`` feature: ``{"bytes": ..., "path": ...}``.
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import Any

import pyarrow as pa

from hybridflow.data.images import IMAGE_PLACEHOLDER
from hybridflow.data.writing import verl_row, verl_row_schema, write_train_test

COLOUR_SQUARE_DATA_SOURCE = "hybridflow/colour_square"
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 70, 220), "yellow": (240, 220, 40)}
BACKGROUNDS = ((255, 255, 255), (128, 128, 128), (0, 0, 0))  # white, grey, black: never a square's colour
IMAGE_SIZE = 56  # pixels a side: 4 x 4 patches of 14, i.e. 2 x 2 merged patches = 4 image tokens
MIN_SIDE = 16  # the square covers at least (16/56)^2 = 8% of the image
QUESTION = f"{IMAGE_PLACEHOLDER}Which colour is the square? Answer with one word."
SPLIT_STREAMS = {"train": 0, "test": 1}

_SCHEMA = verl_row_schema([("split", pa.string()), ("index", pa.int64())], images=True)


def draw_square_image(rng: random.Random) -> tuple[bytes, str]:
    """One PNG and the colour name of its square."""
    from PIL import Image

    name = rng.choice(sorted(COLOURS))
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rng.choice(BACKGROUNDS))
    side = rng.randint(MIN_SIDE, IMAGE_SIZE - 8)
    x, y = rng.randint(0, IMAGE_SIZE - side), rng.randint(0, IMAGE_SIZE - side)
    image.paste(COLOURS[name], (x, y, x + side, y + side))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue(), name


def make_colour_square_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """``n`` rows of ``split`` (train or test), the same for the same arguments."""
    if split not in SPLIT_STREAMS:
        raise ValueError(f"split must be one of {', '.join(SPLIT_STREAMS)}, got {split!r}")
    rng = random.Random(f"colour_square|{seed}|{SPLIT_STREAMS[split]}")
    rows = []
    for index in range(n):
        data, name = draw_square_image(rng)
        rows.append(verl_row(COLOUR_SQUARE_DATA_SOURCE, QUESTION, "vision", name, {"split": split, "index": index},
                             images=[{"bytes": data, "path": f"{split}-{index}.png"}]))
    return rows


def write_colour_square_task(
    out_dir: str | os.PathLike[str], train_size: int = 512, val_size: int = 64, seed: int = 0
) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir`` (atomic, idempotent)."""
    return write_train_test(out_dir, _SCHEMA, make_colour_square_rows, train_size, val_size, seed)

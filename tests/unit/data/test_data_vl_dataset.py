"""RLDataset with images (verl's ``images`` column): every image form, image tokens, bad images."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data.dataset import BadRowReason, DataError, RLDataset
from hybridflow.models.loading import load_tokenizer
from hybridflow.models.tiny import VL_TOKEN_IDS, build_tiny_tokenizer, write_tiny_vl_model
from hybridflow.models.vision import load_vision_processor

IMAGE_PAD = VL_TOKEN_IDS["<|image_pad|>"]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return write_tiny_vl_model(tmp_path_factory.mktemp("vl") / "model")


@pytest.fixture(scope="module")
def tokenizer(vl_dir):
    return load_tokenizer(vl_dir)


@pytest.fixture(scope="module")
def vision(vl_dir, tokenizer):
    return load_vision_processor(vl_dir, tokenizer)


def png(colour=(255, 0, 0), size=(56, 56)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def vl_row(images: list[Any], content: str = "<image>Which colour is the square?") -> dict[str, Any]:
    return {
        "data_source": "test/vl",
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": "red"},
        "images": images,
    }


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(path, tokenizer, vision, **kwargs):
    return RLDataset.from_files([str(path)], tokenizer, max_prompt_length=kwargs.pop("max_prompt_length", 128),
                                vision=vision, **kwargs)


def test_every_image_form_loads_to_the_same_row_with_one_token_per_merged_patch(tmp_path, tokenizer, vision):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "red.png").write_bytes(png())
    data = png()
    dict_rows = [
        vl_row([{"bytes": data, "path": "red.png"}]),  # HF datasets' Image feature in parquet
        vl_row([{"bytes": None, "path": "imgs/red.png"}]),  # a path relative to the data file
    ]
    raw_rows = [vl_row([data])]
    path_rows = [vl_row(["imgs/red.png"]), vl_row([str(tmp_path / "imgs" / "red.png")])]
    files = [write_parquet(tmp_path / "dicts.parquet", dict_rows), write_parquet(tmp_path / "raw.parquet", raw_rows),
             write_jsonl(tmp_path / "paths.jsonl", path_rows)]
    ds = RLDataset.from_files([str(f) for f in files], tokenizer, max_prompt_length=128, vision=vision)
    assert len(ds) == 5
    # 56x56 pixels -> a 4x4 patch grid (patch 14) -> 2x2 merged patches -> 4 image tokens.
    for row in ds:
        assert row.images == (data,)
        assert row.image_grid_thw == ((1, 4, 4),)
        assert row.prompt_ids.count(IMAGE_PAD) == 4
        assert row.messages == [{"role": "user", "content": "<image>Which colour is the square?"}]
    text = tokenizer.decode(ds[0].prompt_ids)
    assert text.startswith("<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>Which colour")
    assert ds[0].prompt_ids == ds[3].prompt_ids
    # The image processor agrees with the grid kept: its own patches for the kept bytes.
    from hybridflow.data.images import decode_image

    processed = vision.process([decode_image(ds[0].images[0])])
    assert processed["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert processed["pixel_values"].shape == (16, 3 * 2 * 14 * 14)


def test_two_images_of_different_sizes_expand_in_order(tmp_path, tokenizer, vision):
    row = vl_row([png(size=(56, 56)), png(size=(112, 56))], content="<image> and <image>: same colour?")
    ds = load(write_parquet(tmp_path / "t.parquet", [row]), tokenizer, vision)
    assert ds[0].image_grid_thw == ((1, 4, 4), (1, 4, 8))
    ids = ds[0].prompt_ids
    first = ids.index(IMAGE_PAD)
    assert ids[first:first + 4] == [IMAGE_PAD] * 4 and ids[first + 4] == VL_TOKEN_IDS["<|vision_end|>"]
    assert ids.count(IMAGE_PAD) == 4 + 8


@pytest.mark.parametrize(
    "good, images, content, reason, message",
    [
        (png(), [b"not an image"], "<image>x", BadRowReason.IMAGE_UNREADABLE,
         "'images' image 0 is not a readable image"),
        ("ok.png", ["missing.png"], "<image>x", BadRowReason.IMAGE_UNREADABLE, "no such file"),
        ({"bytes": png(), "path": None}, [{"bytes": None, "path": None}], "<image>x", BadRowReason.IMAGE_UNREADABLE,
         "neither 'bytes' nor 'path'"),
        (png(), [png(), png()], "<image>x", BadRowReason.IMAGES_INVALID, "2 images but the prompt has 1 <image>"),
        (png(), None, "<image>x", BadRowReason.IMAGES_INVALID, "1 <image> placeholders but no 'images'"),
    ],
)
def test_a_bad_image_names_the_file_the_row_and_the_image(tmp_path, tokenizer, vision, good, images, content, reason,
                                                           message):
    (tmp_path / "ok.png").write_bytes(png())
    rows = [vl_row([good]), vl_row(images, content=content)]
    path = write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError, match=f"train.parquet row 1: .*{message}"):
        load(path, tokenizer, vision)
    ds = load(path, tokenizer, vision, on_bad_row="skip")
    assert len(ds) == 1 and ds.stats.bad_rows == {reason: 1}


def test_a_truncated_image_file_is_caught_at_load_time(tmp_path, tokenizer, vision):
    data = png(size=(200, 200))
    rows = [vl_row([data[: len(data) // 2]])]
    with pytest.raises(DataError, match="row 0: 'images' image 0 is not a readable image"):
        load(write_parquet(tmp_path / "t.parquet", rows), tokenizer, vision)


def test_images_for_a_text_only_model_are_refused_not_ignored(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [vl_row([png()])])
    with pytest.raises(DataError, match="row 0: the row has 1 images in 'images' but model.path is a text-only model"):
        RLDataset.from_files([str(path)], build_tiny_tokenizer(), max_prompt_length=128)


def test_a_prompt_with_images_is_filtered_or_refused_when_too_long_never_truncated(tmp_path, tokenizer, vision):
    path = write_parquet(tmp_path / "t.parquet", [vl_row([png()]), {**vl_row([]), "images": None}])
    # Row 1 has no images (null column) and no placeholder: "<image>" is removed from its text.
    rows = pq.read_table(path).to_pylist()
    rows[1]["prompt"][0]["content"] = "Which colour?"
    path = write_parquet(tmp_path / "t.parquet", rows)
    long_enough = len(load(path, tokenizer, vision)[0].prompt_ids)
    with pytest.raises(DataError, match="a prompt with images is not truncated"):
        load(path, tokenizer, vision, max_prompt_length=long_enough - 1, filter_overlong_prompts=False,
             truncation="left")
    ds = load(path, tokenizer, vision, max_prompt_length=long_enough - 1)
    assert len(ds) == 1 and ds.stats.num_filtered_overlong == 1 and ds[0].images == ()


def test_expand_image_tokens_checks_the_count(vision):
    with pytest.raises(ValueError, match="2 image placeholders in the prompt for 1 images"):
        vision.expand_image_tokens([IMAGE_PAD, 5, IMAGE_PAD], torch.tensor([[1, 4, 4]]))

"""data.image_key (the column a row's images are read from) and data.return_raw_chat (whether samples keep
the prompt's chat messages), from the dataset up through a run built from the config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.data.dataset import DataError, RLDataset

from test_data_vl_dataset import IMAGE_PAD, png, tokenizer, vision, vl_dir, vl_row, write_parquet  # noqa: F401 (fixtures)


def picture_row(**kwargs) -> dict:
    row = vl_row([png()], **kwargs)
    row["pictures"] = row.pop("images")
    return row


def test_image_key_selects_the_column_images_are_read_from(tmp_path, tokenizer, vision):
    path = write_parquet(tmp_path / "pictures.parquet", [picture_row()])
    (row,) = RLDataset.from_files([str(path)], tokenizer, max_prompt_length=128, vision=vision, image_key="pictures")
    assert len(row.images) == 1 and row.prompt_ids.count(IMAGE_PAD) > 0
    # verl's default column is absent from these rows: their <image> placeholder has no image.
    with pytest.raises(DataError, match="placeholders but no 'images'"):
        RLDataset.from_files([str(path)], tokenizer, max_prompt_length=128, vision=vision)


def test_return_raw_chat_keeps_or_drops_the_prompt_messages_of_each_sample(tmp_path, tokenizer, vision):
    path = write_parquet(tmp_path / "rows.parquet", [vl_row([png()])])
    (kept,) = RLDataset.from_files([str(path)], tokenizer, max_prompt_length=128, vision=vision)
    assert kept.row_fields().as_dict()["prompt_messages"] == [
        {"role": "user", "content": "<image>Which colour is the square?"}]
    (dropped,) = RLDataset.from_files([str(path)], tokenizer, max_prompt_length=128, vision=vision,
                                      return_raw_chat=False)
    assert "prompt_messages" not in dropped.row_fields().as_dict() and dropped.messages is None
    assert dropped.prompt_ids == kept.prompt_ids and dropped.images == kept.images  # generation is the same


def text_rows(path: Path) -> Path:
    """Arithmetic rows in verl's schema, each with a 'pictures' column a text-only model cannot take."""
    rows = [{"data_source": "hybridflow/arithmetic", "prompt": [{"role": "user", "content": f"{a} + 1 ="}],
             "reward_model": {"style": "rule", "ground_truth": str(a + 1)}, "pictures": ["red.png"]}
            for a in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    from hybridflow.models.tiny import TinyModelSpec, write_tiny_model

    root = tmp_path_factory.mktemp("raw_chat")
    model_dir = write_tiny_model(root / "model", TinyModelSpec(num_hidden_layers=1), seed=0)
    return root, model_dir, text_rows(root / "train.jsonl")


def build(run_files, *overrides: str):
    from hybridflow.config import load_config
    from hybridflow.controller.setup import build_run

    root, model_dir, train = run_files
    cfg = load_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{train}]",
        f"trainer.output_dir={root / 'run'}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        "trainer.num_threads=1", "trainer.timeline=false", "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=4", *overrides,
    ])
    return build_run(cfg)


def test_a_run_reads_the_configured_columns(run_files):
    run = build(run_files, "data.return_raw_chat=false")  # 'pictures' is not the image column: ignored
    try:
        assert all("prompt_messages" not in row.row_fields().as_dict() for row in run.prompts.train)
    finally:
        run.close()
    with pytest.raises(DataError, match="images in 'pictures' but model.path is a text-only model"):
        build(run_files, "data.image_key=pictures")


def test_configs_that_need_the_raw_chat_refuse_to_drop_it():
    from hybridflow.api import make_config
    from hybridflow.config import ConfigError
    from hybridflow.config.validate import validate_config

    with pytest.raises(ConfigError, match=r"reward_model\.enable=true renders each prompt from its chat messages"):
        validate_config(make_config(overrides=["data.return_raw_chat=false", "reward_model.enable=true",
                                               "reward_model.style=generative",
                                               "reward_model.judge.base_url=http://127.0.0.1:1/v1"]))
    with pytest.raises(ConfigError, match=r"data\.image_key='pictures' names a column of data\.train_files"):
        validate_config(make_config(overrides=["data.builtin_task=colour_square", "data.image_key=pictures"]))

"""The built-in visual task: deterministic rows whose answer is in the pixels, and its reward."""

from __future__ import annotations

import pytest

from hybridflow.data.dataset import RLDataset
from hybridflow.data.images import decode_image
from hybridflow.data.tasks.colour_square import BACKGROUNDS, COLOURS, make_colour_square_rows, write_colour_square_task
from hybridflow.models.tiny import VL_CHAT_TEMPLATE, VL_SPECIAL_TOKENS, VL_TOKEN_IDS, build_tiny_tokenizer, build_tiny_vl_processor
from hybridflow.rewards.colour_square import compute_score
from hybridflow.rewards.registry import default_compute_score


def test_rows_are_deterministic_and_the_answer_is_the_only_non_background_colour():
    rows = make_colour_square_rows(24, seed=3, split="train")
    assert rows == make_colour_square_rows(24, seed=3, split="train")
    assert rows[0]["images"] != make_colour_square_rows(1, seed=3, split="test")[0]["images"]
    assert {r["reward_model"]["ground_truth"] for r in rows} == set(COLOURS)  # every colour drawn
    for row in rows:
        image = decode_image(row["images"][0]["bytes"])
        colours = {colour for _, colour in image.getcolors()}
        answer = COLOURS[row["reward_model"]["ground_truth"]]
        assert answer in colours and colours - {answer} <= set(BACKGROUNDS) and len(colours) == 2


def test_the_task_files_load_with_four_image_tokens_per_prompt(tmp_path):
    train, test = write_colour_square_task(tmp_path, train_size=8, val_size=4, seed=0)
    tok = build_tiny_tokenizer(VL_SPECIAL_TOKENS, VL_CHAT_TEMPLATE)
    ds = RLDataset.from_files([str(train)], tok, max_prompt_length=128, vision=build_tiny_vl_processor(),
                              data_sources={"hybridflow/colour_square"})
    assert len(ds) == 8 and all(r.prompt_ids.count(VL_TOKEN_IDS["<|image_pad|>"]) == 4 for r in ds)
    assert all(r.image_grid_thw == ((1, 4, 4),) for r in ds)


def test_exact_match_reward():
    assert compute_score(" red\n", "red") == 1.0
    assert compute_score("Red", "red") == compute_score("red.", "red") == compute_score("blue", "red") == 0.0
    assert default_compute_score("hybridflow/colour_square", "green", "green") == 1.0
    with pytest.raises(ValueError, match="must be a colour name"):
        compute_score("red", "")


def test_the_visual_task_needs_a_vision_language_model(tmp_path):
    from hybridflow.api import make_config
    from hybridflow.config import ConfigError
    from hybridflow.controller.preflight import check_vision_language_run
    from hybridflow.models.tiny import write_tiny_model

    # The built-in model of a visual task is the tiny Qwen2-VL: the preset runs it as it is, and
    # what no VL model may do is refused for it too.
    check_vision_language_run(make_config("colour_square"))
    with pytest.raises(ConfigError, match="rollout.name=native cannot generate from images") as refused:
        check_vision_language_run(make_config(overrides=["data.builtin_task=colour_square"]))
    assert refused.value.key == "rollout.name"
    with pytest.raises(ConfigError, match="a critic on image rows is not built"):
        check_vision_language_run(make_config("colour_square", overrides=["algorithm.adv_estimator=gae"]))
    # A text-only model directory cannot see the images.
    text_model = write_tiny_model(tmp_path / "text")
    with pytest.raises(ConfigError, match="data.builtin_task=colour_square asks about images: set model.path"):
        check_vision_language_run(make_config(overrides=["data.builtin_task=colour_square", f"model.path={text_model}",
                                                         "rollout.name=hf_vision"]))

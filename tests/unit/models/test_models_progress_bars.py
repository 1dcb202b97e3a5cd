"""Our loads and saves draw no transformers progress bars, and leave the bar switches as they were."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from huggingface_hub import constants as hub_constants
from huggingface_hub.utils import are_progress_bars_disabled
from transformers.utils import logging as hf_logging

from hybridflow.models.loading import hf_progress_bars_off, load_causal_lm
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model

SMALL = TinyModelSpec(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
BAR_TEXT = ("Loading weights", "Writing model shards")


@pytest.fixture
def bars_on() -> Iterator[None]:
    """transformers' bars on (its default) for the test, and put back as found afterwards."""
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    yield
    (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()


def test_loading_and_saving_draw_no_bars(bars_on, tmp_path, capfd):
    model_dir = write_tiny_model(tmp_path / "model", SMALL)
    model = load_causal_lm(model_dir)
    with hf_progress_bars_off():
        model.save_pretrained(tmp_path / "again")
    err = capfd.readouterr().err
    assert not [text for text in BAR_TEXT if text in err], err
    # Outside our calls the bars are the user's business: on, as before.
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
    model.save_pretrained(tmp_path / "theirs")
    assert "Writing model shards" in capfd.readouterr().err  # the bar this suppresses, when it is not


def test_nested_uses_put_back_the_state_only_at_the_outermost_exit(bars_on):
    with hf_progress_bars_off():
        with hf_progress_bars_off():
            assert not hf_logging.is_progress_bar_enabled()
        assert not hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()


def test_bars_a_user_switched_off_stay_off(bars_on):
    hf_logging.disable_progress_bar()
    with hf_progress_bars_off():
        pass
    assert not hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()


def test_a_user_who_asks_for_bars_keeps_them(bars_on, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_PROGRESS_BARS", False)  # HF_HUB_DISABLE_PROGRESS_BARS=0
    with hf_progress_bars_off():
        assert hf_logging.is_progress_bar_enabled()

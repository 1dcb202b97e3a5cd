""""Did you mean" names a key only when the name written reads as a typo of it: unrelated keys
that merely share words or a section (verl's keys hybridflow lacks) get the section's key list."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.config.coerce import _similar_name


@pytest.mark.parametrize(
    ("override", "misleading"),
    [
        # issue 32: what these suggested before the name rule
        ("actor_rollout_ref.actor.use_torch_compile=true", "actor.entropy_coeff"),
        ("data.return_raw_chat=true", "data.truncation"),
        ("megatron.pipeline_model_parallel_size=2", "rollout.tensor_model_parallel_size"),
    ],
)
def test_an_unrelated_key_is_not_suggested(override: str, misleading: str) -> None:
    written = override.partition("=")[0].rsplit(".", 1)[-1]
    assert not _similar_name(written, misleading.rsplit(".", 1)[-1])
    try:
        load_config(overrides=[override])
    except ConfigError as exc:  # the key may exist by now (use_torch_compile, return_raw_chat)
        assert misleading not in str(exc), str(exc)
        if "did you mean" in str(exc):  # a suggestion, if any, is a key of the name written
            assert f".{written}'?" in str(exc), str(exc)


def test_a_top_level_section_hybridflow_lacks_lists_the_sections() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["megatron.pipeline_model_parallel_size=2"])
    assert "did you mean" not in str(info.value) and "valid keys at the top level: data, model" in str(info.value)


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("actor.entrpy_coeff=0.01", "actor.entropy_coeff"),  # a dropped letter
        ("actor_rollout_ref.actor.entrpy_coeff=0.01", "actor.entropy_coeff"),  # in verl's spelling too
        ("actor.entropy_ceoff=0.01", "actor.entropy_coeff"),  # two letters swapped
        ("rollout.tensor_model_paralel_size=2", "rollout.tensor_model_parallel_size"),
        ("data.train_batch=8", "data.train_batch_size"),  # cut short
        ("rollout.nn=4", "rollout.n"),  # one slip in a one-letter name
    ],
)
def test_a_true_typo_still_gets_its_suggestion(override: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        load_config(overrides=[override])


def test_the_name_rule() -> None:
    assert _similar_name("lrr", "lr") and _similar_name("rolout", "rollout") and _similar_name("optm", "optim")
    assert not _similar_name("pipeline_model_parallel_size", "tensor_model_parallel_size")  # shares a long tail
    assert not _similar_name("use_torch_compile", "entropy_coeff")
    assert _similar_name("total_training_step", "total_training_steps")

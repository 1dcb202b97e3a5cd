"""``hybridflow rm``'s start-up checks: each wrong setting is refused naming its key, before anything
loads; ``rm.max_length`` defaults to the reward-model role's own cut (max_position_embeddings)."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.controller.rm_run import check_rm_config, rm_max_length
from hybridflow.models.tiny import write_tiny_model


@pytest.mark.parametrize("overrides, key", [
    (["rm.center_rewards_coefficient=-0.1"], "rm.center_rewards_coefficient"),
    (["rm.max_length=1"], "rm.max_length"),
    (["actor.lora.rank=8"], "actor.lora.rank"),
    (["model.path=/some/model"], "data.train_files"),
    (["data.builtin_task=calculator"], "data.builtin_task"),
    (["trainer.save_final=false"], "rm.export"),
    (["trainer.n_workers=3", "data.train_batch_size=32"], "data.train_batch_size"),
    (["dpo.builtin_prompts=0"], "dpo.builtin_prompts"),
])
def test_a_wrong_setting_is_refused_naming_its_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        check_rm_config(load_config(None, None, overrides))
    assert info.value.key == key


def test_the_default_built_in_run_passes(tmp_path):
    check_rm_config(load_config(None, None, []))
    model = str(write_tiny_model(tmp_path / "tiny"))
    assert rm_max_length(load_config(None, None, []), model) == 512  # the tiny model's max_position_embeddings
    assert rm_max_length(load_config(None, None, ["rm.max_length=64"]), model) == 64

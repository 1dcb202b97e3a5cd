"""``hybridflow dpo``'s start-up checks: each wrong setting is refused naming its key, before anything loads."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.controller.dpo_run import check_dpo_config


@pytest.mark.parametrize("overrides, key", [
    (["dpo.beta=0"], "dpo.beta"),
    (["dpo.label_smoothing=0.5"], "dpo.label_smoothing"),
    (["dpo.sft_weight=-1"], "dpo.sft_weight"),
    (["model.path=/some/model"], "data.train_files"),
    (["data.builtin_task=calculator"], "data.builtin_task"),
    (["trainer.save_final=false"], "dpo.export"),
    (["trainer.n_workers=3", "data.train_batch_size=32"], "data.train_batch_size"),
    (["dpo.max_length=1"], "dpo.max_length"),
    (["dpo.builtin_samples=0"], "dpo.builtin_samples"),
])
def test_a_wrong_setting_is_refused_naming_its_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        check_dpo_config(load_config(None, None, overrides))
    assert info.value.key == key


def test_the_default_built_in_run_passes():
    check_dpo_config(load_config(None, None, []))


def test_ranks_on_ray_pass():
    check_dpo_config(load_config(None, None, ["trainer.backend=ray", "trainer.n_workers=2"]))

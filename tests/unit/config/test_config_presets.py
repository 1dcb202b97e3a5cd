"""Every shipped preset parses, validates, documents itself, and sets what its name promises."""

from __future__ import annotations

import pytest

from hybridflow.config import Config, ConfigError, list_presets, load_config, preset_path, validate_config
from hybridflow.config.yaml_io import read_yaml_mapping

EXPECTED_PRESETS = {"grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "remax", "cispo", "sapo", "gpg", "ppo", "distill",
                    "online_dpo", "prime"}


def test_expected_presets_ship() -> None:
    assert EXPECTED_PRESETS <= set(list_presets())


@pytest.mark.parametrize("name", list_presets())
def test_preset_parses_and_validates(name: str) -> None:
    cfg = load_config(name)
    assert isinstance(cfg, Config)
    assert validate_config(cfg) == []


@pytest.mark.parametrize("name", list_presets())
def test_preset_starts_with_comment_naming_its_source(name: str) -> None:
    text = preset_path(name).read_text(encoding="utf-8")
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert text.startswith("# "), f"{name}.yaml must open with a comment saying what it is"
    assert any("Source:" in line for line in header), f"{name}.yaml must name its source"


@pytest.mark.parametrize("name", list_presets())
def test_preset_is_a_partial_mapping(name: str) -> None:
    assert read_yaml_mapping(preset_path(name))  # non-empty: a preset states its algorithm


def test_dr_grpo() -> None:
    cfg = load_config("dr_grpo")
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert cfg.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert cfg.actor.use_kl_loss is False


def test_rloo() -> None:
    assert load_config("rloo").algorithm.adv_estimator == "rloo"


def test_reinforce_pp_follows_verl_example_kl_loss() -> None:
    cfg = load_config("reinforce_pp")
    assert cfg.algorithm.adv_estimator == "reinforce_plus_plus"
    assert cfg.actor.use_kl_loss is True
    assert cfg.actor.kl_loss_coef == 0.001
    assert cfg.actor.kl_loss_type == "mse"
    assert cfg.algorithm.use_kl_in_reward is False


def test_dapo() -> None:
    cfg = load_config("dapo")
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.28)
    assert cfg.actor.loss_agg_mode == "token-mean"
    assert cfg.actor.use_kl_loss is False
    assert cfg.algorithm.use_kl_in_reward is False
    assert cfg.actor.loss_agg_mode == "token-mean"
    assert cfg.algorithm.filter_groups.enable is True
    assert cfg.reward.overlong_buffer.enable is True
    assert cfg.actor.use_kl_loss is False and cfg.algorithm.use_kl_in_reward is False


@pytest.mark.parametrize(
    ("preset", "estimator", "loss_mode"),
    [("gspo", "grpo", "gspo"), ("remax", "remax", "vanilla"), ("cispo", "grpo", "cispo"),
     ("sapo", "grpo", "sapo"), ("gpg", "gpg", "gpg")],
)
def test_preset_selects_its_estimator_and_loss(preset: str, estimator: str, loss_mode: str) -> None:
    cfg = load_config(preset)
    assert (cfg.algorithm.adv_estimator, cfg.actor.policy_loss.loss_mode) == (estimator, loss_mode)


def test_gspo_uses_the_papers_sequence_level_clip_ranges() -> None:
    cfg = load_config("gspo")
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (3e-4, 4e-4)
    assert cfg.actor.loss_agg_mode == "seq-mean-token-mean"


def test_distill_is_pure_distillation_from_the_builtin_teacher() -> None:
    d = load_config("distill").distillation
    assert d.enable and d.teacher.path == "builtin:tiny-teacher" and d.teachers == {}
    assert (d.kl_coef, d.reward_weight, d.discount) == (1.0, 0.0, 0.0)


# hybridflow rm's own presets (presets/rm/): they set shared keys (trainer.total_training_steps), so they are
# not train's, and train's set nothing rm reads.
@pytest.mark.parametrize("name", list_presets("rm"))
def test_an_rm_preset_parses_validates_and_names_its_source(name: str) -> None:
    cfg = load_config(name, command="rm")
    assert validate_config(cfg) == []
    text = preset_path(name, "rm").read_text(encoding="utf-8")
    assert text.startswith("# ") and "Source:" in text
    assert name not in list_presets()  # train never loads it


def test_rm_builtin_is_the_recipe_that_learns_the_builtin_pairs() -> None:
    cfg = load_config("builtin", None, ["trainer.seed=3"], command="rm")
    assert (cfg.rm.builtin_prompts, cfg.rm.extra_layers) == (5026, 2)
    assert cfg.trainer.total_training_steps == 1000 and cfg.model.dtype == "float32"
    assert cfg.trainer.seed == 3  # overrides still win
    assert cfg.trainer.experiment_name.startswith("rm-builtin-")


def test_a_preset_of_another_command_is_refused_naming_the_commands_presets() -> None:
    with pytest.raises(ConfigError, match="hybridflow rm's presets: builtin"):
        load_config("grpo", command="rm")
    with pytest.raises(ConfigError, match="unknown preset 'builtin'"):
        load_config("builtin")

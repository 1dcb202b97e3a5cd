"""Loading: layer precedence, type checking, unknown keys with suggestions, YAML file errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from hybridflow.config import (
    Config,
    ConfigError,
    apply_override,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    list_presets,
    load_config,
    schema_keys,
)


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(**kwargs: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)  # type: ignore[arg-type]
    return info.value


# --------------------------------------------------------------------------------------------
# Defaults and precedence


def test_no_preset_gives_schema_defaults() -> None:
    assert load_config(preset=None) == Config()


def test_grpo_preset_equals_schema_defaults() -> None:
    assert load_config("grpo") == Config()


def test_precedence_defaults_preset_file_override(tmp_path: Path) -> None:
    config_file = write(
        tmp_path,
        """
        actor:
          clip_ratio_high: 0.3      # beats the dapo preset's 0.28
          optim:
            lr: 2.0e-6
        trainer:
          experiment_name: from-file
        """,
    )
    cfg = load_config("dapo", config_file, ["actor.optim.lr=5e-6"])
    assert cfg.actor.clip_ratio_low == 0.2  # preset
    assert cfg.actor.clip_ratio_high == 0.3  # file over preset
    assert cfg.actor.optim.lr == 5e-6  # override over file
    assert cfg.trainer.experiment_name == "from-file"
    assert cfg.data.train_batch_size == Config().data.train_batch_size  # untouched default


def test_preset_named_in_file_is_applied_before_the_file(tmp_path: Path) -> None:
    config_file = write(
        tmp_path,
        """
        preset: dr_grpo
        actor:
          use_kl_loss: true
        """,
    )
    cfg = load_config("grpo", config_file)
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False  # from dr_grpo
    assert cfg.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert cfg.actor.use_kl_loss is True  # the file beats its own preset


def test_later_overrides_win() -> None:
    cfg = load_config(overrides=["rollout.n=4", "rollout.n=6"])
    assert cfg.rollout.n == 6


def test_unknown_preset_suggests_closest() -> None:
    err = error_of(preset="dapoo")
    assert "unknown preset 'dapoo'" in str(err)
    assert "did you mean 'dapo'?" in str(err)


def test_preset_in_file_must_be_a_name(tmp_path: Path) -> None:
    err = error_of(config_file=write(tmp_path, "preset: 3\n"))
    assert "'preset' must be a preset name" in str(err)
    assert "run.yaml" in str(err)


def test_overrides_as_single_string_is_refused() -> None:
    with pytest.raises(TypeError, match="sequence"):
        load_config(overrides="rollout.n=4")  # type: ignore[arg-type]


def test_loaded_configs_do_not_share_mutable_defaults() -> None:
    first = load_config(overrides=["trainer.logger=[console]"])
    second = load_config()
    assert first.trainer.logger == ["console"]
    assert second.trainer.logger == ["console", "jsonl"]


# --------------------------------------------------------------------------------------------
# Overrides of every supported type


@pytest.mark.parametrize(
    ("override", "path", "expected"),
    [
        ("data.train_batch_size=64", "data.train_batch_size", 64),
        ("actor.optim.lr=1e-5", "actor.optim.lr", 1e-5),  # YAML 1.1 alone would give a string
        ("actor.optim.lr=3E-4", "actor.optim.lr", 3e-4),
        ("actor.optim.lr=2.5e-6", "actor.optim.lr", 2.5e-6),
        ("actor.clip_ratio=1", "actor.clip_ratio", 1.0),  # int accepted for float
        ("actor.entropy_coeff=-0.001", "actor.entropy_coeff", -0.001),
        ("data.shuffle=false", "data.shuffle", False),
        ("data.shuffle=True", "data.shuffle", True),
        ("model.path=/models/qwen", "model.path", "/models/qwen"),
        ("model.path='builtin:tiny'", "model.path", "builtin:tiny"),
        ("trainer.experiment_name=2024", "trainer.experiment_name", "2024"),  # str keeps the text
        ("trainer.experiment_name=1.10", "trainer.experiment_name", "1.10"),
        ("trainer.experiment_name=true", "trainer.experiment_name", "true"),
        ("trainer.output_dir=null", "trainer.output_dir", None),
        ("trainer.output_dir=runs/x", "trainer.output_dir", "runs/x"),
        ("trainer.total_training_steps=null", "trainer.total_training_steps", None),
        ("trainer.total_training_steps=7", "trainer.total_training_steps", 7),
        ("actor.clip_ratio_high=0.28", "actor.clip_ratio_high", 0.28),
        ("actor.clip_ratio_high=null", "actor.clip_ratio_high", None),
        ("data.seed=~", "data.seed", None),
        ("trainer.logger=[console, wandb]", "trainer.logger", ["console", "wandb"]),
        ("trainer.logger=[]", "trainer.logger", []),
        ("data.train_files=[a.parquet, b.jsonl]", "data.train_files", ["a.parquet", "b.jsonl"]),
        ("actor.optim.betas=[0.9, 0.95]", "actor.optim.betas", [0.9, 0.95]),
        ("actor.optim.betas=[1, 1e-1]", "actor.optim.betas", [1.0, 0.1]),
        ("warm_start.enable=true", "warm_start.enable", "true"),  # str choice spelled like a bool
        ("warm_start.enable=false", "warm_start.enable", "false"),
        ("data.truncation=left", "data.truncation", "left"),
        ("actor.optim={lr: 1e-5, weight_decay: 0}", "actor.optim.weight_decay", 0.0),
        (" rollout.n = 4", "rollout.n", 4),  # spaces around the key are ignored
    ],
)
def test_override_types(override: str, path: str, expected: object) -> None:
    value: object = load_config(overrides=[override])
    for name in path.split("."):
        value = getattr(value, name)
    assert value == expected
    assert type(value) is type(expected)


def test_apply_override_mutates_in_place() -> None:
    cfg = Config()
    apply_override(cfg, "rollout.val_kwargs.top_p=0.9")
    assert cfg.rollout.val_kwargs.top_p == 0.9


# --------------------------------------------------------------------------------------------
# Type errors


@pytest.mark.parametrize(
    ("override", "expected_type", "shown_value"),
    [
        ("data.shuffle=1", "bool", "int 1"),  # never a silent 0/1 -> bool
        ("data.shuffle=yes", "bool", "str 'yes'"),  # YAML 1.1's yes/no are not booleans here
        ("data.shuffle='0'", "bool", "str '0'"),
        ("data.train_batch_size=32.0", "int", "float 32.0"),
        ("data.train_batch_size=true", "int", "bool True"),
        ("data.train_batch_size=many", "int", "str 'many'"),
        ("actor.optim.lr=fast", "float", "str 'fast'"),
        ("actor.optim.lr=true", "float", "bool True"),
        ("actor.optim.lr=inf", "float", "float inf"),  # Hydra's spelling of infinity
        ("trainer.phase_timeouts=gen", "list[str]", "str 'gen'"),  # a lone string is a list only for the file keys
        ("trainer.logger=[console, 3]", "str", "int 3"),
        ("actor.optim.betas=[0.9, high]", "float", "str 'high'"),
        ("model.path=null", "str", "null"),
        ("model.path=[a, b]", "str", "list"),
        ("trainer.total_training_steps=ten", "int", "str 'ten'"),
    ],
)
def test_wrong_type_names_key_value_and_type(override: str, expected_type: str, shown_value: str) -> None:
    key = override.split("=", 1)[0]
    err = error_of(overrides=[override])
    message = str(err)
    assert f"'{key}" in message
    assert f"expects {expected_type}" in message or f"expects {expected_type} | None" in message
    assert shown_value in message
    assert override in message  # names where it came from


def test_wrong_type_in_yaml_file_names_file_and_key(tmp_path: Path) -> None:
    config_file = write(tmp_path, "trainer:\n  experiment_name: 2024\n")
    err = error_of(config_file=config_file)
    assert "'trainer.experiment_name' expects str, got int 2024" in str(err)
    assert "quote it" in str(err)
    assert str(config_file) in str(err)
    assert err.key == "trainer.experiment_name"


def test_float_from_plain_string_in_dict() -> None:
    cfg = config_from_dict({"actor": {"optim": {"lr": "1e-5"}}})
    assert cfg.actor.optim.lr == 1e-5


def test_bad_choice_lists_allowed_values() -> None:
    err = error_of(overrides=["data.truncation=middle"])
    assert "'data.truncation'" in str(err)
    assert "'middle'" in str(err)
    assert "error, left, right" in str(err)


def test_bad_choice_suggests_closest() -> None:
    err = error_of(overrides=["model.dtype=bfloat61"])
    assert "did you mean 'bfloat16'?" in str(err)


def test_bool_into_str_choice_without_that_choice_is_refused() -> None:
    err = error_of(overrides=["trainer.device=true"])
    assert "allowed values: auto, cpu, cuda, npu" in str(err)


# --------------------------------------------------------------------------------------------
# Unknown keys


@pytest.mark.parametrize(
    ("override", "named", "suggestion"),
    [
        ("actor.optim.lrr=1e-5", "actor.optim.lrr", "actor.optim.lr"),
        ("rolout.n=4", "rolout.n", "rollout.n"),  # misspelt section
        ("actor.optm.lr=1e-5", "actor.optm.lr", "actor.optim.lr"),  # misspelt inner section
        ("actor.lr=1e-5", "actor.lr", "actor.optim.lr"),  # right name, wrong section
        ("trainer.total_training_step=5", "trainer.total_training_step", "trainer.total_training_steps"),
        ("data.train_batch=8", "data.train_batch", "data.train_batch_size"),
    ],
)
def test_unknown_key_override_suggests(override: str, named: str, suggestion: str) -> None:
    err = error_of(overrides=[override])
    assert f"unknown config key '{named}'; did you mean '{suggestion}'?" in str(err)
    assert err.key == named


def test_unknown_key_message_matches_spec_form() -> None:
    err = error_of(overrides=["actor.optim.lrr=1"])
    assert str(err).startswith("unknown config key 'actor.optim.lrr'; did you mean 'actor.optim.lr'?")


def test_unknown_key_without_close_match_lists_section_keys() -> None:
    err = error_of(overrides=["zzz.qqq=1"])
    assert "unknown config key 'zzz.qqq'" in str(err)
    assert "valid keys at the top level: data, model" in str(err)


def test_unknown_section_in_yaml_file(tmp_path: Path) -> None:
    config_file = write(tmp_path, "rolout:\n  n: 4\n")
    err = error_of(config_file=config_file)
    assert "unknown config key 'rolout.n'; did you mean 'rollout.n'?" in str(err)
    assert str(config_file) in str(err)


def test_unknown_leaf_in_yaml_file(tmp_path: Path) -> None:
    err = error_of(config_file=write(tmp_path, "actor:\n  optim:\n    lrr: 1.0e-5\n"))
    assert "unknown config key 'actor.optim.lrr'; did you mean 'actor.optim.lr'?" in str(err)


def test_unknown_key_in_dict() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm\.adv_estimater'; did you mean"):
        config_from_dict({"algorithm": {"adv_estimater": "rloo"}})


def test_preset_as_override_explains_how_to_choose_one() -> None:
    err = error_of(overrides=["preset=dapo"])
    assert "--preset NAME" in str(err)


def test_key_below_a_leaf_is_an_error() -> None:
    err = error_of(overrides=["actor.optim.lr.value=1"])
    assert "'actor.optim.lr' is a float value, not a section" in str(err)


def test_section_given_a_scalar_is_an_error(tmp_path: Path) -> None:
    err = error_of(config_file=write(tmp_path, "actor: 3\n"))
    assert "'actor' is a section and expects a mapping" in str(err)


def test_section_override_with_mapping_checks_its_keys() -> None:
    err = error_of(overrides=["actor.optim={lrr: 1}"])
    assert "unknown config key 'actor.optim.lrr'" in str(err)


def test_empty_section_in_file_is_allowed(tmp_path: Path) -> None:
    # "actor:" with every child commented out parses as null.
    cfg = load_config(config_file=write(tmp_path, "actor:\n  # optim:\n  #   lr: 1.0\n"))
    assert cfg == Config()


def test_non_string_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match="config keys must be strings, got 1 under 'actor'"):
        config_from_dict({"actor": {1: 2}})


# --------------------------------------------------------------------------------------------
# Malformed overrides


@pytest.mark.parametrize("override", ["actor.optim.lr", "rollout.n:4", ""])
def test_override_without_equals(override: str) -> None:
    err = error_of(overrides=[override])
    assert "no '='" in str(err)
    assert "section.key=value" in str(err)


@pytest.mark.parametrize("override", ["--rollout.n=4", "actor..lr=1", "=3", "rollout n=4", "+-trainer.seed=3"])
def test_override_with_malformed_key(override: str) -> None:
    err = error_of(overrides=[override])
    assert "malformed override" in str(err)
    assert "section.key=value" in str(err)


def test_override_with_invalid_value() -> None:
    err = error_of(overrides=["trainer.logger=[console"])
    assert "'trainer.logger'" in str(err)
    assert "cannot be read" in str(err)


# --------------------------------------------------------------------------------------------
# YAML files


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    err = error_of(config_file=missing)
    assert f"config file '{missing}' does not exist" in str(err)


def test_config_file_is_a_directory(tmp_path: Path) -> None:
    err = error_of(config_file=tmp_path)
    assert "is a directory" in str(err)


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("just text\n", "str"), ("3\n", "int")])
def test_config_file_not_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    config_file = write(tmp_path, text)
    err = error_of(config_file=config_file)
    assert f"config file '{config_file}' must hold a mapping" in str(err)
    assert f"got a {kind}" in str(err)


def test_invalid_yaml_names_file_and_line(tmp_path: Path) -> None:
    config_file = write(tmp_path, "actor:\n  optim: [1, 2\nrollout:\n  n: 4\n")
    err = error_of(config_file=config_file)
    assert f"config file '{config_file}' is not valid YAML" in str(err)
    assert "line" in str(err)


def test_duplicate_key_in_file_is_an_error(tmp_path: Path) -> None:
    config_file = write(tmp_path, "rollout:\n  n: 4\n  n: 8\n")
    err = error_of(config_file=config_file)
    assert "duplicate key 'n'" in str(err)
    assert "line 2" in str(err)
    assert str(config_file) in str(err)


def test_non_utf8_file(tmp_path: Path) -> None:
    config_file = tmp_path / "latin1.yaml"
    config_file.write_bytes("trainer:\n  experiment_name: caf\xe9\n".encode("latin-1"))
    err = error_of(config_file=config_file)
    assert "not UTF-8" in str(err)


def test_empty_config_file_is_empty_mapping(tmp_path: Path) -> None:
    assert load_config(config_file=write(tmp_path, "# nothing yet\n")) == Config()


def test_yaml_file_with_exponent_float_and_bool_choice(tmp_path: Path) -> None:
    config_file = write(tmp_path, "actor:\n  optim:\n    lr: 1e-5\nwarm_start:\n  enable: false\n")
    cfg = load_config(config_file=config_file)
    assert cfg.actor.optim.lr == 1e-5
    assert cfg.warm_start.enable == "false"


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("preset", list_presets())
def test_yaml_round_trip(preset: str) -> None:
    cfg = load_config(preset, overrides=["trainer.output_dir=~/runs/x", "data.seed=3"])
    assert config_from_dict(yaml.safe_load(config_to_yaml(cfg))) == cfg


def test_yaml_round_trip_through_file(tmp_path: Path) -> None:
    cfg = load_config("reinforce_pp", overrides=["actor.optim.lr=3e-6"])
    config_file = tmp_path / "resolved.yaml"
    config_file.write_text(config_to_yaml(cfg), encoding="utf-8")
    assert load_config(preset=None, config_file=config_file) == cfg


def test_config_to_dict_is_a_deep_copy() -> None:
    cfg = Config()
    data = config_to_dict(cfg)
    data["trainer"]["logger"].append("wandb")
    assert cfg.trainer.logger == ["console", "jsonl"]


def test_config_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        config_from_dict(["actor"])  # type: ignore[arg-type]


def test_schema_keys_cover_nested_sections() -> None:
    keys = schema_keys()
    assert "actor.optim.lr" in keys
    assert "rollout.val_kwargs.temperature" in keys
    assert "actor.optim" not in keys  # sections are not leaves
    assert len(keys) == len(set(keys))

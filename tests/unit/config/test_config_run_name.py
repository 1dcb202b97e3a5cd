"""A run left unnamed is named after the preset that runs and its data (issue 22: a
``--preset dapo`` run was written to ``runs/grpo-arithmetic-...``)."""

from __future__ import annotations

import pytest

from hybridflow.config import list_presets, load_config
from hybridflow.config.loader import default_experiment_name
from hybridflow.controller.setup import resolve_output_dir


@pytest.mark.parametrize("preset", sorted(set(list_presets()) - {"tool_agent", "colour_square"}))
def test_each_preset_names_its_run(preset):
    assert load_config(preset).trainer.experiment_name == f"{preset}-arithmetic"


def test_the_plain_defaults_are_grpo():
    assert load_config(None).trainer.experiment_name == "grpo-arithmetic"
    assert load_config().trainer.experiment_name == "grpo-arithmetic"


def test_a_preset_that_names_its_run_keeps_that_name():
    assert load_config("tool_agent").trainer.experiment_name == "grpo-calculator"
    assert load_config("colour_square").trainer.experiment_name == "grpo-colour-square"


def test_a_name_the_user_gives_wins(tmp_path):
    assert load_config("dapo", overrides=["trainer.experiment_name=mine"]).trainer.experiment_name == "mine"
    config_file = tmp_path / "c.yaml"
    config_file.write_text("trainer:\n  experiment_name: from-file\n")
    assert load_config("dapo", config_file).trainer.experiment_name == "from-file"


def test_a_preset_named_in_a_config_file_names_the_run(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text("preset: gspo\nrollout:\n  n: 4\n")
    assert load_config("grpo", config_file).trainer.experiment_name == "gspo-arithmetic"


def test_the_data_part_follows_the_data():
    cfg = load_config("dapo", overrides=["data.train_files=[~/data/gsm8k/train.parquet]"])
    assert cfg.trainer.experiment_name == "dapo-gsm8k"
    cfg = load_config("rloo", overrides=["data.builtin_task=calculator"])
    assert cfg.trainer.experiment_name == "rloo-calculator"
    cfg = load_config("grpo", overrides=["data.train_files=[train.parquet]"])
    assert default_experiment_name("grpo", cfg) == "grpo-train"
    cfg = load_config("grpo", overrides=["data.train_files=['/data/my set: v2/train.parquet']"])
    assert cfg.trainer.experiment_name == "grpo-my_set_v2"  # safe in a folder name


def test_the_run_folder_follows_the_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = resolve_output_dir(load_config("dapo"))
    assert out.parent.name == "runs" and out.name.startswith("dapo-arithmetic-")

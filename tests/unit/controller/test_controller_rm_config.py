"""``hybridflow rm``'s start-up checks: each wrong setting is refused naming its key, before anything
loads; ``rm.max_length`` defaults to the reward-model role's own cut (max_position_embeddings); the
built-in pairs' training prompts are ``rm.builtin_prompts`` (DPO's are its own)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config import ConfigError, load_config
from hybridflow.controller import pair_run, rm_run
from hybridflow.controller.dpo_builtin import BuiltinPairs
from hybridflow.controller.rm_run import check_rm_config, rm_max_length, rm_start_path
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
    (["rm.builtin_teacher_steps=-1"], "rm.builtin_teacher_steps"),
    (["rm.head_lr=0"], "rm.head_lr"),
    (["rm.builtin_prompts=0"], "rm.builtin_prompts"),
    (["rm.builtin_prompts=5027"], "rm.builtin_prompts"),  # the task has 5,026 training questions
    (["rm.extra_layers=-1"], "rm.extra_layers"),
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


def test_the_built_in_pairs_start_the_reward_model_from_the_built_in_teacher(monkeypatch):
    made = []
    monkeypatch.setattr(rm_run, "builtin_teacher", lambda cfg, device, steps: made.append(steps) or f"/teacher-{steps}")
    cpu = torch.device("cpu")
    assert rm_start_path(load_config(None, None, []), "/warm-start", cpu) == "/teacher-200"
    assert rm_start_path(load_config(None, None, ["rm.builtin_teacher_steps=50"]), "/warm-start", cpu) == "/teacher-50"
    # 0, the user's pairs or the user's model: model.path itself.
    assert rm_start_path(load_config(None, None, ["rm.builtin_teacher_steps=0"]), "/warm-start", cpu) == "/warm-start"
    assert rm_start_path(load_config(None, None, ["data.train_files=[p.jsonl]"]), "/warm-start", cpu) == "/warm-start"
    assert rm_start_path(load_config(None, None, ["model.path=/m", "data.train_files=[p.jsonl]"]), "/m", cpu) == "/m"
    assert made == [200, 50]


def test_the_reward_model_counts_its_built_in_prompts_apart_from_dpo(monkeypatch, tmp_path):
    asked = []

    def fake_pairs(cache_dir, model_dir, *, prompts, val_prompts, samples):
        asked.append((prompts, val_prompts, samples))
        return BuiltinPairs(tmp_path / "train.jsonl", tmp_path / "test.jsonl", [])

    monkeypatch.setattr(pair_run, "builtin_pairs", fake_pairs)
    cfg = load_config(None, None, ["rm.builtin_prompts=300", "dpo.builtin_prompts=20"])
    pair_run.pair_files(cfg, "/warm-start", prompts=cfg.rm.builtin_prompts)  # what hybridflow rm asks for
    pair_run.pair_files(cfg, "/warm-start")  # hybridflow dpo
    assert asked == [(300, 256, 8), (20, 256, 8)]  # the same held-out prompts and samples either way


def test_rm_offers_its_own_presets_not_the_rl_ones(capsys):
    """``hybridflow rm --preset`` names rm's presets (presets/rm/: the built-in recipe), never train's."""
    from hybridflow.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["rm", "--help"])
    help_text = capsys.readouterr().out
    assert "--preset" in help_text and "builtin" in help_text and "dapo" not in help_text
    assert build_parser().parse_args(["rm", "--preset", "builtin"]).preset == "builtin"

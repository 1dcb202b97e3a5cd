"""The critic's config: the ppo preset builds one, gae is no longer refused, and every wrong
critic value fails at start-up naming its key."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.controller.preflight import needs_critic, resolve_plugins


def test_the_ppo_preset_trains_a_critic_with_gae() -> None:
    cfg = load_config("ppo")
    assert validate_config(cfg) == []
    assert (cfg.algorithm.adv_estimator, cfg.algorithm.gamma, cfg.algorithm.lam, cfg.rollout.n) == ("gae", 1.0, 1.0, 1)
    assert needs_critic(resolve_plugins(cfg).estimator_needs)


def test_critic_free_estimators_build_no_critic() -> None:
    assert not needs_critic(resolve_plugins(load_config("grpo")).estimator_needs)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("critic.cliprange_value=-0.1", "critic.cliprange_value=-0.1 must be >= 0"),
        ("critic.optim.lr=0", "critic.optim.lr=0.0 must be > 0"),
        ("critic.optim.betas=[0.9]", "critic.optim.betas=[0.9] must be two numbers"),
        ("critic.loss_agg_mode=token_mean", "critic.loss_agg_mode='token_mean' is not one of"),
        ("critic.ppo_epochs=0", "critic.ppo_epochs=0 must be >= 1 or null"),
        ("critic.ppo_micro_batch_size_per_gpu=0", "critic.ppo_micro_batch_size_per_gpu=0 must be >= 1"),
        ("critic.ppo_mini_batch_size=5", "critic.ppo_mini_batch_size=5 prompts must divide data.train_batch_size=32"),
        ("trainer.critic_warmup=-1", "trainer.critic_warmup=-1 must be >= 0"),
    ],
)
def test_critic_errors_name_the_key(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(load_config("ppo", overrides=[override, "data.train_batch_size=32",
                                                      "actor.ppo_mini_batch_size=32"]))
    assert expected in str(info.value)


def test_fixed_critic_micro_batches_must_divide_a_ranks_share() -> None:
    cfg = load_config("ppo", overrides=["critic.use_dynamic_bsz=false", "critic.ppo_micro_batch_size_per_gpu=48"])
    with pytest.raises(ConfigError, match="not a multiple of critic.ppo_micro_batch_size_per_gpu=48"):
        validate_config(cfg)


@pytest.mark.parametrize("path,expected", [("/no/such/model", "critic.model.path"), ("builtin:tiny", "leave it null")])
def test_a_critic_model_path_that_cannot_load_is_refused_at_start_up(path: str, expected: str) -> None:
    cfg = load_config("ppo", overrides=[f"critic.model.path={path}"])
    with pytest.raises(ConfigError, match=expected) as info:
        resolve_plugins(cfg)
    assert info.value.key == "critic.model.path"

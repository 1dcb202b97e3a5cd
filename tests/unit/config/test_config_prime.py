"""PRIME's config (``algorithm.adv_estimator=prime``, ``prime.*``): combinations that cannot work are refused
naming their key, ``prime.*`` without the estimator warns, and ``config explain`` describes the implicit PRM and
its reference."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError, load_config, validate_config
from hybridflow.config.errors import flatten
from hybridflow.config.explain import explain_config, prime_shares_reference


@pytest.mark.parametrize("overrides, key", [
    (["rollout.n=1"], "rollout.n"),
    (["prime.beta=0"], "prime.beta"),
    (["prime.optim.lr=0"], "prime.optim.lr"),
    (["prime.micro_batch_size_per_gpu=0"], "prime.micro_batch_size_per_gpu"),
    (["algorithm.reward_dpo_coef=0", "algorithm.reward_gt_coef=0"], "algorithm.reward_dpo_coef"),
    (["algorithm.reward_gt_coef=-1"], "algorithm.reward_gt_coef"),
    (["actor.loss=dpo"], "actor.loss=dpo"),
    (["algorithm.use_kl_in_reward=true"], "algorithm.use_kl_in_reward"),
])
def test_a_combination_prime_cannot_run_is_refused_naming_its_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        validate_config(load_config("prime", None, overrides))
    assert any(key in str(error) for error in flatten([info.value])), str(info.value)


def test_the_preset_validates_and_prime_keys_without_the_estimator_warn():
    assert validate_config(load_config("prime")) == []
    warnings = validate_config(load_config(None, None, ["prime.beta=0.1"]))
    assert any("prime.beta" in w and "adv_estimator=prime" in w for w in warnings), warnings


def test_explain_names_the_implicit_prm_and_which_reference_it_uses():
    own = explain_config(load_config("prime"))
    assert "implicit PRM: yes" in own and "a frozen copy of its starting weights" in own
    shared = load_config("prime", None, ["actor.use_kl_loss=true"])
    assert prime_shares_reference(shared)
    assert "the run's reference model" in explain_config(shared)
    # At another temperature the run's reference scores other probabilities: the PRM brings its own.
    assert not prime_shares_reference(load_config("prime", None, ["actor.use_kl_loss=true", "rollout.temperature=0.7"]))
    assert "implicit PRM" not in explain_config(load_config("grpo"))

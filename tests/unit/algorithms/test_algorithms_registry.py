"""Registries: names users type, the module:function escape hatch, and declared estimator inputs."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from hybridflow.algorithms import (
    OPTIONAL_ESTIMATOR_INPUTS,
    UnknownNameError,
    estimator_needs,
    get_adv_estimator,
    get_policy_loss,
    register_adv_estimator,
)

USER_MODULE = textwrap.dedent(
    """
    import torch

    def my_estimator(*, token_level_rewards, response_mask, group_ids, **unused):
        scores = token_level_rewards.sum(-1, keepdim=True)
        return scores * response_mask, scores * response_mask
    my_estimator.needs = ("reward_baselines",)

    def my_loss(*, old_logprobs, logprobs, advantages, response_mask, **unused):
        loss = -(advantages * logprobs * response_mask).sum() / response_mask.sum().clamp(min=1)
        return loss, {"actor/pg_clipfrac": 0.0}

    not_callable = 3
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_algos.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_algos"
    sys.modules.pop("my_algos", None)


def test_module_function_escape_hatch_for_estimators_and_losses(user_module) -> None:
    est = get_adv_estimator(f"{user_module}:my_estimator")
    rewards = torch.tensor([[0.0, 2.0], [1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv, _ = est(token_level_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0]))
    assert adv.tolist() == [[2.0, 2.0], [1.0, 0.0]]
    assert estimator_needs(est) == {"reward_baselines"}
    loss_fn = get_policy_loss(f"{user_module}:my_loss")
    loss, metrics = loss_fn(old_logprobs=torch.zeros(1, 2), logprobs=torch.full((1, 2), -1.0),
                            advantages=torch.ones(1, 2), response_mask=torch.ones(1, 2))
    assert float(loss) == pytest.approx(1.0) and metrics == {"actor/pg_clipfrac": 0.0}


def test_escape_hatch_errors_name_the_problem(user_module) -> None:
    with pytest.raises(UnknownNameError, match="cannot import module 'no_such_module'"):
        get_adv_estimator("no_such_module:fn")
    with pytest.raises(UnknownNameError, match="no callable 'not_callable'"):
        get_policy_loss(f"{user_module}:not_callable")
    with pytest.raises(UnknownNameError, match="must look like"):
        get_adv_estimator(":fn")
    with pytest.raises(UnknownNameError, match="Did you mean 'grpo'"):
        get_adv_estimator("gpro")


def test_builtin_needs_and_unknown_needs_are_refused() -> None:
    assert estimator_needs(get_adv_estimator("grpo")) == frozenset()
    assert estimator_needs(get_adv_estimator("remax")) == {"reward_baselines"}
    assert estimator_needs(get_adv_estimator("gae")) == {"values"}
    assert estimator_needs(get_adv_estimator("gdpo")) == {"reward_components"}
    assert estimator_needs(get_adv_estimator("optimal_token_baseline")) == {"old_logprobs", "sum_pi_squared"}
    assert set(OPTIONAL_ESTIMATOR_INPUTS) == {
        "values", "reward_baselines", "reward_components", "old_logprobs", "sum_pi_squared",
    }
    with pytest.raises(ValueError, match="unknown inputs \\['critic_logits'\\]"):
        register_adv_estimator("bogus_needs_test", needs=("critic_logits",))(lambda **kw: None)

"""Registries: names users type, the module:function escape hatch, and declared estimator inputs."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from hybridflow.algorithms import (
    OPTIONAL_ESTIMATOR_INPUTS,
    AdvantageInputs,
    LossInputs,
    UnknownNameError,
    build_estimator_params,
    build_policy_loss_params,
    estimator_needs,
    get_adv_estimator,
    get_policy_loss,
    register_adv_estimator,
)

USER_MODULE = textwrap.dedent(
    """
    import torch

    def my_estimator(inputs, params):
        scores = inputs.token_level_rewards.sum(-1, keepdim=True)
        return scores * inputs.response_mask, scores * inputs.response_mask
    my_estimator.needs = ("reward_baselines",)

    def my_loss(inputs, params):
        mask = inputs.response_mask
        loss = -(inputs.advantages * inputs.logprobs * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"actor/pg_clipfrac": 0.0, "agg": params.loss_agg_mode}

    def old_style_loss(*, old_logprobs, logprobs, advantages, response_mask, **unused):
        return None

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
    inputs = AdvantageInputs(token_level_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0]))
    adv, _ = est(inputs, build_estimator_params(est, {"gamma": 0.9}))
    assert adv.tolist() == [[2.0, 2.0], [1.0, 0.0]]
    assert estimator_needs(est) == {"reward_baselines"}
    loss_fn = get_policy_loss(f"{user_module}:my_loss")
    # A loss without a declared params type gets the aggregation mode (AggParams) and nothing else.
    params = build_policy_loss_params(loss_fn, shared={"loss_agg_mode": "seq-mean-token-mean", "clip_ratio_low": 0.2},
                                      specific={})
    loss, metrics = loss_fn(LossInputs(old_logprobs=torch.zeros(1, 2), logprobs=torch.full((1, 2), -1.0),
                                       advantages=torch.ones(1, 2), response_mask=torch.ones(1, 2)), params)
    assert float(loss) == pytest.approx(1.0) and metrics == {"actor/pg_clipfrac": 0.0, "agg": "seq-mean-token-mean"}


def test_a_keyword_only_function_is_refused_at_start_up(user_module) -> None:
    with pytest.raises(UnknownNameError, match=r"cannot be called as fn\(inputs: LossInputs, params\)"):
        get_policy_loss(f"{user_module}:old_style_loss")


def test_a_setting_for_another_loss_is_refused() -> None:
    with pytest.raises(ValueError, match="tau_pos does not apply to policy loss 'vanilla'"):
        build_policy_loss_params(get_policy_loss("vanilla"), shared={"clip_ratio_low": 0.2, "clip_ratio_high": 0.2},
                                 specific={"tau_pos": 1.2}, name="vanilla")


def test_a_missing_needed_input_names_the_estimator_and_the_field() -> None:
    mask = torch.ones(2, 3)
    inputs = AdvantageInputs(token_level_rewards=mask, response_mask=mask, group_ids=torch.tensor([0, 0]))
    gae = get_adv_estimator("gae")
    with pytest.raises(ValueError, match=r"advantage estimator 'gae' needs AdvantageInputs.values"):
        gae(inputs, build_estimator_params(gae, {}))


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
    assert estimator_needs(get_adv_estimator("optimal_token_baseline")) == {
        "old_logprobs", "sum_pi_squared", "rollout_is_weights",
    }
    assert estimator_needs(get_adv_estimator("prime")) == {"implicit_rewards"}
    assert set(OPTIONAL_ESTIMATOR_INPUTS) == {
        "values", "reward_baselines", "reward_components", "old_logprobs", "sum_pi_squared", "rollout_is_weights",
        "implicit_rewards",
    }
    with pytest.raises(ValueError, match="unknown inputs \\['critic_logits'\\]"):
        register_adv_estimator("bogus_needs_test", needs=("critic_logits",))(lambda **kw: None)

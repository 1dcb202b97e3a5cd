"""Inputs the controller builds for estimators that declare them (gdpo's reward components, Σπ²
for the token baselines from the actor's old-logprob forward)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow.algorithms import OPTIONAL_ESTIMATOR_INPUTS, AdvantageInputs
from hybridflow.config import load_config
from hybridflow.controller.phases import INPUT_PROVIDERS, reward_components
from hybridflow.controller.preflight import needs_critic, needs_old_logprobs_for, needs_sum_pi_squared_for, resolve_plugins
from hybridflow.controller.preflight import ESTIMATOR_INPUT_SOURCES
from hybridflow.types import Trajectory


def sample(**extra: float) -> Trajectory:
    t = Trajectory(prompt_ids=[1], response_ids=[2], loss_mask=[1], rollout_logprobs=[-0.1], finish_reason="stop")
    t.reward_extra = dict(extra)
    return t


def test_reward_components_are_the_named_extras_with_0_for_a_failed_sample():
    got = reward_components([sample(acc=1.0, fmt=0.5), sample(), sample(acc=0.0, fmt=1.0)], ["fmt", "acc"])
    assert torch.equal(got, torch.tensor([[0.5, 1.0], [0.0, 0.0], [1.0, 0.0]]))


def test_a_component_no_reward_returned_is_named():
    with pytest.raises(ValueError, match=r"\['fmt'\] are in no sample's reward"):
        reward_components([sample(acc=1.0)], ["acc", "fmt"])


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_token_baseline_estimators_get_sum_pi_squared_from_the_old_logprob_forward(estimator):
    needs = resolve_plugins(load_config(overrides=[f"algorithm.adv_estimator={estimator}"])).estimator_needs
    assert needs == {"old_logprobs", "sum_pi_squared", "rollout_is_weights"}
    assert needs_old_logprobs_for(needs) and needs_sum_pi_squared_for(needs)
    assert not needs_sum_pi_squared_for(frozenset({"old_logprobs"}))


def test_every_optional_input_has_a_source_and_a_provider():
    """Set-up reads ESTIMATOR_INPUT_SOURCES and the loops' providers (phases.INPUT_PROVIDERS) by the names an
    estimator declares; a name missing from either would fail mid-run instead of at start-up."""
    assert set(ESTIMATOR_INPUT_SOURCES) == set(OPTIONAL_ESTIMATOR_INPUTS)
    assert set(INPUT_PROVIDERS) == set(OPTIONAL_ESTIMATOR_INPUTS)
    assert set(OPTIONAL_ESTIMATOR_INPUTS) <= {f.name for f in dataclasses.fields(AdvantageInputs)}
    assert needs_critic(frozenset({"values"})) and not needs_critic(frozenset({"reward_baselines"}))

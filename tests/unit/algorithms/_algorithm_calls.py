"""Call estimators and policy losses from plain keywords, the way the tests state their cases.

Tests give a case as keywords (``token_level_rewards=..., gamma=0.9``); these helpers sort them
into the typed record (``AdvantageInputs``, ``LossInputs``) and the function's own params, which
take the keywords they have fields for. That keeps each test's numbers as they were written
before the typed boundary; the library itself has no keyword entry point.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from hybridflow.algorithms import (
    AdvantageInputs,
    AdvantageOutputs,
    LossInputs,
    build_estimator_params,
    build_policy_loss_params,
    get_adv_estimator,
    get_policy_loss,
)

_ADV_FIELDS = {f.name for f in dataclasses.fields(AdvantageInputs)}
_LOSS_FIELDS = {f.name for f in dataclasses.fields(LossInputs)}


def estimate(estimator: str | Callable[..., Any], **keywords: Any) -> AdvantageOutputs:
    """``estimator`` (a registry name or the function) on the inputs and params in ``keywords``."""
    fn = get_adv_estimator(estimator) if isinstance(estimator, str) else estimator
    inputs = AdvantageInputs(**{k: v for k, v in keywords.items() if k in _ADV_FIELDS})
    settings = {k: v for k, v in keywords.items() if k not in _ADV_FIELDS}
    if isinstance(settings.get("reward_component_weights"), torch.Tensor):  # gdpo's weights, as the config gives them
        settings["gdpo_reward_weights"] = settings.pop("reward_component_weights").tolist()
    return fn(inputs, build_estimator_params(fn, settings))


def policy_loss(loss: str | Callable[..., Any], **keywords: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """``loss`` (a registry name or the function) on the inputs and params in ``keywords``."""
    fn = get_policy_loss(loss) if isinstance(loss, str) else loss
    inputs = LossInputs(**{k: v for k, v in keywords.items() if k in _LOSS_FIELDS})
    settings = {k: v for k, v in keywords.items() if k not in _LOSS_FIELDS}
    return fn(inputs, build_policy_loss_params(fn, shared=settings, specific={}))

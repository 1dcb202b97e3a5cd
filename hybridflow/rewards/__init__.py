"""Rewards: rule scorers, custom reward functions, and the supervised scoring manager.

- ``arithmetic``, ``gsm8k``, ``math``: rule scorers ``compute_score(solution_str, ground_truth)``.
- ``registry``: ``DEFAULT_SCORERS`` (data_source -> scorer) and ``default_compute_score``.
- ``custom``: ``load_reward_function(path, name)`` for a user's file (verl's signature).
- ``sandbox_fusion``: verl's code-contest sources scored by a SandboxFusion service
  (``reward.sandbox_fusion.url``); ``code``/``sandbox`` stay the local code reward.
- ``manager``: ``RewardManager``, which scores ``ScoreRequest`` batches in worker processes
  (``worker.py``) so that failing, hanging or crashing reward code costs a sample, not the run.

Only the standard library and ``math-verify`` are used here; no torch.

The names below are imported on first use (PEP 562). Every scoring worker imports this package,
and importing ``registry`` eagerly would load sympy and math-verify (about a second) into each
worker, including workers that only run a custom reward and a worker restarted after a timeout.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.rewards.custom import load_reward_function
    from hybridflow.rewards.manager import RewardManager, RewardOutput, ScoreRequest
    from hybridflow.rewards.registry import DEFAULT_SCORERS, UnknownDataSourceError, default_compute_score

_EXPORTS = {
    "load_reward_function": "hybridflow.rewards.custom",
    "RewardManager": "hybridflow.rewards.manager",
    "RewardOutput": "hybridflow.rewards.manager",
    "ScoreRequest": "hybridflow.rewards.manager",
    "DEFAULT_SCORERS": "hybridflow.rewards.registry",
    "UnknownDataSourceError": "hybridflow.rewards.registry",
    "default_compute_score": "hybridflow.rewards.registry",
}

__all__ = [
    "DEFAULT_SCORERS",
    "RewardManager",
    "RewardOutput",
    "ScoreRequest",
    "UnknownDataSourceError",
    "default_compute_score",
    "load_reward_function",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridflow.rewards' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

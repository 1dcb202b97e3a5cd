"""Rollout engines: request-level generation behind one protocol (see ``base``).

Only the protocol and the factory are re-exported here; engines import their backends (and
transformers) when built, so importing this package stays cheap.
"""

from hybridflow.rollout.base import RolloutEngine

from hybridflow.rollout.factory import ROLLOUT_ENGINES, EngineArgs, build_rollout_engine

__all__ = ["ROLLOUT_ENGINES", "EngineArgs", "RolloutEngine", "build_rollout_engine"]

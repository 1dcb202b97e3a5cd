"""The rollout role: turns generation requests into trajectories with a rollout engine."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hybridflow.models.loading import eos_token_ids, load_causal_lm, load_tokenizer
from hybridflow.rollout import build_rollout_engine
from hybridflow.types import GenerationRequest, Trajectory


@dataclass
class RolloutSetup:
    model_path: str
    engine: str
    dtype: str
    device: torch.device
    max_batch_size: int
    seed: int
    trust_remote_code: bool = False


class RolloutWorker:
    def __init__(self, rank: int, world_size: int, setup: RolloutSetup) -> None:
        self.rank = rank
        tokenizer = load_tokenizer(setup.model_path, setup.trust_remote_code)
        # The engine owns its own copy of the weights (possibly in another dtype); the trainer
        # pushes updates with update_weights after each step.
        model = load_causal_lm(setup.model_path, device=setup.device, trust_remote_code=setup.trust_remote_code)
        self.engine = build_rollout_engine(
            setup.engine,
            model=model,
            eos_token_ids=eos_token_ids(setup.model_path, tokenizer),
            pad_token_id=int(tokenizer.pad_token_id),
            max_batch_size=setup.max_batch_size,
            device=setup.device,
            dtype=setup.dtype,
            seed=setup.seed + rank,
            tokenizer=tokenizer,
        )

    def generate(self, requests: list[GenerationRequest]) -> list[list[Trajectory]]:
        return self.engine.generate_batch(requests)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(weights)

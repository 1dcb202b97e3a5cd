"""The reference role: a frozen copy of the initial policy, for KL terms."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.models.loading import load_causal_lm
from hybridflow.training.engine import TrainEngine
from hybridflow.types import TrainBatch
from hybridflow.utils.device import parse_dtype


@dataclass
class ReferenceSetup:
    model_path: str
    dtype: str
    device: torch.device
    temperature: float
    micro_batch_size: int
    trust_remote_code: bool = False
    use_remove_padding: bool = False
    max_token_len: int | None = None  # token-budget micro-batches (actor.use_dynamic_bsz)


class ReferenceWorker:
    def __init__(self, rank: int, world_size: int, setup: ReferenceSetup) -> None:
        self.setup = setup
        model = load_causal_lm(
            setup.model_path,
            dtype=parse_dtype(setup.dtype),
            device=setup.device,
            trust_remote_code=setup.trust_remote_code,
        )
        self.engine = TrainEngine(model, optim=None, device=setup.device)

    def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:  # (B, R)
        s = self.setup
        logprobs, _ = self.engine.compute_logprobs(
            batch, temperature=s.temperature, micro_batch_size=s.micro_batch_size,
            use_remove_padding=s.use_remove_padding, max_token_len=s.max_token_len,
        )
        return logprobs

"""The reward role: decodes responses and scores them with rule or custom reward functions.

Scoring runs in supervised worker processes (``RewardManager``): a reward function that
raises, hangs or returns garbage costs that sample a score of 0 and a counter, never the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.models.loading import load_tokenizer
from hybridflow.rewards import RewardManager, ScoreRequest
from hybridflow.types import Trajectory


@dataclass
class RewardSetup:
    tokenizer_path: str
    custom_path: str | None
    custom_name: str
    timeout_s: float
    num_workers: int
    trust_remote_code: bool = False


class RewardWorker:
    def __init__(self, rank: int, world_size: int, setup: RewardSetup) -> None:
        self.tokenizer = load_tokenizer(setup.tokenizer_path, setup.trust_remote_code)
        self.manager = RewardManager(
            setup.custom_path, setup.custom_name, timeout_s=setup.timeout_s, num_workers=setup.num_workers
        )

    def score(self, trajectories: list[Trajectory]) -> tuple[list[float], dict[str, float]]:
        """Score each trajectory in place (``.reward``); returns the scores and reward metrics."""
        # Decode only the policy's own tokens' span; special tokens (EOS) are not part of the answer.
        texts = self.tokenizer.batch_decode([t.response_ids for t in trajectories], skip_special_tokens=True)
        requests = [
            ScoreRequest(
                data_source=t.metadata["data_source"],
                solution_str=text,
                ground_truth=t.metadata["ground_truth"],
                extra_info=t.metadata.get("extra_info") or {},
            )
            for t, text in zip(trajectories, texts, strict=True)
        ]
        output = self.manager.score(requests)
        for t, s in zip(trajectories, output.scores, strict=True):
            t.reward = s
        return output.scores, output.metrics

    def close(self) -> None:
        self.manager.close()

"""Online DPO's batch (``phases.prepare_pair_batch``): the step's samples paired by reward, laid out as whole
pairs per actor rank, its metrics; and a step whose groups give no pair trains nothing."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hybridflow.controller import phases
from hybridflow.controller.step_plan import PairSelection
from hybridflow.types import Trajectory
from hybridflow.utils.timer import PhaseTimer


class FailingActor:
    """An actor group that must not be called (no pair: no update)."""

    world_size = 2

    def split_gather(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the actor was asked to train on no pair")


def groups_of(rewards: list[list[float]]) -> list[list[Trajectory]]:
    return [[Trajectory(prompt_ids=[1, 2], response_ids=[3 + g, 4 + i], loss_mask=[1, 1], rollout_logprobs=[0.0, 0.0],
                        finish_reason="stop", reward=r, group_id=g) for i, r in enumerate(group)]
            for g, group in enumerate(rewards)]


def prepare(rewards: list[list[float]]):
    roles = SimpleNamespace(actor=FailingActor(), reference=None)
    plan = SimpleNamespace(pairs=PairSelection("best_worst", 0.0), pad_token_id=0)
    return phases.prepare_pair_batch(roles, plan, groups_of(rewards), 1, PhaseTimer(),  # type: ignore[arg-type]
                                     SimpleNamespace(rollout_dir=None))  # type: ignore[arg-type]


def test_pairs_are_laid_out_whole_per_rank_and_counted():
    # Group 1 has no spread; three pairs over two ranks: two each, the second rank's last a padding copy.
    samples, metrics = prepare([[0.0, 1.0], [1.0, 1.0], [1.0, 0.0], [0.0, 0.5]])
    assert metrics == {"pairs/count": 3.0, "pairs/groups_without_pair": 1.0,
                       "pairs/groups_without_pair_fraction": 0.25}
    batch = samples.batch
    # Rank 0: group 0's pair (chosen: its sample 1, rejected: its sample 0) and group 2's (samples 0, 1);
    # rank 1: group 3's (samples 1, 0) and its copy. A response's first token is 3 + its group, its second
    # 4 + its place in the group.
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]
    assert batch.responses.tolist() == [[3, 5], [5, 4], [3, 4], [5, 5], [6, 5], [6, 5], [6, 4], [6, 4]]
    assert batch.group_ids.tolist() == [0, 1, 2, 3, 0, -1, 2, -1]  # the copy's rows at PADDING_POSITION
    # The step's metrics describe every sample, not only the paired ones.
    assert samples.all_samples.batch_size == 8 and len(samples.trajectories) == 8


def test_a_step_without_a_pair_trains_nothing():
    samples, metrics = prepare([[1.0, 1.0], [0.0, 0.0]])
    assert samples.batch.batch_size == 0 and metrics["pairs/count"] == 0.0
    roles = SimpleNamespace(actor=FailingActor(), critic=None)
    assert phases.update_actor(roles, SimpleNamespace(), samples.batch, 1, PhaseTimer()) == {}  # type: ignore[arg-type]
    assert torch.equal(samples.all_samples.rewards, torch.tensor([1.0, 1.0, 0.0, 0.0]))

"""The by-reference data plane: what a rank collates from records and fetched payload is the
batch the controller would have collated and sent it."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from hybridflow.data.plane import (
    PayloadHandle,
    fetch_groups,
    fetch_trajectories,
    put_group,
    records_of,
    resolve_batch,
)
from hybridflow.types import (
    UNVERSIONED_TOKEN,
    AgentEpisode,
    RefBatch,
    RowFields,
    TrainBatch,
    Trajectory,
    collate_records,
    collate_trajectories,
    loss_mask_runs,
    row_constant,
)

PAD = 0


def _trajectory(prompt: int, response: int, *, tool_at: tuple[int, int] | None = None, seed: int = 0,
                versions: list[int] | None = None) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    mask = [1] * response
    if tool_at is not None:  # an agent episode: tool output the policy did not write
        mask[tool_at[0]:tool_at[1]] = [0] * (tool_at[1] - tool_at[0])
    return Trajectory(
        prompt_ids=torch.randint(1, 50, (prompt,), generator=g).tolist(),
        response_ids=torch.randint(1, 50, (response,), generator=g).tolist(),
        loss_mask=mask, rollout_logprobs=(-torch.rand(response, generator=g)).tolist(), finish_reason="stop",
        token_versions=versions,
    )


def _groups() -> list[list[Trajectory]]:
    """Two prompt groups of three samples, with ragged lengths, an agent episode and versions."""
    return [
        [_trajectory(3, 5, seed=1, versions=[2] * 5), _trajectory(3, 1, seed=2),
         _trajectory(3, 7, tool_at=(2, 4), seed=3, versions=[1, 1, UNVERSIONED_TOKEN, UNVERSIONED_TOKEN, 2, 2, 2])],
        [_trajectory(6, 2, seed=4), _trajectory(6, 0, seed=5), _trajectory(6, 4, tool_at=(0, 1), seed=6)],
    ]


def _scored(groups: list[list[Trajectory]]) -> None:
    for g, group in enumerate(groups):
        for i, t in enumerate(group):
            t.group_id, t.reward = g, float(i) - 0.5


def _records(groups: list[list[Trajectory]]) -> list:
    return [r for group in groups for r in records_of(group, put_group(group, "rollout replica 0"))]


def _assert_batches_equal(got: TrainBatch, want: TrainBatch) -> None:
    assert got.prompt_length == want.prompt_length
    for f in dataclasses.fields(TrainBatch):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a is not None and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


def test_loss_mask_runs():
    assert loss_mask_runs([]) == ()
    assert loss_mask_runs([1, 1, 1]) == ((0, 3),)
    assert loss_mask_runs([1, 0, 0, 1, 1, 0, 1]) == ((0, 1), (3, 5), (6, 7))
    assert loss_mask_runs([0, 0]) == ()


def test_records_carry_the_numbers_the_controller_decides_with_and_no_tokens():
    groups = _groups()
    _scored(groups)
    records = _records(groups)
    t, r = groups[0][2], records[2]
    assert (r.prompt_length, r.response_length, r.policy_tokens) == (3, 7, 5)
    assert r.loss_mask_runs == ((0, 2), (4, 7)) and r.versions == (1, 2) == t.versions
    assert r.reward == t.reward and r.index == 2 and r.payload.owner == "rollout replica 0"
    assert not {"prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"} & {f.name for f in dataclasses.fields(r)}


def test_a_rank_collates_from_references_the_shard_the_controller_would_have_sent():
    groups = _groups()
    _scored(groups)
    trajectories = [t for g in groups for t in g]
    records = _records(groups)
    whole, light = collate_trajectories(trajectories, PAD), collate_records(records, PAD)
    # The controller's columns are the collated batch's.
    assert torch.equal(light.response_mask, whole.response_mask)
    assert torch.equal(light.response_attention_mask, whole.response_attention_mask)
    assert torch.equal(light.rewards, whole.rewards) and torch.equal(light.group_ids, whole.group_ids)
    assert light.num_tokens == whole.num_tokens and light.prompt_length == whole.prompt_length
    # A reordering (balancing) and the columns the step adds travel with the rows.
    order = [4, 0, 5, 2, 1, 3]
    whole, light = whole.select(order), light.select(order)
    advantages = torch.randn(6, whole.response_length) * whole.response_mask
    whole.advantages, light.advantages = advantages, advantages.clone()
    for want, shard in zip(whole.chunk(2), light.chunk(2), strict=True):
        assert shard.response_mask is None  # rebuilt on the rank, not sent
        _assert_batches_equal(resolve_batch(shard), want)


def test_outcome_advantages_travel_as_one_number_per_row_and_token_rewards_not_at_all():
    groups = _groups()
    _scored(groups)
    whole, light = collate_trajectories([t for g in groups for t in g], PAD), collate_records(_records(groups), PAD)
    scores = torch.tensor([0.5, -1.0, 2.0, -0.25, 3.0, 1.5])  # GRPO's: one advantage per sample
    for batch in (whole, light):
        batch.advantages = batch.returns = scores[:, None] * batch.response_mask
        batch.token_level_rewards = torch.ones_like(batch.response_mask)
    light.old_logprobs = whole.old_logprobs = -torch.rand(whole.response_mask.shape)  # per token: sent whole
    whole.token_level_rewards = None  # what a rank gets: no rank reads them
    for want, shard in zip(whole.chunk(3), light.chunk(3), strict=True):
        assert shard.advantages is None and shard.returns is None and shard.token_level_rewards is None
        assert set(shard.row_values) == {"advantages", "returns"} and shard.row_values["advantages"].shape == (2,)
        assert shard.old_logprobs is not None
        _assert_batches_equal(resolve_batch(shard), want)


def test_row_constant():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    assert torch.equal(row_constant(torch.tensor([[2.0, 2.0, 0.0], [0.0] * 3, [0.0, -1.0, -1.0]]), mask),
                       torch.tensor([2.0, 0.0, -1.0]))
    assert row_constant(torch.tensor([[2.0, 3.0, 0.0], [0.0] * 3, [0.0, 1.0, 1.0]]), mask) is None  # per token
    assert row_constant(torch.tensor([[2.0, 2.0, 1.0], [0.0] * 3, [0.0, 1.0, 1.0]]), mask) is None  # off the mask
    assert row_constant(torch.full((3, 3), float("nan")), mask) is None


def test_a_shard_sent_to_another_process_pickles_without_tokens():
    """In one process a handle holds its group itself; what crosses a process boundary on Ray is an
    object reference (tested on Ray in tests/e2e/test_e2e_ray.py). Here: the shard's own columns
    are all that is left once the handles are references."""
    groups = _groups()
    _scored(groups)
    light = collate_records(_records(groups), PAD)
    remote = dataclasses.replace(light, refs=tuple((PayloadHandle("ref", h.owner, True, h.key), i) for h, i in light.refs))
    shard = remote.chunk(1)[0]
    sent = pickle.loads(pickle.dumps(shard))
    assert isinstance(sent, RefBatch) and sent.response_mask is None
    assert all(h.ref == "ref" for h, _ in sent.refs)


def test_a_lost_group_is_an_error_naming_its_replica(monkeypatch):
    class FakeRay:
        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def get(refs, timeout=None):
            raise RuntimeError("owner died")

    monkeypatch.setitem(__import__("sys").modules, "ray", FakeRay)
    handle = PayloadHandle("ref", "rollout replica 1", True, "k")
    with pytest.raises(RuntimeError, match="rollout replica 1 generated could not be fetched"):
        fetch_groups([handle])


def test_fetched_trajectories_are_the_generated_ones_with_the_controllers_fields():
    groups = _groups()
    records = _records(groups)
    for r in records:
        r.group_id, r.reward, r.row, r.agent = 7, 0.25, RowFields(data_source="x"), AgentEpisode(name="single_turn")
    fetched = fetch_trajectories([records[4], groups[0][0]])
    assert fetched[1] is groups[0][0]  # a trajectory stays as it is
    t, source = fetched[0], groups[1][1]
    assert (t.prompt_ids, t.response_ids, t.rollout_logprobs) == (source.prompt_ids, source.response_ids,
                                                                  source.rollout_logprobs)
    assert (t.group_id, t.reward) == (7, 0.25)
    assert (t.row, t.agent) == (RowFields(data_source="x"), AgentEpisode(name="single_turn"))
    assert source.group_id == 0 and source.reward is None  # the replica's copy is left alone


def test_resolving_a_train_batch_is_the_batch_itself():
    batch = collate_trajectories([_trajectory(2, 3)], PAD)
    assert resolve_batch(batch) is batch

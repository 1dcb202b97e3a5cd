import pytest
import torch

from hybridflow.types import SamplingParams, TrainBatch, Trajectory, collate_trajectories


def traj(prompt, response, mask=None, group=0, reward=1.0):
    n = len(response)
    return Trajectory(prompt, response, mask or [1] * n, [-0.5] * n, "stop", group_id=group, reward=reward)


def test_collate_left_pads_prompts_and_right_pads_responses():
    batch = collate_trajectories([traj([1, 2, 3], [7]), traj([4], [8, 9], mask=[1, 0], group=1, reward=0.0)], pad_token_id=0)
    assert batch.prompt_length == 3
    assert batch.input_ids.tolist() == [[1, 2, 3, 7, 0], [0, 0, 4, 8, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    # Positions count real tokens only: the padded prompt starts at position 0.
    assert batch.position_ids[1].tolist() == [0, 0, 0, 1, 2]
    assert batch.response_mask.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert batch.responses.tolist() == [[7, 0], [8, 9]]
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.group_ids.tolist() == [0, 1]


def test_trajectory_fields_must_align():
    with pytest.raises(ValueError, match="align"):
        Trajectory([1], [2, 3], [1], [0.0, 0.0], "stop")


def test_select_split_concat_round_trip():
    batch = collate_trajectories([traj([1, 2], [i, i + 1], group=i) for i in range(5)], pad_token_id=0)
    batch.advantages = torch.arange(10, dtype=torch.float32).view(5, 2)
    parts = batch.split(2)
    assert [p.batch_size for p in parts] == [2, 2, 1]
    back = TrainBatch.concat(parts)
    assert torch.equal(back.input_ids, batch.input_ids) and torch.equal(back.advantages, batch.advantages)
    assert back.old_logprobs is None
    with pytest.raises(ValueError, match="evenly"):
        batch.chunk(2)


def test_sampling_params_checks_and_greedy_at_zero_temperature():
    assert SamplingParams(temperature=0.0).greedy
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)

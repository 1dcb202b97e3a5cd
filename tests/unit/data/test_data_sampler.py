"""ResumableSampler: determinism, epoch rollover, resume equals the uninterrupted sequence."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.data.sampler import ResumableSampler, epoch_seed


def take(sampler: ResumableSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_same_seed_same_batches_other_seed_other_batches():
    a = take(ResumableSampler(50, 8, seed=3), 12)
    b = take(ResumableSampler(50, 8, seed=3), 12)
    c = take(ResumableSampler(50, 8, seed=4), 12)
    assert a == b
    assert a != c


def test_global_rng_is_neither_used_nor_consulted():
    torch.manual_seed(123)
    expected = take(ResumableSampler(30, 4, seed=1), 10)
    torch.manual_seed(999)  # a different global state must not change the batches
    state = torch.get_rng_state()
    assert take(ResumableSampler(30, 4, seed=1), 10) == expected
    assert torch.equal(torch.get_rng_state(), state)  # and drawing them must not advance it


def test_drop_last_epoch_visits_distinct_items_and_rolls_over():
    sampler = ResumableSampler(10, 3, seed=0)  # 3 full batches, 1 item dropped per epoch
    assert sampler.steps_per_epoch == 3
    epoch0 = take(sampler, 2)
    assert (sampler.epoch, sampler.position) == (0, 2)
    epoch0 += take(sampler, 1)
    assert (sampler.epoch, sampler.position) == (1, 0)  # rolled over right after the last batch
    flat = [i for batch in epoch0 for i in batch]
    assert all(len(b) == 3 for b in epoch0)
    assert len(set(flat)) == 9 and set(flat) <= set(range(10))
    epoch1 = take(sampler, 3)
    assert sampler.epoch == 2
    assert epoch1 != epoch0  # reshuffled
    assert epoch0 == [sampler.epoch_order(0)[i : i + 3] for i in (0, 3, 6)]
    assert epoch1 == [sampler.epoch_order(1)[i : i + 3] for i in (0, 3, 6)]


def test_keep_last_covers_every_item_once():
    sampler = ResumableSampler(10, 4, seed=5, drop_last=False)
    assert sampler.steps_per_epoch == 3
    batches = take(sampler, 3)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert sampler.epoch == 1


def test_no_shuffle_is_sequential_every_epoch():
    sampler = ResumableSampler(6, 2, shuffle=False)
    assert take(sampler, 6) == [[0, 1], [2, 3], [4, 5]] * 2


@pytest.mark.parametrize("interrupt_after", [0, 1, 4, 5, 6, 7, 11, 12])  # 6 steps per epoch
def test_resume_equals_uninterrupted(interrupt_after):
    reference = take(ResumableSampler(26, 4, seed=7), 20)

    first = ResumableSampler(26, 4, seed=7)
    before = take(first, interrupt_after)
    saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = ResumableSampler(26, 4, seed=7)
    resumed.load_state_dict(saved)
    after = take(resumed, 20 - interrupt_after)

    assert before + after == reference


def test_state_at_epoch_boundary_is_the_next_epoch_start():
    sampler = ResumableSampler(12, 4, seed=2)
    take(sampler, 3)
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["position"] == 0


def test_state_dict_is_plain_json():
    state = ResumableSampler(12, 4, seed=2).state_dict()
    assert json.loads(json.dumps(state)) == state
    assert all(type(v) in (int, bool) for v in state.values())


def test_batch_larger_than_dataset():
    with pytest.raises(ValueError, match="batch_size 8 is larger than the dataset \\(5 items\\)"):
        ResumableSampler(5, 8)
    sampler = ResumableSampler(5, 8, drop_last=False)
    assert sampler.steps_per_epoch == 1 and sorted(sampler.next_batch()) == list(range(5))


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"epoch": 0, "position": 0, "num_items": 13}, "saved with num_items=13 but this sampler has num_items=12"),
        ({"epoch": 0, "position": 0, "batch_size": 3}, "batch_size=3"),
        ({"epoch": 0, "position": 3}, "position 3 is out of range for 3 batches per epoch"),
        ({"epoch": -1, "position": 0}, "epoch must be an int >= 0"),
        ({"position": 0}, "state has no 'epoch'"),
    ],
)
def test_load_state_dict_refuses_mismatched_or_broken_state(state, message):
    with pytest.raises(ValueError, match=message):
        ResumableSampler(12, 4).load_state_dict(state)


@pytest.mark.parametrize(
    ("args", "message"), [((0, 1), "num_items"), ((4, 0), "batch_size"), ((4, True), "batch_size")]
)
def test_invalid_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        ResumableSampler(*args)


def test_epoch_seeds_do_not_alias_across_seed_and_epoch():
    assert epoch_seed(0, 1) != epoch_seed(1, 0)
    assert epoch_seed(0, 0) == epoch_seed(0, 0)
    assert 0 <= epoch_seed(2**40, 10**6) < 2**63

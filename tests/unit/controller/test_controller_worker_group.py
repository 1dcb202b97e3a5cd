import pytest

from hybridflow.cluster.backends import build_worker_group
from hybridflow.cluster.worker_group import LocalWorkerGroup, WorkerError
from hybridflow.types import Trajectory, collate_trajectories


class Echo:
    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def whoami(self, suffix=""):
        return f"{self.rank}/{self.world_size}{suffix}"

    def rows(self, batch):
        return (self.rank, batch.group_ids.tolist())

    def fail(self):
        raise ValueError("bad input")


def test_fan_out_is_explicit_and_in_rank_order():
    group = LocalWorkerGroup("echo", Echo, world_size=3)
    assert group.call_all(Echo.whoami, suffix="!") == ["0/3!", "1/3!", "2/3!"]
    assert group.call_one(2, Echo.whoami) == "2/3"
    assert group.call_each(Echo.whoami, [("a",), ("b",), ("c",)]) == ["0/3a", "1/3b", "2/3c"]
    batch = collate_trajectories([Trajectory([1], [2], [1], [0.0], "stop", group_id=i) for i in range(6)], 0)
    assert group.split_gather(Echo.rows, batch) == [(0, [0, 1]), (1, [2, 3]), (2, [4, 5])]


def test_worker_errors_name_role_rank_and_method():
    group = LocalWorkerGroup("actor", Echo, world_size=2)
    with pytest.raises(WorkerError, match=r"actor rank 0 failed in Echo.fail: ValueError\('bad input'\)"):
        group.call_all(Echo.fail)
    with pytest.raises(IndexError, match="ranks 0..1"):
        group.call_one(5, Echo.whoami)


def test_unknown_backend_lists_choices():
    with pytest.raises(ValueError, match=r"trainer.backend='slurm'.*\['local', 'ray'\]"):
        build_worker_group("slurm", "actor", Echo, 1)

"""Worker-group rules shared by every backend: a @collective method runs only through call_all, the
backend factory names its choices, and multi-rank workers refuse to start without their
process group."""

from __future__ import annotations

import pytest
import torch

from hybridflow.cluster.backends import build_worker_group, reserve_placements
from hybridflow.cluster.worker_group import LocalWorkerGroup
from hybridflow.training.distributed import collective, is_collective
from hybridflow.workers.engine_setup import check_rank_group, model_precision


class Counter:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.calls = rank, 0

    def plain(self) -> int:
        self.calls += 1
        return self.rank

    @collective
    def gathered(self) -> int:
        self.calls += 1
        return self.rank * 10

    def calls_made(self) -> int:
        return self.calls


def test_call_one_refuses_a_collective_method_which_call_all_runs_on_every_rank() -> None:
    group = LocalWorkerGroup("counter", Counter, world_size=3)
    assert is_collective(Counter.gathered) and not is_collective(Counter.plain)
    with pytest.raises(TypeError, match=r"counter: Counter.gathered is @collective .* call_all"):
        group.call_one(2, Counter.gathered)
    assert group.call_all(Counter.calls_made) == [0, 0, 0]  # refused before any rank ran it
    assert group.call_all(Counter.gathered) == [0, 10, 20]
    assert group.call_one(1, Counter.plain) == 1
    assert group.call_all(Counter.calls_made) == [1, 2, 1]
    group.close()  # in-process: nothing to release, and safe


def test_backend_factory_names_every_backend_and_ray_needs_a_placement() -> None:
    with pytest.raises(ValueError, match=r"trainer.backend='slurm'.*\['local', 'ray'\]"):
        build_worker_group("slurm", "actor", Counter, 1)
    with pytest.raises(ValueError, match="trainer.backend=ray needs a placement"):
        build_worker_group("ray", "actor", Counter, 1)
    assert isinstance(build_worker_group("local", "actor", Counter, 1), LocalWorkerGroup)
    cpu = torch.device("cpu")
    assert reserve_placements("local", data_parallel_size=1, device=cpu, colocated_roles=["actor"]) == ([], {})
    with pytest.raises(ValueError, match=r"trainer.backend='slurm'"):
        reserve_placements("slurm", data_parallel_size=1, device=cpu, colocated_roles=["actor"])


def test_a_multi_rank_worker_without_its_process_group_says_to_use_ray() -> None:
    check_rank_group("actor", 0, 1)  # one rank needs no group
    with pytest.raises(RuntimeError, match=r"actor rank 1 of 2: no torch.distributed process group of 2 ranks.*"
                                           r"trainer.backend=ray"):
        check_rank_group("actor", 1, 2)


def test_bf16_training_is_mixed_precision_over_fp32_master_weights() -> None:
    for data_parallel in (False, True):
        assert model_precision("float32", trainable=True, data_parallel=data_parallel) == (torch.float32, None)
        assert model_precision("bfloat16", trainable=True, data_parallel=data_parallel) == (torch.float32, torch.bfloat16)
    # A frozen model on one rank just loads in bf16; sharded it follows FSDP2's policy.
    assert model_precision("bfloat16", trainable=False, data_parallel=False) == (torch.bfloat16, None)
    assert model_precision("bfloat16", trainable=False, data_parallel=True) == (torch.float32, torch.bfloat16)

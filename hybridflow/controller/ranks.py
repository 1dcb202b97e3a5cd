"""The data-parallel ranks of an offline trainer (``hybridflow sft``, ``dpo``, ``rm``). Each rank runs the
trainer's ``train(rank, world, job, device)`` (the same per-rank loop on every backend); what rank 0
returns comes back.

``trainer.backend=local``: one rank in this process, or ``world`` processes started by forkserver that
meet in a torch.distributed group. ``trainer.backend=ray``: ``world`` Ray actors, placed, threaded and
joined in their process group as the RL trainer's ranks are (``cluster.backends``); the run's folder
is checked to be the same folder on every rank's node, where each rank is recorded
(``placement.json``), and a rank that dies or raises stops the run within seconds with a
``WorkerError`` naming it (``cluster.ray_group``), its peers torn down rather than left in a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from hybridflow.cluster.backends import build_worker_group, reserve_placements, runs_in_process
from hybridflow.config import Config
from hybridflow.config.sections.trainer import FOLLOW_FREE_CORES
from hybridflow.controller.preflight import config_device
from hybridflow.controller.run_folder import check_shared_folders, write_placement
from hybridflow.training import distributed
from hybridflow.workers.sft import rank_device


class RankJob(Protocol):
    """What a rank needs of a trainer's job: the run's config (``trainer.*``) and the run's folder."""

    cfg: Config
    output_dir: str


J = TypeVar("J", bound=RankJob)
Train = Callable[[int, int, J, torch.device], Any]


def run_ranks(role: str, world: int, train: Train[J], job: J, preload: list[str]) -> Any:
    """``train`` on each of ``world`` ranks of ``role`` (the command: named in a failed rank's error);
    rank 0's result. ``train`` and ``job`` cross into the rank processes by pickling (``train`` a
    module-level function); ``preload``: the modules a local forkserver imports once for every rank."""
    backend = job.cfg.trainer.backend
    if not runs_in_process(backend):
        return _run_worker_group(backend, role, world, train, job)
    if world == 1:
        return _run_rank(0, 1, 0, train, job)
    import torch.multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(preload)
    with context.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_main, args=(world, distributed.free_port(), train, job, results), nprocs=world,
                           join=True, start_method="forkserver")
        return results.get("final_val")


def _rank_main(rank: int, world: int, port: int, train: Train[J], job: J, results: MutableMapping[str, Any]) -> None:
    final_val = _run_rank(rank, world, port, train, job)
    if rank == 0:
        results["final_val"] = final_val


def _run_rank(rank: int, world: int, port: int, train: Train[J], job: J) -> Any:
    device = rank_device(job.cfg.trainer.device, rank, world)
    if world > 1:
        distributed.init_process_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                       device=device)
    try:
        return train(rank, world, job, device)
    finally:
        if world > 1:
            distributed.close_process_group()


def _run_worker_group(backend: str, role: str, world: int, train: Train[J], job: J) -> Any:
    """The ranks as a worker group of ``backend`` (a cluster's: each rank its own process, already in
    its process group when its worker is built), the whole per-rank loop one call on every rank."""
    t = job.cfg.trainer
    pools, placements = reserve_placements(
        backend, data_parallel_size=world, device=config_device(t.device), nnodes=t.nnodes, colocated_roles=[role],
        ray_address=t.joined_ray_address(), ray_dashboard=t.ray_dashboard,
        num_threads=None if t.num_threads == FOLLOW_FREE_CORES else t.num_threads)
    try:
        level = logging.getLogger().getEffectiveLevel()
        group = build_worker_group(backend, role, lambda r, w: RankRun(r, w, train, job, level), world,
                                   placements[role])
        try:
            out = Path(job.output_dir)
            check_shared_folders({"trainer.output_dir": out}, role, group)  # checkpoints and metrics go there
            write_placement(out, [(role, group)])
            return group.call_all(RankRun.run)[0]
        finally:
            group.close()
    finally:
        for pool in pools:
            pool.close()


class RankRun:
    """One rank of an offline trainer in a worker group's process: ``run`` is its whole loop."""

    def __init__(self, rank: int, world: int, train: Train[J], job: J, log_level: int) -> None:
        self.rank, self.world, self.train, self.job = rank, world, train, job
        # The rank's progress lines (a resume, the data counts) at the controller's level: the cluster
        # passes the rank's output on to the controller's console.
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")

    def run(self) -> Any:
        return self.train(self.rank, self.world, self.job, rank_device(self.job.cfg.trainer.device, self.rank,
                                                                         self.world))

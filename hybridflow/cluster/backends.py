"""Choosing a worker-group backend by name (``trainer.backend``): the one module that knows them all.

``worker_group`` holds the protocol and the in-process backend, ``ray_group`` the Ray one; both
import only downward, and this module imports both, so neither needs the other (no import cycle).
Ray itself is imported only when a run asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from hybridflow.cluster.worker_group import LocalWorkerGroup, WorkerGroup
from hybridflow.utils.threads import process_cores, rule_threads

if TYPE_CHECKING:
    from hybridflow.cluster.ray_group import ElasticPlacement, Placement, ResourcePool

W = TypeVar("W")

BACKENDS = ("local", "ray")
# Backends whose roles all live in the controller's process: they share memory, so weights are
# copied directly and a cross-process transport would have no peer to talk to.
IN_PROCESS_BACKENDS = frozenset({"local"})


def runs_in_process(backend: str) -> bool:
    """Whether ``backend`` (trainer.backend) runs every role in the controller's process."""
    if backend not in BACKENDS:
        raise ValueError(f"trainer.backend={backend!r} is not available; choose one of {sorted(BACKENDS)}")
    return backend in IN_PROCESS_BACKENDS


def build_worker_group(
    backend: str, role: str, factory: Callable[[int, int], W], world_size: int, placement: Placement | None = None
) -> WorkerGroup[W]:
    """The one place a backend is chosen by name. ``placement`` (where the ranks run) is
    required by ``ray`` and ignored in-process."""
    if backend == "local":
        return LocalWorkerGroup(role, factory, world_size)
    if backend == "ray":
        if placement is None:
            raise ValueError(f"{role}: trainer.backend=ray needs a placement (resource pool, share, threads, device)")
        from hybridflow.cluster.ray_group import RayWorkerGroup  # Ray only when asked for

        if placement.hosts is not None:  # trainer.hybrid_engine: in the bundles' shared processes
            from hybridflow.cluster.role_hosts import HostedWorkerGroup

            return HostedWorkerGroup(role, factory, world_size, placement)
        return RayWorkerGroup(role, factory, world_size, placement)
    raise ValueError(f"trainer.backend={backend!r} is not available; choose one of {sorted(BACKENDS)}")


def elastic_placement(*, ranks_per_group: int, data_parallel_size: int, device: torch.device,
                      num_threads: int | None = None) -> ElasticPlacement:
    """Where the groups of a Ray role that grows and shrinks go (``rollout.elastic``), each of
    ``ranks_per_group`` ranks in a placement group of its own, reserved as each group starts. Its
    ranks get the threads a split pool's would (``reserve_placements``; call that first: it joins
    the cluster)."""
    from hybridflow.cluster.ray_group import ElasticPlacement

    threads = num_threads or rule_threads(data_parallel_size * 2)
    return ElasticPlacement(ranks_per_group, use_gpu=device.type == "cuda", num_threads=threads, device=device)


def reserve_placements(
    backend: str,
    *,
    data_parallel_size: int,
    device: torch.device,
    nnodes: int = 1,
    colocated_roles: Sequence[str],
    split_roles: Sequence[str] = (),
    ray_address: str | None = None,
    ray_dashboard: bool = False,
    num_threads: int | None = None,
    share_processes: bool = False,
) -> tuple[list[ResourcePool], dict[str, Placement]]:
    """Where each role's ranks will run, for ``build_worker_group``, and the pools reserved.

    ``ray``: connect to the cluster at ``ray_address`` (or start a local one) and reserve one
    bundle per data-parallel rank, over ``nnodes`` nodes (``trainer.nnodes``; above 1 each node's
    ranks sit together on a node of their own, ``ResourcePool``); the ``colocated_roles`` share every
    bundle equally (rank r of each role in bundle r, a single-rank role in bundle 0). Each of
    ``split_roles`` gets a pool of its own of as many bundles, laid out alike
    (``rollout.placement=split``: its ranks on other devices than the trainer's). Each rank gets
    ``num_threads`` torch threads (None: the cores divided over the ranks; colocated roles run one
    after another within a step, so they need not split them). ``share_processes``
    (``trainer.hybrid_engine``): the colocated roles' ranks of bundle r live in one process, bundle
    r's role host (``role_hosts``), not a process each.
    ``local``: nothing to reserve.
    """
    if backend == "local":
        return [], {}
    if backend != "ray":
        raise ValueError(f"trainer.backend={backend!r} is not available; choose one of {sorted(BACKENDS)}")
    from hybridflow.cluster.ray_group import Placement, ResourcePool, init_ray

    cores = len(process_cores())
    pools_wanted = 1 + len(split_roles)
    # Logical CPUs of a local cluster: at least one per rank, so N ranks start even on fewer cores.
    init_ray(ray_address, dashboard=ray_dashboard, num_cpus=max(cores, data_parallel_size * pools_wanted))
    use_gpu = device.type == "cuda"
    pools = [ResourcePool(data_parallel_size, use_gpu=use_gpu, nnodes=nnodes)]
    try:
        pools += [ResourcePool(data_parallel_size, use_gpu=use_gpu, nnodes=nnodes) for _ in split_roles]
    except BaseException:
        for pool in pools:
            pool.close()
        raise
    threads = num_threads or rule_threads(data_parallel_size * pools_wanted)
    share = 1.0 / len(colocated_roles)
    hosts = None
    if share_processes:
        from hybridflow.cluster.role_hosts import RoleHosts

        hosts = RoleHosts(pools[0], num_threads=threads, device=device)
    placements = {role: Placement(pools[0], share=share, num_threads=threads, device=device, hosts=hosts)
                  for role in colocated_roles}
    placements |= {role: Placement(pool, share=1.0, num_threads=threads, device=device)
                   for role, pool in zip(split_roles, pools[1:], strict=True)}
    return pools, placements

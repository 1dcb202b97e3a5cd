"""Which rollout replicas exist, and which are down: the slots of their worker groups, the
restarts of the ones whose process died (``rollout.max_replica_restarts``) and, with
``rollout.elastic``, the replicas added where a node with room joined and removed where one left.

``RolloutReplicas`` serves requests over the replicas of the moment; this pool decides what the
moment's replicas are. Both share one router: a replica down or removed is dead to it, one
restarted or added is alive again (``hybridflow.controller.replicas`` tells the whole story).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridflow.cluster.worker_group import WorkerError, WorkerGroup
from hybridflow.rollout.router import ReplicaRouter
from hybridflow.workers.rollout import RolloutWorker

logger = logging.getLogger(__name__)


def replica_role(index: int) -> str:
    """The worker-group role of replica ``index``: what errors name."""
    return f"rollout replica {index}"


class ReplicaPlacer(Protocol):
    """How an elastic rollout's replicas get and give back room on the cluster (set-up's)."""

    def start(self, replica: int, patient: bool) -> WorkerGroup[RolloutWorker] | None:
        """Replica ``replica`` started in a reservation of its own, holding ``model.path``'s weights:
        ``patient``, waiting for room as long as set-up waits for the trainer's (raises past it);
        else None when Ray cannot place the reservation within a short wait."""
        ...

    def has_free_room(self) -> bool:
        """Whether the cluster's free resources could hold one more replica (a cheap first look)."""
        ...

    def release(self, replica: int) -> None:
        """Give back replica ``replica``'s reservation (its group closed)."""
        ...


@dataclass(frozen=True)
class ElasticReplicas:
    """``rollout.elastic``: the bounds of the replica count and where replicas go."""

    min_replicas: int
    max_replicas: int
    placer: ReplicaPlacer


class ReplicaPool:
    """The replicas' worker groups by slot, and their deaths, restarts, additions and removals."""

    def __init__(self, groups: Sequence[WorkerGroup[RolloutWorker]], router: ReplicaRouter, *,
                 rebuild: Callable[[int], WorkerGroup[RolloutWorker]] | None = None, max_restarts: int = 0,
                 elastic: ElasticReplicas | None = None) -> None:
        # Replica k's group by slot; None: a slot whose replica an elastic run removed.
        self.groups: list[WorkerGroup[RolloutWorker] | None] = list(groups)
        self.router = router
        self.elastic = elastic
        # rollout.max_replica_restarts, and how replica k's group is built again (None: a backend
        # whose replicas live in this process, where a replica's death is the controller's).
        self._rebuild = rebuild
        self.max_restarts = max_restarts if rebuild is not None or elastic is not None else 0
        self.restarts = [0] * len(self.groups)  # per replica, over the run
        self._retired_restarts = 0  # restarts of the replicas an elastic run removed since
        self._down: dict[int, str] = {}  # replica -> why: died, restarted at the next sync (restart_down)
        # Restarted replicas are not in the broadcast group yet: the next broadcast sync forms it again.
        self.rejoin_weight_sync = False
        # Called after replicas were restarted, added or removed (set-up records where every rank now
        # runs: placement.json).
        self.on_change: Callable[[], None] | None = None

    @property
    def num_replicas(self) -> int:
        """The replicas of the run now (those down, waiting for their restart, too)."""
        return len(self.active)

    @property
    def active(self) -> list[int]:
        """The slots that hold a replica (an elastic run's removed ones do not)."""
        return [k for k, group in enumerate(self.groups) if group is not None]

    def group(self, replica: int) -> WorkerGroup[RolloutWorker]:
        """Replica ``replica``'s worker group."""
        group = self.groups[replica]
        if group is None:
            raise IndexError(f"{replica_role(replica)} was removed (rollout.elastic)")
        return group

    def is_down(self, replica: int) -> bool:
        return replica in self._down

    @property
    def down_reasons(self) -> list[str]:
        """Why each replica down went down (the first line of its error)."""
        return list(self._down.values())

    @property
    def total_restarts(self) -> int:
        """Restarts over the run, those of replicas since removed too (``rollout/replica_restarts``)."""
        return sum(self.restarts) + self._retired_restarts

    def lost(self, replica: int, error: WorkerError) -> None:
        """``replica``'s call failed with ``error``: down until its restart when its process died
        and a restart is left (elastic: until the next sync restarts or removes it); else the error,
        naming the replica and its node, fails the call."""
        restarts = self.restarts[replica]
        elastic = self.elastic is not None
        if not error.process_died or (not elastic and restarts >= self.max_restarts):
            self.mark_failed(str(error))
            self.router.mark_dead(replica, str(error).splitlines()[0])
            if not error.process_died or self._rebuild is None:
                raise error  # its own code failed (it would again), or nothing here can restart it
            raise self.used_up(replica, error)
        self._down[replica] = str(error).splitlines()[0]
        self.router.mark_dead(replica, self._down[replica])
        if elastic:  # counted when it restarts: a replica removed (its node left) is no restart
            logger.warning("%s on %s died (rollout.elastic: at the next weight sync it is restarted where the cluster "
                           "has room, or removed; its requests go to the other replicas): %s", replica_role(replica),
                           self.node_of(replica), self._down[replica])
            return
        self.restarts[replica] += 1
        logger.warning("%s on %s died (restart %d of rollout.max_replica_restarts=%d at the next weight sync; "
                       "its requests go to the other replicas): %s", replica_role(replica), self.node_of(replica),
                       self.restarts[replica], self.max_restarts, self._down[replica])

    def used_up(self, replica: int, error: WorkerError | str) -> WorkerError:
        """The error that stops the run when ``replica`` died once more than its restarts allow."""
        failed = WorkerError(f"{replica_role(replica)} on {self.node_of(replica)} died and was not restarted: "
                             f"rollout.max_replica_restarts={self.max_restarts} restarts of it were used up\n{error}",
                             process_died=True)
        if isinstance(error, WorkerError):
            failed.__cause__ = error
        return failed

    def node_of(self, replica: int) -> str:
        """Where ``replica``'s ranks ran, for errors: node address (and Ray node id)."""
        nodes = dict.fromkeys(n.describe() for n in self.group(replica).nodes())
        return ", ".join(nodes)

    @property
    def down(self) -> list[int]:
        """The replicas that died and wait for their restart (``restart_down``)."""
        return sorted(self._down)

    def restart_down(self) -> list[int]:
        """Start every down replica again (a new process in its placement bundle: the same node,
        or another with room where Ray moved the bundle); returns them. They hold the weights of
        ``model.path``: the caller syncs them (the next weight sync, or ``restore_weights``).
        An elastic rollout restarts or removes them (``resize``, without starting new ones)."""
        if self.elastic is not None:
            return self.resize(grow=False)
        restarted = self.down
        for k in restarted:
            assert self._rebuild is not None, "only replicas that can be restarted go down"
            node = self.node_of(k)
            self.group(k).close()  # what is left of the dead replica (its other ranks, its bundle share)
            try:
                self.groups[k] = self._rebuild(k)
            except WorkerError as error:
                # The new process never started (its bundle's node is gone, with no room elsewhere): the
                # run stops on the replica that died and where, not on a new process that never had a node.
                failed = WorkerError(f"{replica_role(k)} on {node} died and its restart failed: {error}",
                                     process_died=error.process_died)
                raise failed from error
            del self._down[k]
            self.router.revive(k)
            self.rejoin_weight_sync = True
            logger.warning("%s restarted on %s", replica_role(k), self.node_of(k))
        if restarted and self.on_change is not None:
            self.on_change()
        return restarted

    # ------------------------------------------------------------------ elastic
    def resize(self, grow: bool = True) -> list[int]:
        """``rollout.elastic``: every replica down restarted where the cluster has room for it, or
        removed while more than ``rollout.min_replicas`` are left (below that its restart waits for
        room); then, ``grow``, new replicas while the cluster has room, up to ``rollout.max_replicas``.
        Returns the replicas started (restarted or new), which hold ``model.path``'s weights: the
        caller syncs them. A change re-forms the broadcast group at the next sync."""
        elastic = self.elastic
        assert elastic is not None, "resize is for rollout.elastic"
        before = self.active
        started = [k for k in self.down if self._replace_down(k, elastic)]
        if grow:
            started += self._grow(elastic)
        if started or self.active != before:
            self.rejoin_weight_sync = True
            if self.on_change is not None:
                self.on_change()
        return started

    def _replace_down(self, k: int, elastic: ElasticReplicas) -> bool:
        """Replica ``k`` died: a new process in a new reservation (True), or, with no room for one,
        none while more than ``rollout.min_replicas`` are left (False: removed)."""
        node, why = self.node_of(k), self._down.pop(k)
        self.group(k).close()  # what is left of it (its other ranks)
        elastic.placer.release(k)  # its reservation: on a node that left, Ray cannot place it again
        group = elastic.placer.start(k, patient=False)
        if group is None and self.num_replicas - 1 >= elastic.min_replicas:
            self._retire(k)
            logger.warning("%s on %s removed: it died and the cluster has no room for it (rollout.elastic: %d "
                           "replica(s) left, rollout.min_replicas=%d)", replica_role(k), node, self.num_replicas,
                           elastic.min_replicas)
            return False
        if self.restarts[k] >= self.max_restarts:
            if group is not None:
                group.close()
                elastic.placer.release(k)
            raise self.used_up(k, why)
        if group is None:
            logger.warning("%s on %s died and the cluster has no room for it now; rollout.min_replicas=%d: waiting "
                           "for room", replica_role(k), node, elastic.min_replicas)
            group = elastic.placer.start(k, patient=True)
        assert group is not None
        self.groups[k] = group
        self.restarts[k] += 1
        self.router.revive(k)
        logger.warning("%s restarted on %s (restart %d of rollout.max_replica_restarts=%d)", replica_role(k),
                       self.node_of(k), self.restarts[k], self.max_restarts)
        return True

    def _grow(self, elastic: ElasticReplicas) -> list[int]:
        """New replicas while the cluster has room, up to ``rollout.max_replicas``, each in the first
        empty slot (a removed replica's) or a new one."""
        added = []
        while self.num_replicas < elastic.max_replicas and elastic.placer.has_free_room():
            k = next((k for k, group in enumerate(self.groups) if group is None), len(self.groups))
            group = elastic.placer.start(k, patient=False)
            if group is None:
                break
            if k == len(self.groups):
                self.groups.append(group)
                self.restarts.append(0)
                self.router.add()
            else:
                self.groups[k] = group
                self.router.add(k)
            added.append(k)
            logger.warning("%s added on %s (rollout.elastic: %d of rollout.max_replicas=%d replicas)", replica_role(k),
                           self.node_of(k), self.num_replicas, elastic.max_replicas)
        return added

    def _retire(self, k: int) -> None:
        """Slot ``k`` holds no replica from now on (a new one may take it: its restarts count anew)."""
        self.groups[k] = None
        self._retired_restarts += self.restarts[k]
        self.restarts[k] = 0
        self.router.mark_dead(k, "removed (rollout.elastic)")

    def mark_failed(self, message: str) -> None:
        """The replicas the error names are dead to the router (the error's first line names the
        replica that failed first; later lines may name others)."""
        for r in self.active:
            if f"{replica_role(r)} rank" in message:
                self.router.mark_dead(r, message.splitlines()[0])

"""The by-reference data plane (``trainer.data_plane=refs``): samples' tokens go from the
rollout replica that made them straight to the ranks that train on them; the controller holds
records and handles.

    replica:     a prompt group finishes -> scored there -> ``put_group`` keeps its trajectories
                 (Ray's object store when the replica is a Ray process, else the list itself)
                 -> ``records_of``: a ``SampleRecord`` per sample, with the group's handle
    controller:  queues records, decides (staleness, filtering, balancing, advantages) on their
                 numbers, collates a ``RefBatch`` (``types.collate_records``), ships each rank a
                 shard of handles and columns
    rank:        ``resolve_batch``: fetch the shard's groups, pad them as the whole batch is padded,
                 put the controller's columns on: the ``TrainBatch`` the controller would have sent

On Ray a group is one object owned by the replica that put it: it lives while anyone holds its
handle (the queue's record, a shard in flight) and is freed when the step that trained it lets
go. If the replica's process dies, its groups are gone: a fetch fails naming the replica. In one
process the handle holds the list itself, and nothing is copied.
"""

from __future__ import annotations

import dataclasses
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.types import (
    RefBatch,
    Sample,
    SampleRecord,
    TrainBatch,
    Trajectory,
    collate_trajectories,
    loss_mask_runs,
)

# A fetch that waits longer than this for a group fails, naming the replica that holds it.
FETCH_TIMEOUT_S = 300.0

# The RefBatch columns a rank's TrainBatch takes from the controller (the rest it rebuilds from the payload).
_CONTROLLER_COLUMNS = ("group_ids", "rewards", "old_logprobs", "ref_logprobs", "advantages", "values", "returns",
                       "token_level_rewards", "rollout_is_weights", "rollout_keep_mask", "sum_pi_squared")


@dataclass(frozen=True)
class PayloadHandle:
    """Where one prompt group's trajectories are: ``ref`` is a Ray object reference when
    ``remote``, else the list itself. ``owner`` names the replica that holds them (errors say it)."""

    ref: Any
    owner: str
    remote: bool
    key: str  # unique per group: a fetch asks for each group once however many of its rows a shard has


def _ray() -> Any:
    """The ``ray`` module when this process is part of a running Ray cluster (a Ray worker, or
    a driver that connected), else None. Not imported here: a laptop run need not have Ray."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def put_group(trajectories: list[Trajectory], owner: str) -> PayloadHandle:
    """Keep one prompt group's trajectories where they were generated; its handle."""
    ray = _ray()
    key = uuid.uuid4().hex
    if ray is None:
        return PayloadHandle(trajectories, owner, remote=False, key=key)
    return PayloadHandle(ray.put(trajectories), owner, remote=True, key=key)


def records_of(trajectories: list[Trajectory], handle: PayloadHandle) -> list[SampleRecord]:
    """The records of a group kept under ``handle`` (scored: their rewards are set)."""
    return [
        SampleRecord(
            payload=handle, index=i, prompt_length=t.prompt_length, response_length=t.response_length,
            policy_tokens=t.policy_tokens, loss_mask_runs=loss_mask_runs(t.loss_mask), versions=t.versions,
            finish_reason=t.finish_reason, group_id=t.group_id, reward=t.reward, reward_extra=dict(t.reward_extra),
            reward_info=dict(t.reward_info), num_turns=t.num_turns, row=t.row, agent=t.agent, metadata=dict(t.metadata),
            stop_reason=t.stop_reason,
        )
        for i, t in enumerate(trajectories)
    ]


def fetch_groups(handles: list[PayloadHandle]) -> dict[str, list[Trajectory]]:
    """The trajectories of each group, by handle key (each group fetched once)."""
    unique = {h.key: h for h in handles}
    groups = {key: h.ref for key, h in unique.items() if not h.remote}
    remote = [h for h in unique.values() if h.remote]
    if not remote:
        return groups
    ray = _ray()
    if ray is None:
        raise RuntimeError(f"samples held by {remote[0].owner} are in Ray's object store, but this process is not "
                           f"connected to Ray")
    try:
        values = ray.get([h.ref for h in remote], timeout=FETCH_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - re-raised naming the holder
        raise RuntimeError(_lost_message(ray, remote, error)) from error
    groups.update({h.key: value for h, value in zip(remote, values, strict=True)})
    return groups


def _lost_message(ray: Any, handles: list[PayloadHandle], error: BaseException) -> str:
    """Which replica's samples could not be fetched, found by asking for each one briefly."""
    for h in handles:
        try:
            ray.get(h.ref, timeout=1.0)
        except Exception as each:  # noqa: BLE001
            return (f"the samples that {h.owner} generated could not be fetched (its process died, or its "
                    f"object store lost them): {type(each).__name__}: {str(each).splitlines()[0] if str(each) else ''}")
    return f"fetching the step's samples failed: {type(error).__name__}: {error}"


def fetch_trajectories(samples: Sequence[Sample]) -> list[Trajectory]:
    """Whole trajectories for ``samples``: a trajectory as it is; a record's tokens fetched from
    the replica that holds them, with the record's own fields on them (group, reward, the row's
    fields). For what must read tokens in the controller and asks for a bounded few of them
    (``trainer.rollout_data_dir``'s dumps)."""
    records = [s for s in samples if isinstance(s, SampleRecord)]
    groups = fetch_groups([r.payload for r in records]) if records else {}
    whole = []
    for s in samples:
        if isinstance(s, SampleRecord):
            fetched = groups[s.payload.key][s.index]
            s = dataclasses.replace(fetched, group_id=s.group_id, reward=s.reward, reward_extra=dict(s.reward_extra),
                                    reward_info=dict(s.reward_info), row=s.row, agent=s.agent,
                                    metadata=dict(s.metadata))
        whole.append(s)
    return whole


def resolve_batch(batch: TrainBatch | RefBatch) -> TrainBatch:
    """The ``TrainBatch`` a rank trains on: ``batch`` itself, or a ``RefBatch`` shard's payload
    fetched and padded to the whole batch's prompt and response lengths, with the controller's
    columns (rewards, group ids, advantages, ...) on it."""
    if isinstance(batch, TrainBatch):
        return batch
    groups = fetch_groups([handle for handle, _ in batch.refs])
    trajectories = [groups[handle.key][index] for handle, index in batch.refs]
    resolved = collate_trajectories(trajectories, batch.pad_token_id, prompt_length=batch.prompt_length,
                                    response_length=batch.padded_response_length)
    for name in _CONTROLLER_COLUMNS:
        setattr(resolved, name, getattr(batch, name))
    for name, values in batch.row_values.items():  # one number per row, on the row's loss mask
        setattr(resolved, name, values[:, None] * resolved.response_mask)
    return resolved

"""Weight sync into a rollout engine: a streamed state dict applied in buckets of bounded size.

The trainer streams ``(name, tensor)`` pairs (``model.state_dict().items()`` or a generator that
gathers shards lazily). The engine groups them into buckets of at most ``max_bucket_bytes`` so that
(1) at most one bucket is held beyond what the sender already holds, and (2) a bucket that must
change device travels as one flat buffer, one transfer instead of one per tensor. The cross-process
path (``weight_transfer``) groups with ``plan_buckets``, which also cuts a tensor larger than a
bucket into row slices, and broadcasts each bucket as one flat byte buffer, checked on the
receiver with ``check_bucket`` before its data is sent.

Names are Hugging Face parameter names; unknown names and shape mismatches raise and name the
parameter before anything in that bucket is written.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import NamedTuple, Protocol

import torch

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024  # large enough that a bucket amortises a transfer, small next to a model

NamedTensor = tuple[str, torch.Tensor]
RowRange = tuple[int, int]  # rows [start, stop) of a tensor's dim 0


class WeightSlice(NamedTuple):
    """One entry of a planned bucket (``plan_buckets``): the tensor ``name`` whole (``rows`` None),
    or the rows ``[start, stop)`` of its dim 0. ``tensor`` is always the whole tensor as the
    sender holds it (a DTensor when sharded: its shape is the full one), never the rows: the plan
    is made from names, shapes and dtypes alone, so every rank makes the same one."""

    name: str
    tensor: torch.Tensor
    rows: RowRange | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this entry carries: the whole tensor's, or its rows'."""
        whole = self.tensor.numel() * self.tensor.element_size()
        if self.rows is None:
            return whole
        return whole // self.tensor.shape[0] * (self.rows[1] - self.rows[0])


def iter_buckets(weights: Iterable[NamedTensor], max_bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[NamedTensor]]:
    """Group consecutive pairs into lists of at most ``max_bucket_bytes`` (a larger tensor goes alone)."""
    if max_bucket_bytes < 1:
        raise ValueError(f"max_bucket_bytes must be >= 1, got {max_bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class BucketedWeightUpdate(Protocol):
    """An engine that takes an update in buckets: ``weight_update(version)`` yields ``apply(bucket)``."""

    def weight_update(self, version: int | None = None) -> AbstractContextManager[Callable[[list[NamedTensor]], None]]:
        ...


def update_weights_in_buckets(
    engine: BucketedWeightUpdate,
    weights: Iterable[NamedTensor],
    max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    version: int | None = None,
) -> None:
    """``update_weights`` of the engines whose ``weight_update`` applies buckets (native, vLLM, SGLang: each
    sets it as its method): ``weights`` grouped by ``iter_buckets`` and applied inside one
    ``weight_update(version)``, so no step sees a mix of old and new weights; what a bucket's check and
    copy do, and what ``version`` means, is that engine's ``weight_update``. On an error the earlier
    buckets have already been applied: resend them all."""
    with engine.weight_update(version) as apply:
        for bucket in iter_buckets(weights, max_bucket_bytes):
            apply(bucket)


def plan_buckets(
    weights: Iterable[NamedTensor],
    max_bucket_bytes: int,
    row_cuts: Callable[[torch.Tensor], Sequence[int]] | None = None,
) -> Iterator[list[WeightSlice]]:
    """``iter_buckets`` for the cross-process sync, where a tensor larger than a bucket travels as
    row slices of at most ``max_bucket_bytes`` (dim 0; at least one row), so that no side ever
    materialises more than about one bucket of it.

    ``row_cuts(tensor)`` lists rows where a slice must end: a sharded trainer's shard boundaries
    (``distributed.shard_row_cuts``), so that each slice comes from one rank's shard. A tensor
    with a cut is sliced even if it fits a bucket: its owners send their rows to the sender
    instead of every rank all-gathering it, which holds the whole tensor twice on the sender
    while it runs (gloo) and moves it to ranks that drop it. Planned from names, shapes and dtypes
    only: every rank given the same weights makes the same plan."""
    if max_bucket_bytes < 1:
        raise ValueError(f"max_bucket_bytes must be >= 1, got {max_bucket_bytes}")
    bucket: list[WeightSlice] = []
    size = 0
    for name, tensor in weights:
        for entry in _row_slices(name, tensor, max_bucket_bytes, row_cuts):
            if bucket and size + entry.nbytes > max_bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(entry)
            size += entry.nbytes
    if bucket:
        yield bucket


def _row_slices(
    name: str, tensor: torch.Tensor, max_bytes: int, row_cuts: Callable[[torch.Tensor], Sequence[int]] | None
) -> Iterator[WeightSlice]:
    """The tensor whole if it fits a bucket and has no cut inside (or has no rows to split), else
    its row slices: of at most a bucket, and ending at every cut."""
    if tensor.dim() == 0 or tensor.shape[0] < 2:
        yield WeightSlice(name, tensor)
        return
    total = int(tensor.shape[0])
    cuts = sorted({int(c) for c in (row_cuts(tensor) if row_cuts is not None else ()) if 0 < c < total})
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes <= max_bytes and not cuts:
        yield WeightSlice(name, tensor)
        return
    per_slice = max(1, max_bytes // (nbytes // total))  # a row larger than a bucket goes alone
    start = 0
    for stop in [*cuts, total]:  # each span between cuts is split on its own
        while start < stop:
            end = min(start + per_slice, stop)
            yield WeightSlice(name, tensor, (start, end))
            start = end


def check_bucket(bucket: list[NamedTensor], targets: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the first pair that has no target or the wrong shape."""
    for name, tensor in bucket:
        target = targets.get(name)
        if target is None:
            close = difflib.get_close_matches(name, list(targets), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"update_weights: unknown parameter {name!r}{hint}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"update_weights: parameter {name!r} has shape {tuple(target.shape)} in the "
                f"rollout model but {tuple(tensor.shape)} was sent"
            )


def copy_bucket(bucket: list[NamedTensor], targets: Mapping[str, torch.Tensor]) -> None:
    """Copy a checked bucket into ``targets`` (casting), moving it as one flat buffer if it changes device."""
    if not bucket:
        return
    first = targets[bucket[0][0]]
    device, dtype = first.device, first.dtype
    if all(t.device == device for _, t in bucket):
        for name, tensor in bucket:
            targets[name].copy_(tensor)
        return
    # One transfer for the whole bucket, already in the target dtype.
    flat = torch.cat([t.detach().reshape(-1).to(dtype) for _, t in bucket]).to(device)
    start = 0
    for name, tensor in bucket:
        count = tensor.numel()
        targets[name].copy_(flat[start : start + count].view(tensor.shape))
        start += count

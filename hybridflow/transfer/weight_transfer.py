"""Cross-process weight sync: the trainer streams its weights to rollout processes by broadcast.

The in-process path (``NativeEngine.update_weights``) copies tensors the caller already holds.
When the rollout runs in another process (a Ray actor, another GPU), the trainer's rank 0 and the
rollout ranks form a *weight-sync group*: rank 0 sends, every other rank receives, over
torch.distributed collectives (gloo on CPU, NCCL on GPU). The group is standalone
(``WeightSyncGroup.connect``): it never touches the default process group, which the trainer's
ranks already use for FSDP and the rollout processes may use for tensor parallelism.

Protocol of one sync (``send_weights`` on rank 0, ``receive_weights`` on the others), bucket by
bucket (``weights.plan_buckets``), so each side holds at most one bucket beyond its parameters
(and, on a receiver, the one tensor being assembled from row slices):

1. *header*: the sender broadcasts the bucket's manifest (name, full shape, dtype of each tensor,
   and for a row slice its rows ``[start, stop)`` of dim 0: a tensor larger than a bucket travels
   as slices of at most a bucket) as JSON, or an end marker, or an abort marker when its weight
   iterator raised;
2. *verdict*: every rank all-gathers a status: ``None``, or why it cannot take this bucket (an
   unknown name, a wrong shape, rows outside dim 0 or not continuing the tensor's previous
   slice, found from the manifest alone), why applying the previous bucket failed, or, at the
   end marker, which sliced tensor is missing rows. Any error ends the sync on *every* rank:
   receivers raise, naming the parameter, and the sender raises with the receivers' messages.
   No rank is left waiting for data that will not come, and the group stays usable for the next
   sync;
3. *data*: the bucket travels as one flat byte buffer (tensors at aligned offsets, so a byte slice
   can be viewed as any dtype); receivers apply views of it with ``apply`` (the engine's
   ``update_weights``, which casts to the rollout dtype, e.g. fp32 trainer to bf16 rollout). A
   sliced tensor's rows go into a buffer of its full size, applied with the bucket that brings
   its last rows, so ``apply`` always sees whole tensors.

The end marker's verdict confirms that every receiver applied every bucket, so ``send_weights``
returning means the rollout side serves the new weights.

Memory: each side passes every bucket through one byte buffer, allocated for the first bucket and
reused (``_Scratch``), so the extra peak is one bucket on the receivers (plus the sliced tensor
being assembled); on the sender, one bucket plus the one tensor or slice its iterator
materialises at a time, each copied into the buffer and dropped before the next is asked for
(nothing for a ``state_dict()``: slices are views of its rows; one received slice for a sharded
trainer, which plans its buckets from the shards' full shapes and fetches each slice from its
owner only when ``send_buckets`` asks for it: ``hybridflow.workers.weight_stream.stream_weights``). Each
bucket is applied as it arrives, with one ``apply`` call per bucket: the engine's lock is held per
bucket, not across the sync, so sync while the engine is idle (as the RL loop does) when no step
may see a mix of old and new weights.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from hybridflow.transfer.weights import NamedTensor, RowRange, WeightSlice, check_bucket, copy_bucket, plan_buckets

SENDER_RANK = 0
# Every tensor starts at a multiple of this many bytes in a flat bucket: any dtype can then view
# its slice (``Tensor.view(dtype)`` needs an offset divisible by the element size), and the copy
# in and out starts on a cache line.
ALIGN_BYTES = 64
# A rank waiting on a collective longer than this raises instead of hanging: the peer died or
# never joined. Syncing a few GB takes seconds; the RL loop calls both sides together.
DEFAULT_TIMEOUT_S = 600.0
STORE_PREFIX = "hybridflow/weight_sync"
# Buckets of the cross-process path. Smaller than the in-process default because here buckets
# pipeline: the sender flattens bucket k+1 while the receivers apply bucket k. bench/weight_sync.py
# (80 MB model, gloo, CPU): 16-48 MB syncs in ~75 ms, 4 MB pays per-bucket round trips (~135 ms),
# 256 MB is one serial bucket (~130 ms).
DEFAULT_TRANSFER_BUCKET_BYTES = 32 * 1024 * 1024


def gpu_uuid(device: torch.device) -> str | None:
    """The UUID of the GPU ``device`` computes on (None off CUDA): two processes on one GPU see it
    under the same UUID, whatever index each one's CUDA_VISIBLE_DEVICES gives it."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def sync_device(device: torch.device, on_gpu: bool) -> torch.device:
    """Where a member's sync buffers live: its own GPU (NCCL) when every member of the group has a
    GPU of its own (``on_gpu``), else host memory (gloo). NCCL refuses two ranks on one GPU, which is
    where a rollout colocated with actor rank 0 runs."""
    if not on_gpu:
        return torch.device("cpu")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class WeightSyncError(RuntimeError):
    """A sync ended on this rank because another rank refused or failed it."""


class Collectives(Protocol):
    """The two collectives the protocol uses; c10d ``ProcessGroup`` and its backends both have them."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def broadcast(self, tensor: torch.Tensor, root: int) -> Any: ...

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]) -> Any: ...


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to know about a tensor before its bytes arrive: its name, full shape
    and dtype, and for a row slice (a tensor larger than a bucket) which rows of dim 0 it is."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: RowRange | None = None  # [start, stop) of dim 0; None: the whole tensor

    @property
    def data_shape(self) -> tuple[int, ...]:
        """The shape of the bytes that travel: ``shape``, or its rows for a slice."""
        if self.rows is None:
            return self.shape
        return (self.rows[1] - self.rows[0], *self.shape[1:])

    @property
    def nbytes(self) -> int:
        return math.prod(self.data_shape) * self.dtype.itemsize

    def to_json(self) -> list[Any]:
        entry = [self.name, list(self.shape), str(self.dtype).removeprefix("torch.")]
        return entry if self.rows is None else [*entry, list(self.rows)]

    @staticmethod
    def from_json(entry: list[Any]) -> TensorSpec:
        name, shape, dtype_name, *rows = entry
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight sync: parameter {name!r} was sent with unknown dtype {dtype_name!r}")
        start_stop = (int(rows[0][0]), int(rows[0][1])) if rows else None
        return TensorSpec(str(name), tuple(int(d) for d in shape), dtype, start_stop)

    def describe(self) -> str:
        return repr(self.name) if self.rows is None else f"rows [{self.rows[0]}, {self.rows[1]}) of {self.name!r}"


@dataclass(frozen=True)
class TransferStats:
    """What one sync moved, as seen by the rank that returns it."""

    buckets: int
    tensors: int
    bytes: int  # payload bytes, excluding alignment padding
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class WeightSyncGroup:
    """Rank 0 (the sender) and the receivers, over a c10d process group on ``device``.

    ``device`` is where buffers live for the collectives: CPU for gloo, the rank's GPU for NCCL.
    """

    def __init__(self, process_group: Collectives, device: torch.device | str = "cpu", keep_alive: Any = None) -> None:
        self.process_group = process_group
        self.device = torch.device(device)
        self.rank = int(process_group.rank())
        self.world_size = int(process_group.size())
        self._keep_alive = keep_alive  # the TCPStore: its server lives in rank 0's object

    @classmethod
    def connect(
        cls, *, rank: int, world_size: int, host: str, port: int,
        device: torch.device | str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> WeightSyncGroup:
        """Rendezvous at ``host:port`` (rank 0 listens there) and build a standalone group.

        NCCL when ``device`` is CUDA (each rank on its own GPU), gloo otherwise. Blocks until all
        ``world_size`` ranks have joined, or raises after ``timeout_s``.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" alone: this process's current GPU
            device = torch.device("cuda", torch.cuda.current_device())
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == SENDER_RANK, timeout=timeout)
        prefixed = dist.PrefixStore(STORE_PREFIX, store)
        backend: object
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            backend = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        # Backends have broadcast/allgather at run time; torch's stubs list them on ProcessGroup only.
        return cls(cast(Collectives, backend), device, keep_alive=store)

    @property
    def is_sender(self) -> bool:
        return self.rank == SENDER_RANK

    def close(self) -> None:
        """Release the group's connections (every rank, after its last sync)."""
        shutdown = getattr(self.process_group, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self._keep_alive = None

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` (on ``device``) from the sender, in place on the receivers."""
        self.process_group.broadcast(tensor, SENDER_RANK).wait()

    def broadcast_json(self, value: Any = None) -> Any:
        """The sender's ``value`` (JSON-serialisable) on every rank; receivers pass nothing."""
        payload = json.dumps(value).encode() if self.is_sender else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.broadcast(length)
        data = self._bytes_tensor(payload, int(length.item()))
        self.broadcast(data)
        return value if self.is_sender else json.loads(_to_bytes(data))

    def all_gather_text(self, text: str | None) -> list[str | None]:
        """Every rank's ``text`` in rank order, on every rank. One collective when all pass None
        (the usual verdict: nothing wrong), a second one only to carry messages."""
        payload = b"" if text is None else text.encode()
        code = -1 if text is None else len(payload)  # -1: None, so "" stays distinguishable
        codes = [int(c.item()) for c in self._all_gather(torch.tensor([code], dtype=torch.int64, device=self.device))]
        if all(c < 0 for c in codes):
            return [None] * self.world_size
        gathered = self._all_gather(self._bytes_tensor(payload, max(codes)))
        return [None if c < 0 else _to_bytes(g[:c]).decode() for g, c in zip(gathered, codes, strict=True)]

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        outputs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.process_group.allgather([outputs], [tensor]).wait()
        return outputs

    def _bytes_tensor(self, payload: bytes, length: int) -> torch.Tensor:
        """``payload`` zero-padded to ``length`` bytes, as a uint8 tensor on ``device``."""
        data = torch.zeros(length, dtype=torch.uint8)
        if payload:
            data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return data.to(self.device)


# ------------------------------------------------------------------------------------- sender
def send_weights(
    group: WeightSyncGroup, weights: Iterable[NamedTensor], max_bucket_bytes: int = DEFAULT_TRANSFER_BUCKET_BYTES
) -> TransferStats:
    """Stream ``(name, tensor)`` pairs to every receiver of ``group``; returns once all applied them.

    A tensor larger than ``max_bucket_bytes`` travels as row slices (``plan_buckets``), sent
    from views of its rows: nothing is copied for them.

    Raises ``WeightSyncError`` with the receivers' messages when one refuses a bucket (unknown
    name, wrong shape) or fails to apply one; the receivers have then applied the buckets before
    it. If ``weights`` raises, the receivers are told to abort and the error propagates here.
    """
    planned = plan_buckets(weights, max_bucket_bytes)
    return send_buckets(group, ((bucket, map(_rows_view, bucket)) for bucket in planned))


def _rows_view(entry: WeightSlice) -> torch.Tensor:
    return entry.tensor if entry.rows is None else entry.tensor[entry.rows[0] : entry.rows[1]]


def send_buckets(
    group: WeightSyncGroup, buckets: Iterable[tuple[list[WeightSlice], Iterable[torch.Tensor]]]
) -> TransferStats:
    """``send_weights`` of buckets planned by the caller, each as its entries and their bytes in
    that order (the whole tensor, or the rows of a slice): a sharded trainer plans its buckets
    from the shards' full shapes and gathers each tensor only when it is asked for it
    (``distributed.lead_bucket_gathers``).

    A bucket is taken from ``buckets`` only after the previous one was sent, and each tensor is
    copied into the flat buffer and dropped before the next one is asked for, so a lazy
    iterator's tensors are freed as they go: the sender's extra memory is the flat buffer (one
    bucket) plus one tensor. The receivers apply bucket k while the sender materialises k + 1."""
    if not group.is_sender:
        raise ValueError(f"send_weights runs on rank {SENDER_RANK} of the weight-sync group, not rank {group.rank}")
    start = time.perf_counter()
    count = tensors = payload = 0
    pending = iter(buckets)
    scratch = _Scratch(group.device)
    while True:
        prepared = _prepare_or_abort(group, pending, scratch)
        header = {"end": True} if prepared is None else {"tensors": [s.to_json() for s in prepared[0]]}
        group.broadcast_json(header)
        _check_verdicts(group, group.all_gather_text(None), error=None)
        if prepared is None:
            return TransferStats(count, tensors, payload, time.perf_counter() - start)
        specs, flat = prepared
        if flat.numel():  # a bucket of empty tensors has no bytes to send
            group.broadcast(flat)
        count, tensors, payload = count + 1, tensors + len(specs), payload + sum(s.nbytes for s in specs)
        # ``flat`` may be a gathered tensor's own bytes: free it before the next bucket is gathered.
        del prepared, flat


def _prepare_or_abort(
    group: WeightSyncGroup, buckets: Iterator[tuple[list[WeightSlice], Iterable[torch.Tensor]]], scratch: _Scratch
) -> tuple[list[TensorSpec], torch.Tensor] | None:
    """The next bucket's specs and flat bytes, None at the end.

    Flattened before its header goes out, so that whatever fails on the sender (its iterator, a
    tensor that cannot be read) fails before the receivers expect data: they are told to abort.
    The bucket's tensors are dropped on return, so gathered ones are freed before the broadcast.
    """
    try:
        bucket = next(buckets, None)
        if bucket is None:
            return None
        entries, tensors = bucket
        del bucket
        specs = [TensorSpec(e.name, tuple(e.tensor.shape), e.tensor.dtype, e.rows) for e in entries]
        data = iter(tensors)
        if len(specs) == 1:
            tensor = _checked(specs[0], next(data))
            if _sendable_as_is(tensor, scratch.device):
                # A tensor or row slice alone in its bucket (often a slice of one larger than a
                # bucket: the embedding) travels from its own bytes, no copy; the scratch, unless
                # larger, is dropped rather than held beside it (a received slice is about a bucket,
                # as is the scratch): the peak stays one bucket, at the cost of allocating the
                # scratch again after a run of such tensors.
                scratch.release_unless_larger(tensor.numel() * tensor.element_size())
                return specs, _as_bytes(tensor)
            data = iter([tensor])
            del tensor
        return specs, _flatten(specs, data, scratch)
    except Exception as exc:
        group.broadcast_json({"abort": f"{type(exc).__name__}: {exc}"})
        raise


def _checked(spec: TensorSpec, data: torch.Tensor) -> torch.Tensor:
    """``data``, once it is seen to be the bytes the manifest entry announces."""
    if tuple(data.shape) != spec.data_shape or data.dtype != spec.dtype:
        raise ValueError(f"weight sync: {spec.describe()} was planned as {spec.data_shape} {spec.dtype} but its data "
                         f"is {tuple(data.shape)} {data.dtype}")
    return data


def _flatten(specs: list[TensorSpec], data: Iterator[torch.Tensor], scratch: _Scratch) -> torch.Tensor:
    """The bucket's bytes at ``_layout`` offsets in one uint8 buffer (``scratch``'s), each tensor
    taken from ``data`` only once the previous one was copied and dropped."""
    offsets, total = _layout(specs)
    flat = scratch.take(total)
    for spec, offset in zip(specs, offsets, strict=True):
        tensor = next(data, None)
        if tensor is None:
            raise ValueError(f"weight sync: no bytes were given for {spec.describe()}")
        flat[offset : offset + spec.nbytes].copy_(_as_bytes(_checked(spec, tensor)))
        del tensor  # before the next one is gathered
    if next(data, None) is not None:
        raise ValueError(f"weight sync: a bucket of {len(specs)} tensor(s) was given more bytes than that")
    return flat


def _sendable_as_is(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether a broadcast can read ``tensor``'s own memory: one dense block on the group's device.
    Never written on the sender (the broadcast's root), so a model's parameter qualifies."""
    return tensor.is_contiguous() and tensor.device == device and tensor.layout == torch.strided


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


# ----------------------------------------------------------------------------------- receiver
def receive_weights(
    group: WeightSyncGroup,
    targets: Mapping[str, torch.Tensor],
    apply: Callable[[list[NamedTensor]], None] | None = None,
) -> TransferStats:
    """Receive one sync from the sender and apply it bucket by bucket; returns after the end marker.

    ``targets`` maps every name this rank accepts to a tensor of the right shape (the engine's
    ``model.state_dict()``); each manifest is checked against it before the bucket's data is sent.
    ``apply`` gets each bucket's complete tensors as ``(name, tensor)`` views in the *sender's*
    dtype, on ``group.device``, valid only during the call: pass the engine's ``update_weights``
    (it casts and copies under its lock); the default copies into ``targets`` with a cast. A
    tensor sent as row slices is assembled in a buffer of its full size and applied with the
    bucket that brings its last rows.

    Raises ``ValueError`` naming the parameter when this rank refuses a bucket (or the sync ends
    with a sliced tensor incomplete), the error ``apply`` raised, or ``WeightSyncError`` when
    another rank refused or the sender aborted.
    """
    if group.is_sender:
        raise ValueError(f"receive_weights runs on the receivers, not on rank {SENDER_RANK} (the sender)")
    apply = apply if apply is not None else (lambda bucket: copy_bucket(bucket, targets))
    start = time.perf_counter()
    buckets = tensors = payload = 0
    scratch = _Scratch(group.device)
    slices = _Assembly(group.device)
    failure: Exception | None = None  # from apply; reported at the next verdict
    while True:
        header = group.broadcast_json()
        if "abort" in header:
            raise WeightSyncError(f"the sender aborted the weight sync: {header['abort']}")
        specs, refusal = _read_manifest(header, targets, slices)
        error = failure or refusal
        _check_verdicts(group, group.all_gather_text(_describe(error)), error)
        if "end" in header:
            return TransferStats(buckets, tensors, payload, time.perf_counter() - start)
        failure = _receive_bucket(group, specs, apply, scratch, slices)
        buckets, tensors, payload = buckets + 1, tensors + len(specs), payload + sum(s.nbytes for s in specs)


def _read_manifest(
    header: dict[str, Any], targets: Mapping[str, torch.Tensor], slices: _Assembly
) -> tuple[list[TensorSpec], Exception | None]:
    """The bucket's specs and, if this rank cannot take them, why (names, shapes and row ranges
    only); at the end marker, a tensor whose slices did not all arrive."""
    try:
        if "end" in header:
            slices.check_complete()
            return [], None
        specs = [TensorSpec.from_json(entry) for entry in header.get("tensors", [])]
        # Meta tensors carry the shape without memory, so the in-process check applies unchanged.
        check_bucket([(s.name, torch.empty(s.shape, dtype=s.dtype, device="meta")) for s in specs], targets)
        slices.check(specs)
    except ValueError as exc:
        return [], exc
    return specs, None


def _receive_bucket(
    group: WeightSyncGroup, specs: list[TensorSpec], apply: Callable[[list[NamedTensor]], None], scratch: _Scratch,
    slices: _Assembly,
) -> Exception | None:
    """Receive one flat bucket into ``scratch`` and apply views of it and the tensors it completes.

    A slice alone in its bucket (the usual case: slices are cut to the bucket size) is received
    straight into its rows of the assembly buffer, the one copy it would otherwise cost saved."""
    offsets, total = _layout(specs)
    alone = len(specs) == 1 and specs[0].rows is not None
    flat = _as_bytes_view(slices.rows(specs[0])) if alone else scratch.take(total)
    if total:
        group.broadcast(flat)
    bucket: list[NamedTensor] = []
    for spec, offset in zip(specs, offsets, strict=True):
        data = flat[offset : offset + spec.nbytes].view(spec.dtype).view(spec.data_shape)
        if spec.rows is None:
            bucket.append((spec.name, data))
            continue
        if not alone:
            slices.rows(spec).copy_(data)
        finished = slices.received(spec)
        if finished is not None:
            bucket.append((spec.name, finished))
    try:
        if bucket:
            apply(bucket)
    except Exception as exc:  # the sender and the other receivers learn it at the next verdict
        return exc
    return None


class _Assembly:
    """Tensors that arrive as row slices, each assembled in a buffer of its full size (sender's
    dtype, on the group's device) until its last rows came; then handed to ``apply`` and freed.

    Slices of a tensor must arrive in row order, back to back (as ``plan_buckets`` cuts them):
    checked from the manifest, before any data moves, like names and shapes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._next_row: dict[str, int] = {}  # of every tensor whose slices are arriving

    def check(self, specs: list[TensorSpec]) -> None:
        """Raise ``ValueError`` naming the first slice that does not continue its tensor."""
        expected = dict(self._next_row)  # walked through the bucket: it may hold several slices
        for spec in specs:
            if spec.rows is None:
                if spec.name in expected:
                    raise ValueError(f"update_weights: parameter {spec.name!r} was sent whole while its rows "
                                     f"[{expected[spec.name]}, {spec.shape[0]}) are still to come")
                continue
            start, stop = spec.rows
            rows = spec.shape[0] if spec.shape else 0
            if not 0 <= start < stop <= rows:
                raise ValueError(f"update_weights: {spec.describe()} is outside dim 0 of its shape {spec.shape}")
            if start != expected.get(spec.name, 0):
                raise ValueError(f"update_weights: {spec.describe()} does not continue the rows received "
                                 f"(expected rows from {expected.get(spec.name, 0)})")
            buffer = self._buffers.get(spec.name)
            if buffer is not None and (tuple(buffer.shape) != spec.shape or buffer.dtype != spec.dtype):
                raise ValueError(f"update_weights: {spec.describe()} is {spec.shape} {spec.dtype}, its earlier rows "
                                 f"{tuple(buffer.shape)} {buffer.dtype}")
            expected[spec.name] = stop
            if stop == rows:
                del expected[spec.name]

    def check_complete(self) -> None:
        """At the end marker: raise ``ValueError`` naming a tensor whose slices did not all come."""
        if self._next_row:
            missing = ", ".join(f"{name!r} (rows from {row} of {self._buffers[name].shape[0]})"
                                for name, row in self._next_row.items())
            raise ValueError(f"update_weights: the weight sync ended before every row arrived: {missing}")

    def rows(self, spec: TensorSpec) -> torch.Tensor:
        """Where the slice's rows go in its tensor's buffer (allocated with the first slice)."""
        assert spec.rows is not None
        buffer = self._buffers.get(spec.name)
        if buffer is None:
            buffer = self._buffers[spec.name] = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            self._next_row[spec.name] = 0
        return buffer[spec.rows[0] : spec.rows[1]]

    def received(self, spec: TensorSpec) -> torch.Tensor | None:
        """Record the slice's rows as written; the full tensor once they were its last, else None."""
        assert spec.rows is not None
        self._next_row[spec.name] = spec.rows[1]
        if spec.rows[1] < spec.shape[0]:
            return None
        del self._next_row[spec.name]
        return self._buffers.pop(spec.name)


def _as_bytes_view(rows: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, writable in place (a receive target)."""
    return rows.reshape(-1).view(torch.uint8)


# -------------------------------------------------------------------------------------- shared
class _Scratch:
    """The one byte buffer a sync's buckets pass through, on each side.

    Allocated for the first bucket and reused for the next ones (grown, the old one dropped first,
    only for a larger bucket); freed with the sync. A fresh allocation per bucket would pay the
    page faults of new memory every time, about as costly on a CPU as copying the bucket.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes``; its previous contents are overwritten."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer[:nbytes]

    def release_unless_larger(self, nbytes: int) -> None:
        """Drop the buffer unless it is larger than ``nbytes`` (a tensor about to be sent as is)."""
        if self._buffer is not None and self._buffer.numel() <= nbytes:
            self._buffer = None


def _check_verdicts(group: WeightSyncGroup, verdicts: list[str | None], error: Exception | None) -> None:
    """Raise on every rank if any rank reported an error: this rank's own error, or a summary."""
    if error is not None:
        raise error
    refusals = [f"rank {rank}: {message}" for rank, message in enumerate(verdicts) if message is not None]
    if refusals:
        raise WeightSyncError(f"weight sync stopped on rank {group.rank}: " + "; ".join(refusals))


def _describe(error: Exception | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _layout(specs: list[TensorSpec]) -> tuple[list[int], int]:
    """Byte offset of each tensor in a flat bucket, and the bucket's total size."""
    offsets, end = [], 0
    for spec in specs:
        start = -(-end // ALIGN_BYTES) * ALIGN_BYTES
        offsets.append(start)
        end = start + spec.nbytes
    return offsets, end


def _to_bytes(data: torch.Tensor) -> bytes:
    return data.cpu().numpy().tobytes()

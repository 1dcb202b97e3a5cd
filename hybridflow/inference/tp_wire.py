"""A tensor-parallel replica's wire: its process group with every collective's failure turned into
a ``TensorParallelError`` naming the rank (``GroupComm``), and the leader's commands to its
followers, pickled into a fixed-size header broadcast with their tensors inline or after it
(``CommandSender``, ``receive_commands``). ``tensor_parallel`` explains the design.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# How long a leader whose collective failed waits for a lost rank's process to show as exited.
DEATH_GRACE_S = 2.0
# The leader sends a keep-alive after this share of the timeout without a command, so an idle
# replica (the trainer's turn) never times out while its leader lives.
KEEPALIVE_FRACTION = 0.25
# A command header rides in one broadcast of this many bytes; a larger one takes a second.
HEADER_BYTES = 16384
# Tensors of a command up to this many bytes in all ride inside the header (a decode step of 256
# rows carries 6 KiB): one broadcast per step instead of two. Larger ones (long prefill chunks)
# follow in one broadcast per dtype.
INLINE_PAYLOAD_BYTES = 12288
_LENGTH_BYTES = 8


class TensorParallelError(RuntimeError):
    """A tensor-parallel replica cannot go on: a rank died, stopped answering or diverged."""


@dataclass(frozen=True)
class Peer:
    """Who a rank of the replica is, for error messages (gathered when the replica is built)."""

    tp_rank: int
    global_rank: int
    host: str
    pid: int

    def describe(self) -> str:
        return f"TP rank {self.tp_rank} (global rank {self.global_rank}, pid {self.pid} on {self.host})"


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` on this host has exited (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


class GroupComm:
    """The replica's group, with every collective's failure turned into a ``TensorParallelError``.

    The first failure is kept: the group is unusable after it, so every later collective raises
    the same error at once instead of waiting for another timeout.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, peers: list[Peer], timeout_s: float) -> None:
        self.group, self.device, self.peers, self.timeout_s = group, device, peers, timeout_s
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.leader = dist.get_global_rank(group, 0)
        self.broken: TensorParallelError | None = None

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        if self.broken is not None:
            raise self.broken
        try:
            yield
        except TensorParallelError:
            raise
        except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError: both end the replica
            self.broken = TensorParallelError(self._explain(what, exc))
            raise self.broken from exc

    def _explain(self, what: str, exc: Exception) -> str:
        me = self.peers[self.rank]
        if self.rank != 0:
            return (f"{me.describe()}: {what} failed: lost the leader {self.peers[0].describe()}; it died or sent "
                    f"nothing for {self.timeout_s:.0f} s: {type(exc).__name__}: {exc}")
        host = socket.gethostname()
        others = self.peers[1:]
        local = [p for p in others if p.host == host]
        # A killed rank's sockets close while it exits, so the collective can fail a moment before
        # the process shows as gone: look again for a short while before calling it stuck.
        deadline = time.monotonic() + DEATH_GRACE_S
        while not (dead := [p for p in local if _process_gone(p.pid)]) and local and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead:
            who = "; ".join(f"{p.describe()} is dead" for p in dead)
        else:
            who = (f"no answer within {self.timeout_s:.0f} s from "
                   f"{', '.join(p.describe() for p in others)} (one died or is stuck)")
        return f"tensor-parallel replica: {what} failed on the leader: {who}: {type(exc).__name__}: {exc}"

    def all_reduce(self, tensor: torch.Tensor) -> None:
        with self.guard("all-reduce in a forward"):
            dist.all_reduce(tensor, group=self.group)

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        with self.guard(what):
            dist.broadcast(tensor, src=self.leader, group=self.group)

    def scatter(self, tensor: torch.Tensor, parts: list[torch.Tensor] | None, what: str) -> None:
        with self.guard(what):
            dist.scatter(tensor, parts, src=self.leader, group=self.group)


# ---------------------------------------------------------------------- commands on the wire


@dataclass(frozen=True)
class _TensorRef:
    """A tensor's place in a command's payload: the ``index``-th tensor of its dtype's buffer."""

    dtype: torch.dtype
    index: int
    shape: tuple[int, ...]


Command = tuple[str, tuple[Any, ...]]  # (op, arguments); tensors may appear at any depth of lists/tuples


def _map_leaves(value: Any, leaf: Any) -> Any:
    """``value`` with ``leaf`` applied to everything that is not a list, tuple or dict in it."""
    if isinstance(value, list | tuple):
        mapped = [_map_leaves(v, leaf) for v in value]
        return mapped if isinstance(value, list) else tuple(mapped)
    if isinstance(value, dict):
        return {k: _map_leaves(v, leaf) for k, v in value.items()}
    return leaf(value)


def _strip_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a reference to its place in ``tensors`` (appended)."""
    def strip(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        same = [t for t in tensors if t.dtype == leaf.dtype]
        tensors.append(leaf)
        return _TensorRef(leaf.dtype, len(same), tuple(leaf.shape))

    return _map_leaves(value, strip)


def _restore_tensors(value: Any, payload: dict[torch.dtype, list[torch.Tensor]]) -> Any:
    return _map_leaves(value, lambda leaf: payload[leaf.dtype][leaf.index] if isinstance(leaf, _TensorRef) else leaf)


def _flat_payload(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors if t.dtype == dtype]).to(device)


def _send_commands(comm: GroupComm, commands: list[Command]) -> None:
    """Leader: one header broadcast (two when it is large), then one payload broadcast per dtype
    unless the tensors are small enough to ride inside the header."""
    tensors: list[torch.Tensor] = []
    stripped = _strip_tensors(commands, tensors)
    dtypes = list(dict.fromkeys(t.dtype for t in tensors))
    inline: dict[torch.dtype, bytes] | None = None
    if sum(t.numel() * t.element_size() for t in tensors) <= INLINE_PAYLOAD_BYTES:
        cpu = torch.device("cpu")
        inline = {d: _flat_payload(tensors, d, cpu).view(torch.uint8).numpy().tobytes() for d in dtypes}
    header = pickle.dumps((stripped, dtypes, inline), protocol=pickle.HIGHEST_PROTOCOL)
    buffer = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    buffer[:_LENGTH_BYTES] = torch.frombuffer(bytearray(len(header).to_bytes(_LENGTH_BYTES, "little")), dtype=torch.uint8)
    first = header[: HEADER_BYTES - _LENGTH_BYTES]
    buffer[_LENGTH_BYTES : _LENGTH_BYTES + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    comm.broadcast(buffer.to(comm.device), "sending a command")
    rest = header[len(first) :]
    if rest:
        comm.broadcast(torch.frombuffer(bytearray(rest), dtype=torch.uint8).to(comm.device), "sending a command")
    if inline is None:
        for dtype in dtypes:
            comm.broadcast(_flat_payload(tensors, dtype, comm.device), "sending a command's tensors")


def receive_commands(comm: GroupComm, device: torch.device) -> list[Command]:
    """Follower: the counterpart of ``_send_commands``; tensors land on ``device``."""
    buffer = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=comm.device)
    comm.broadcast(buffer, "waiting for a command")
    raw = buffer.cpu().numpy().tobytes()
    length = int.from_bytes(raw[:_LENGTH_BYTES], "little")
    header = raw[_LENGTH_BYTES : _LENGTH_BYTES + length]
    if length > len(header):
        rest = torch.empty(length - len(header), dtype=torch.uint8, device=comm.device)
        comm.broadcast(rest, "waiting for a command")
        header += rest.cpu().numpy().tobytes()
    stripped, dtypes, inline = pickle.loads(header)
    refs: list[_TensorRef] = []
    _collect_refs(stripped, refs)
    payload: dict[torch.dtype, list[torch.Tensor]] = {}
    for dtype in dtypes:
        shapes = [r.shape for r in sorted((r for r in refs if r.dtype == dtype), key=lambda r: r.index)]
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        if inline is not None:
            data = inline[dtype]
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype) if data else torch.empty(0, dtype=dtype)
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=comm.device)
            comm.broadcast(flat, "receiving a command's tensors")
        flat = flat.to(device)
        payload[dtype] = [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]
    return _restore_tensors(stripped, payload)


def _collect_refs(value: Any, refs: list[_TensorRef]) -> None:
    if isinstance(value, _TensorRef):
        refs.append(value)
    elif isinstance(value, list | tuple):
        for v in value:
            _collect_refs(v, refs)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_refs(v, refs)


class CommandSender:
    """The leader's end: queues mirrored cache changes and sends them ahead of the next command.

    ``lock`` serialises everything that uses the group (commands, forwards, weight transfers,
    keep-alives): collectives must run in the same order on every rank.
    """

    def __init__(self, comm: GroupComm) -> None:
        self.comm = comm
        self.lock = threading.RLock()
        self._pending: list[Command] = []
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, name="tp-keepalive", daemon=True)
        self._keepalive.start()

    def post(self, command: Command, flush: bool = False) -> None:
        """Queue ``command`` (already done on the leader); ``flush`` sends it now."""
        with self.lock:
            if self.comm.broken is not None:
                raise self.comm.broken
            self._pending.append(command)
            if flush:
                self._flush()

    def send(self, command: Command) -> None:
        """Send the queue and ``command``; the caller holds ``lock`` when collectives follow."""
        with self.lock:
            self._pending.append(command)
            self._flush()

    def _flush(self) -> None:
        commands, self._pending = self._pending, []
        self._last_sent = time.monotonic()
        _send_commands(self.comm, commands)

    def close(self) -> None:
        """Stop the followers (they return from ``follow``) and the keep-alive."""
        self._closed.set()
        with self.lock:
            if self.comm.broken is None:
                self.send(("stop", ()))
        self._keepalive.join(timeout=5.0)

    def _keep_alive(self) -> None:
        if self.comm.device.type == "cuda":
            torch.cuda.set_device(self.comm.device)  # NCCL work from this thread runs on the replica's device
        interval = self.comm.timeout_s * KEEPALIVE_FRACTION
        while not self._closed.wait(interval / 4):
            if time.monotonic() - self._last_sent < interval or not self.lock.acquire(blocking=False):
                continue
            try:
                if self._closed.is_set() or self.comm.broken is not None:
                    return
                self.send(("noop", ()))
            except TensorParallelError as exc:  # kept in comm.broken: the next step raises it
                logger.error("%s", exc)
                return
            finally:
                self.lock.release()

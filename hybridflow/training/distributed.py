"""Data parallelism for the training engine: process groups, FSDP2 sharding, global counts, and
gathering/scattering full state for export, weight sync and checkpoints.

Everything here is a no-op or a plain local operation when no process group of more than one
rank is initialised, so the single-process engine keeps its exact behaviour.

FSDP2 on CPU: ``fully_shard`` runs over gloo in torch 2.13 (all-gather of parameters in
forward, reduce-scatter of gradients in backward). Measured on the built-in tiny model, two
gloo ranks give the same gradient norm as one process to 1e-7 relative, so no DDP fallback is
needed. The gradient reduce-scatter *averages* over ranks, which is why losses are normalised
by global counts times ``dp_size`` (``hybridflow.algorithms.aggregation``).

Weight sync streams full tensors without gathering the whole model: every rank walks the same
buckets of ``model.state_dict()`` (DTensors carry the full shape and dtype, so the plan needs no
gather) and gathers one bucket at a time, rank 0 leading (``lead_bucket_gathers``) and the others
following in lockstep (``follow_bucket_gathers``); see those functions for how a sync that stops
early reaches every rank. A sharded tensor is never gathered whole: it is planned as row slices
cut at the shard boundaries (``shard_row_cuts``) and at most a bucket long, and each slice's
owner sends its rows to rank 0 (``gather_rows``), so no rank materialises more than about one
bucket, and the others send only their own rows. ``gather_weight`` (an all-gather) remains for
tensors not sharded on dim 0.

Full-format checkpoints stay world-size independent: the model is exported as one full HF
safetensors file (gathered on rank 0) and the optimizer as the single-process
``optimizer.state_dict()`` layout (integer parameter ids), gathered with
``torch.distributed.checkpoint.state_dict``. A run saved with N ranks resumes with M, and
``torch.load(weights_only=True)`` still guards loading. Sharded checkpoints, which gather
nothing, are ``hybridflow.training.sharded_checkpoint``.
"""

from __future__ import annotations

import gc
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

F = TypeVar("F", bound=Callable[..., Any])

COLLECTIVE_ATTR = "__hybridflow_collective__"

# A rank that waits on a collective longer than this raises instead of hanging; the controller
# reports a dead peer much sooner (worker groups watch every rank), this is the last resort.
PROCESS_GROUP_TIMEOUT_S = 1800.0


def collective(method: F) -> F:
    """Declare a worker method whose body runs collectives (gathers full weights, saves sharded
    state): every rank of the group must enter it together, or the ranks that did would wait
    forever. Worker groups refuse it in ``call_one``: call sites use ``call_all`` and take
    the rank they need. Set once where the method is defined, never at run time."""
    setattr(method, COLLECTIVE_ATTR, True)
    return method


def is_collective(method: Callable[..., Any]) -> bool:
    return bool(getattr(method, COLLECTIVE_ATTR, False))


# ----------------------------------------------------------------------------- process group
def world_size() -> int:
    """Ranks in the default process group; 1 when none is initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default process group; 0 when none is initialised."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_initialized() -> bool:
    """Whether this process has joined a default process group (of any size)."""
    return dist.is_available() and dist.is_initialized()


def is_data_parallel() -> bool:
    return world_size() > 1


def is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (rank 0 picks it for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def init_process_group(
    *, rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device,
    timeout_s: float = PROCESS_GROUP_TIMEOUT_S,
) -> str:
    """Join the default process group: NCCL for CUDA ranks, gloo on CPU. Returns the backend."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        # Each rank sees only its own GPU(s); bind NCCL to the one this rank computes on.
        torch.cuda.set_device(device if device.index is not None else torch.device("cuda", 0))
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return backend


def join_one_rank_group(device: torch.device) -> None:
    """Make this process a default process group of one rank (FSDP2 shards over a group, even of
    one: how one GPU offloads its parameters). A group this process already has is kept, if it
    is of one rank; a rank of a larger group cannot be a group of its own."""
    if is_initialized():
        if world_size() != 1:
            raise RuntimeError(f"this process is rank {rank()} of a group of {world_size()}, not a group of one")
        return
    init_process_group(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port(), device=device)


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sum over ranks (float64, so token counts stay exact); local values alone
    without a process group."""
    if not is_data_parallel():
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


def all_reduce_max(value: int) -> int:
    """The largest ``value`` over ranks (the micro-batch count every rank must run)."""
    if not is_data_parallel():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def close_process_group() -> None:
    """Leave the process group (and every group made from it) while the interpreter is whole.

    The roles' FSDP modules and device meshes hold the groups inside reference cycles, which only
    the garbage collector frees: left to the interpreter's exit, gloo's worker threads can be torn
    down with work still referencing tensors, and the process aborts (SIGABRT, "terminate called
    without an active exception") after a run that finished, as torch's own c10d notes describe
    (pytorch/pytorch#179291). Collecting first frees them while Python can still run their
    destructors. Call it where the ranks' models are no longer referenced (after the training
    function returned), or the collection cannot free them."""
    gc.collect()
    dist.destroy_process_group()


def barrier() -> None:
    if is_data_parallel():
        dist.barrier()


def broadcast_text(text: str | None) -> str | None:
    """Rank 0's ``text`` on every rank (the others pass anything); ``text`` itself without a
    process group. One collective for None, a second one only to carry a message."""
    if not is_data_parallel():
        return text
    device = _comm_device()
    payload = b"" if text is None else text.encode()
    code = torch.tensor([-1 if text is None else len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(code, src=0)
    length = int(code.item())
    if length < 0:
        return None
    data = torch.zeros(length, dtype=torch.uint8)
    if dist.get_rank() == 0 and payload:
        data[:] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    data = data.to(device)
    dist.broadcast(data, src=0)
    return data.cpu().numpy().tobytes().decode()


# ------------------------------------------------------------------ sequence parallel groups
# size -> (the default group the groups were made in, this rank's group): a process that joins a
# new default group (a second run in one process) makes new groups.
_SEQUENCE_PARALLEL_GROUPS: dict[int, tuple[Any, Any]] = {}


def check_sequence_parallel_size(size: int, world: int) -> None:
    """Ulysses groups are blocks of ``size`` consecutive ranks, so ``size`` must divide the world."""
    if size < 1 or world % size:
        raise ValueError(f"ulysses_sequence_parallel_size={size} must divide the {world} ranks of the role")


def sequence_parallel_group(size: int):
    """This rank's Ulysses group: ranks ``[g*size, (g+1)*size)`` share (and split the tokens of)
    the same micro-batches, so the role has ``world // size`` data-parallel ranks. None for
    ``size`` 1. A collective the first time for each size (every rank creates every group, in
    the same order, as ``new_group`` requires); cached afterwards."""
    if size == 1:
        return None
    world = world_size()
    check_sequence_parallel_size(size, world)
    default = dist.group.WORLD
    cached = _SEQUENCE_PARALLEL_GROUPS.get(size)
    if cached is None or cached[0] is not default:
        rank = dist.get_rank()
        mine = None
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine = group
        cached = _SEQUENCE_PARALLEL_GROUPS[size] = (default, mine)
    return cached[1]


# ---------------------------------------------------------------------------------- sharding
def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: HF models name them in ``_no_split_modules``
    (``Qwen2DecoderLayer``, ``LlamaDecoderLayer``, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} declares no decoder layer class in _no_split_modules; cannot shard it per layer"
        )
    return layers


def shard_model(
    model: torch.nn.Module,
    *,
    mixed_precision: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    fsdp_size: int | None = None,
    offload_params: bool = False,
) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each decoder layer, then the root (embeddings, final norm and the
    LM head, tied or not). Parameters become DTensors sharded over the default process group.

    ``mixed_precision`` (bf16): forward/backward run in that dtype on the gathered parameters
    while the sharded master weights and the optimizer stay in their own dtype (fp32). None
    computes in the parameters' own dtype (bf16 ones: pure bf16 training).

    ``reduce_dtype``: the dtype gradients are reduce-scattered in (FSDP2 casts each rank's
    gradient to it before the collective, and the result back to the parameters' dtype). fp32
    by default whatever the compute dtype, as verl; bf16 halves the traffic at bf16's rounding.

    ``fsdp_size`` (verl's ``fsdp_config.fsdp_size``): shard over groups of this many ranks and
    replicate across the groups (HSDP), so parameter all-gathers stay inside a node while only
    gradients cross nodes. None, -1 or the world size: shard over every rank. Gradients are
    averaged over all ranks either way, so the result does not depend on it.

    ``offload_params``: keep the sharded parameters, their gradients and the optimizer step on
    the CPU (FSDP2 ``CPUOffloadPolicy``); each layer is copied to the GPU for its forward and
    backward only. CUDA only: on a CPU run the parameters are in host memory already.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=reduce_dtype)
    mesh = shard_mesh(fsdp_size)
    offload = OffloadPolicy()
    if offload_params:
        if mesh.device_type != "cuda":
            raise ValueError("param_offload moves sharded parameters from the GPU to the CPU; this run computes on the CPU")
        offload = CPUOffloadPolicy(pin_memory=True)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 unit of ``model``. FSDP2 keeps the root unit
    gathered after a forward (its backward would need them at once); after a no-grad forward
    nothing frees them, and until something does the module's parameters are the gathered
    tensors, not the sharded DTensors the optimizer holds (a checkpoint saved then finds
    parameters it has no name for) and each rank holds the whole root unit."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def shard_mesh(fsdp_size: int | None):
    """The device mesh FSDP2 shards over: 1-D over every rank, or 2-D (replicate, shard) with
    ``fsdp_size`` ranks per shard group (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = world_size()
    full = fsdp_size is None or fsdp_size == -1 or fsdp_size >= world  # verl's create_device_mesh: >= world is all
    if not full and (fsdp_size < 1 or world % fsdp_size):
        raise ValueError(f"fsdp_size={fsdp_size} must divide the {world} data-parallel ranks (or be -1 or at least "
                         f"{world}: all of them)")
    device_type = _comm_device().type
    if full:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard"))


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to a plain tensor (a collective); plain tensors pass through."""
    gather = getattr(value, "full_tensor", None)
    return gather() if callable(gather) else value


def gather_weight(value: torch.Tensor) -> torch.Tensor:
    """``full_tensor`` of a model weight, whose shard may live off the mesh's device: offloaded
    shards (``CPUOffloadPolicy``) sit in host memory while NCCL gathers only GPU tensors, so they
    travel to the mesh's device first, as ``get_model_state_dict`` does. Plain tensors pass
    through, uncopied."""
    mesh = getattr(value, "device_mesh", None)
    if mesh is not None and value.device.type != mesh.device_type:
        value = value.to(mesh.device_type)
    return full_tensor(value)


def shard_row_cuts(value: torch.Tensor) -> list[int]:
    """The rows of dim 0 where one rank's shard of ``value`` ends and the next one's begins (the
    sorted starts of shards 1..S-1; trailing empty shards add nothing); [] for a plain tensor or
    one not sharded on dim 0. A plan that cuts a tensor's row slices there takes each slice from
    one owner rank (``gather_rows``). From the full shape and the mesh alone: every rank agrees."""
    owner_dim = _row_shard_dim(value)
    if owner_dim is None:
        return []
    shards = int(value.device_mesh.size(owner_dim))
    chunk = _shard_rows(int(value.shape[0]), shards)
    return [k * chunk for k in range(1, shards) if k * chunk < value.shape[0]]


def gather_rows(value: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor | None:
    """Rows ``[start, stop)`` of dim 0 of ``value`` on rank 0, None on the other ranks; the slice
    must lie within one rank's shard (cut at ``shard_row_cuts``).

    Only that owner and rank 0 take part: the owner sends its local rows, rank 0 receives them
    into a buffer of the slice's size (point-to-point on the default group, in the order every
    rank walks the same plan), the others return at once. So a sharded tensor is never gathered
    whole, and no rank holds more than the slice (checked with 3 gloo ranks and uneven shards,
    empty ones included: each rank's local rows are ``torch.chunk``'s). Rank 0 owning the rows itself,
    or a plain tensor (one rank, or a buffer every rank holds whole): a view, nothing copied."""
    start, stop = rows
    if not 0 <= start < stop <= value.shape[0]:
        raise ValueError(f"rows [{start}, {stop}) are outside dim 0 of a tensor of shape {tuple(value.shape)}")
    rank = dist.get_rank() if is_data_parallel() else 0
    owner_dim = _row_shard_dim(value)
    if owner_dim is None:  # whole on every rank: rank 0 reads its own copy
        local = value.to_local() if hasattr(value, "to_local") else value
        return local[start:stop] if rank == 0 else None
    mesh = value.device_mesh
    chunk = _shard_rows(int(value.shape[0]), int(mesh.size(owner_dim)))
    shard = start // chunk
    if stop > (shard + 1) * chunk:
        raise ValueError(f"rows [{start}, {stop}) of a tensor of shape {tuple(value.shape)} span two ranks' shards "
                         f"(each holds {chunk} rows): cut the slices at shard_row_cuts")
    # Rank 0 sits at coordinate 0 of every mesh dimension (``init_device_mesh`` numbers ranks in
    # order), so the owner is the rank of shard ``shard`` in rank 0's replica group (HSDP).
    coordinate = [0] * mesh.ndim
    coordinate[owner_dim] = shard
    owner = int(mesh.mesh[tuple(coordinate)].item())
    if rank not in (0, owner):
        return None
    local = value.to_local()
    offset = shard * chunk
    if local.shape[0] < stop - offset:
        raise RuntimeError(f"rank {rank} holds {local.shape[0]} rows of a tensor of shape {tuple(value.shape)}, not "
                           f"rows [{start}, {stop}) from row {offset}: its shards are not split like torch.chunk")
    if rank == owner == 0:
        return local[start - offset : stop - offset]
    device = _comm_device()
    if rank == owner:
        # Offloaded shards sit in host memory while NCCL sends only GPU tensors: one slice moves.
        dist.send(local[start - offset : stop - offset].to(device).contiguous(), dst=0)
        return None
    received = torch.empty((stop - start, *value.shape[1:]), dtype=value.dtype, device=device)
    dist.recv(received, src=owner)
    return received


def _row_shard_dim(value: torch.Tensor) -> int | None:
    """The mesh dimension a DTensor's dim 0 is sharded over (FSDP2: the "shard" one), None if it
    is replicated everywhere or a plain tensor. Other layouts are not FSDP2's: refused."""
    placements = getattr(value, "placements", None)
    if placements is None:
        return None
    from torch.distributed.tensor import Replicate, Shard

    sharded = [d for d, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    others = [p for p in placements if not isinstance(p, Replicate) and not (isinstance(p, Shard) and p.dim == 0)]
    if others or len(sharded) > 1:
        raise ValueError(f"row slices need a tensor sharded on dim 0 over one mesh dimension (FSDP2), "
                         f"not placements {tuple(placements)}")
    return sharded[0] if sharded else None


def _shard_rows(total: int, shards: int) -> int:
    """Rows per shard as FSDP2 and DTensor split dim 0 (``torch.chunk``: ceil, the last ranks
    get fewer or none)."""
    return -(-total // shards)


# ------------------------------------------------------------------ lockstep bucket gathers
RowRange = tuple[int, int]
# A planned bucket entry: the tensor ``name`` as this rank holds it, whole (rows None) or the
# rows [start, stop) of its dim 0 (``hybridflow.transfer.weights.WeightSlice`` is one).
PlannedTensor = tuple[str, torch.Tensor, RowRange | None]
P = TypeVar("P", bound=PlannedTensor)
# Rank 0 broadcasts None before each bucket (one small collective), and once at the end this
# marker, or the error that ended the stream (never the marker: it has no "Type: " prefix).
_GATHER_DONE = "done"


@contextmanager
def lead_bucket_gathers(buckets: Iterable[list[P]]) -> Iterator[Iterator[tuple[list[P], Iterator[torch.Tensor]]]]:
    """Rank 0's side of a lockstep gather: yields an iterator of the buckets, each as its planned
    entries and an iterator of their bytes (the full tensor, or a slice's rows), in that order,
    each gathered only when the consumer asks for it.

    ``buckets`` holds this rank's weights as ``model.state_dict()`` lists them (DTensors when
    sharded), grouped the same way on every rank (planned from names, full shapes and dtypes;
    sharded tensors as row slices cut at ``shard_row_cuts``). Before gathering a
    bucket rank 0 tells the other ranks to join (``follow_bucket_gathers``); on leaving the block
    it finishes the bucket's gathers the consumer did not ask for (the others are in them) and
    tells them how the stream ended: done, or the error that left it, which they return. So a
    consumer that stops early (a receiver refused a bucket) leaves no rank waiting in a gather
    that will not come.

    Memory: each tensor is referenced only by the consumer once yielded, not kept here, so a
    consumer that copies it out and drops it before asking for the next (``send_buckets``)
    holds one tensor beside its flat buffer, never a whole bucket of gathered tensors; a row
    slice is received alone (``gather_rows``). One rank: no collective at all, and the tensors
    are the model's own (plain tensors and their row slices are views)."""
    lead = _LeadGathers(buckets)
    try:
        yield iter(lead)
    except BaseException as exc:
        lead.finish_bucket()
        broadcast_text(f"{type(exc).__name__}: {exc}")
        raise
    lead.finish_bucket()
    broadcast_text(_GATHER_DONE)


class _LeadGathers(Generic[P]):
    """The buckets ``lead_bucket_gathers`` hands out, and the one being gathered."""

    def __init__(self, buckets: Iterable[list[P]]) -> None:
        self._buckets = buckets
        self._pending: Iterator[torch.Tensor] | None = None

    def __iter__(self) -> Iterator[tuple[list[P], Iterator[torch.Tensor]]]:
        for bucket in self._buckets:
            self.finish_bucket()  # the consumer skipped some of the previous bucket's bytes
            broadcast_text(None)  # the others join this bucket's gathers
            self._pending = _gathered(bucket)
            yield bucket, self._pending

    def finish_bucket(self) -> None:
        """Join the current bucket's remaining gathers, dropping their results."""
        if self._pending is not None:
            for _ in self._pending:
                pass
            self._pending = None


def _gathered(bucket: list[P]) -> Iterator[torch.Tensor]:
    for entry in bucket:
        # Yielded without a local name: this frame keeps no reference while the consumer works.
        yield _on_rank_zero(_materialise(entry), entry)


def _on_rank_zero(data: torch.Tensor | None, entry: PlannedTensor) -> torch.Tensor:
    if data is None:  # gather_rows returns rows on rank 0 whatever the owner: a bug if not
        raise RuntimeError(f"rank 0 got no rows {entry[2]} of {entry[0]!r}")
    return data


def _materialise(entry: PlannedTensor) -> torch.Tensor | None:
    """The entry's bytes on rank 0 (None on another rank for a slice): a collective every rank
    joins (``gather_weight``), or a slice that only its owner and rank 0 move (``gather_rows``).
    Both looked up at call time, so tests and the bench can count what passes through them."""
    _, tensor, rows = entry
    return gather_weight(tensor) if rows is None else gather_rows(tensor, rows)


def follow_bucket_gathers(buckets: Iterable[Sequence[PlannedTensor]]) -> str | None:
    """The other ranks' side of ``lead_bucket_gathers``: join each gather rank 0 leads, with the
    same ``buckets``, and drop the result (a row slice: send it if this rank owns it). Returns
    None when rank 0 finished the stream, else its error message (rank 0 raised it; the caller
    raises here too)."""
    planned = iter(buckets)
    done = 0
    while True:
        status = broadcast_text(None)
        if status == _GATHER_DONE:
            if next(planned, None) is not None:  # rank 0 stopped early without an error
                return f"rank 0 ended the stream after {done} bucket(s) of a longer plan"
            return None
        if status is not None:
            return status
        bucket = next(planned, None)
        if bucket is None:
            raise RuntimeError(f"rank 0 gathers more than the {done} bucket(s) this rank planned: the ranks' "
                               f"weights differ in names or shapes")
        for entry in bucket:
            _materialise(entry)  # only rank 0 keeps the result
        done += 1


# ------------------------------------------------------------------------------ full state
def _full_options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def gather_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters and buffers on rank 0, on CPU; ``{}`` on the other ranks.
    A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options(cpu_offload=True))


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Scatter a full state dict (every rank passes the same one) into the sharded model.
    Returns (missing, unexpected) keys like ``load_state_dict(strict=False)``."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    expected = set(model.state_dict())
    unexpected = sorted(set(state) - expected)
    missing = sorted(expected - set(state))
    set_model_state_dict(model, {k: v for k, v in state.items() if k in expected}, options=_full_options(strict=False))
    return missing, unexpected


def gather_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state on rank 0 in the single-process layout (``{}`` elsewhere).
    A collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    named = get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))
    return named_to_indexed(named) if named else {}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Shard a single-process-layout optimizer state (every rank passes the same one)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    named = indexed_to_named(state, optimizer_param_names(model, optimizer))
    set_optimizer_state_dict(model, optimizer, named, options=_full_options())


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Parameter names per optimizer group, in the order ``optimizer.state_dict()`` numbers them."""
    names = {p: n for n, p in model.named_parameters()}
    return [[names[p] for p in group["params"]] for group in optimizer.param_groups]


def named_to_indexed(state: dict[str, Any]) -> dict[str, Any]:
    """Name-keyed optimizer state (``torch.distributed.checkpoint``) -> ``optimizer.state_dict()``
    layout: parameters numbered 0.. across groups in order."""
    ids: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        params = []
        for name in group["params"]:
            ids[name] = len(ids)
            params.append(ids[name])
        groups.append({**group, "params": params})
    return {"state": {ids[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def indexed_to_named(state: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """The inverse of ``named_to_indexed`` given the names of each group's parameters."""
    if [len(g["params"]) for g in state["param_groups"]] != [len(names) for names in group_names]:
        raise ValueError(
            "optimizer state does not match the model: parameter counts per group "
            f"{[len(g['params']) for g in state['param_groups']]} vs {[len(n) for n in group_names]}"
        )
    names: dict[int, str] = {}
    groups = []
    for group, group_param_names in zip(state["param_groups"], group_names, strict=True):
        names.update(zip(group["params"], group_param_names, strict=True))
        groups.append({**group, "params": list(group_param_names)})
    return {"state": {names[int(i)]: value for i, value in state["state"].items()}, "param_groups": groups}

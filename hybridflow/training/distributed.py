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
early reaches every rank.

Checkpoints stay world-size independent: the model is exported as one full HF safetensors file
(gathered on rank 0) and the optimizer as the single-process ``optimizer.state_dict()`` layout
(integer parameter ids), gathered with ``torch.distributed.checkpoint.state_dict``. A run saved
with N ranks resumes with M, and ``torch.load(weights_only=True)`` still guards loading.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

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
    fsdp_size: int | None = None,
    offload_params: bool = False,
) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each decoder layer, then the root (embeddings, final norm and the
    LM head, tied or not). Parameters become DTensors sharded over the default process group.

    ``mixed_precision`` (bf16): forward/backward run in that dtype on the gathered parameters
    while the sharded master weights, the optimizer and the gradient reduction stay fp32. None
    keeps everything in the parameters' own dtype.

    ``fsdp_size`` (verl's ``fsdp_config.fsdp_size``): shard over groups of this many ranks and
    replicate across the groups (HSDP), so parameter all-gathers stay inside a node while only
    gradients cross nodes. None, -1 or the world size: shard over every rank. Gradients are
    averaged over all ranks either way, so the result does not depend on it.

    ``offload_params``: keep the sharded parameters, their gradients and the optimizer step on
    the CPU (FSDP2 ``CPUOffloadPolicy``); each layer is copied to the GPU for its forward and
    backward only. CUDA only: on a CPU run the parameters are in host memory already.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
        if mixed_precision is not None
        else MixedPrecisionPolicy()
    )
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


def shard_mesh(fsdp_size: int | None):
    """The device mesh FSDP2 shards over: 1-D over every rank, or 2-D (replicate, shard) with
    ``fsdp_size`` ranks per shard group (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = world_size()
    full = fsdp_size is None or fsdp_size in (-1, world)
    if not full and (fsdp_size < 1 or world % fsdp_size):
        raise ValueError(f"fsdp_size={fsdp_size} must divide the {world} data-parallel ranks (or be -1: all of them)")
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


# ------------------------------------------------------------------ lockstep bucket gathers
NamedTensor = tuple[str, torch.Tensor]
# Rank 0 broadcasts None before each bucket (one small collective), and once at the end this
# marker, or the error that ended the stream (never the marker: it has no "Type: " prefix).
_GATHER_DONE = "done"


@contextmanager
def lead_bucket_gathers(buckets: Iterable[list[NamedTensor]]) -> Iterator[Iterator[list[NamedTensor]]]:
    """Rank 0's side of a lockstep gather: yields an iterator of the buckets' full tensors,
    each bucket gathered only when the consumer asks for it.

    ``buckets`` holds this rank's weights as ``model.state_dict()`` lists them (DTensors when
    sharded), grouped the same way on every rank (planned from names, full shapes and dtypes).
    Before gathering a bucket rank 0 tells the other ranks to join (``follow_bucket_gathers``);
    on leaving the block it tells them how the stream ended: done, or the error that left it,
    which they return. So a consumer that stops early (a receiver refused a bucket) leaves no
    rank waiting in a gather that will not come.

    Memory: a bucket's full tensors are referenced only by the list handed to the consumer, not
    kept here, so they are freed as soon as the consumer drops that list. One rank: no
    collective at all, and the tensors are the model's own (plain tensors pass through)."""
    try:
        yield _gathered(buckets)
    except BaseException as exc:
        broadcast_text(f"{type(exc).__name__}: {exc}")
        raise
    broadcast_text(_GATHER_DONE)


def _gathered(buckets: Iterable[list[NamedTensor]]) -> Iterator[list[NamedTensor]]:
    for bucket in buckets:
        broadcast_text(None)  # the others join this bucket's gathers
        # Yielded without a local name: this frame keeps no reference while the consumer works.
        yield [(name, gather_weight(tensor)) for name, tensor in bucket]


def follow_bucket_gathers(buckets: Iterable[list[NamedTensor]]) -> str | None:
    """The other ranks' side of ``lead_bucket_gathers``: join each gather rank 0 leads, with the
    same ``buckets``, and drop the result. Returns None when rank 0 finished the stream, else
    its error message (rank 0 raised it; the caller raises here too)."""
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
        for _, tensor in bucket:
            gather_weight(tensor)  # a collective every rank joins; only rank 0 keeps the result
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

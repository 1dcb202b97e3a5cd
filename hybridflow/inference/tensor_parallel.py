"""Tensor-parallel native rollout: one engine replica spread over the ranks of a process group.

Why: a model whose weights or KV cache do not fit one device still rolls out with the native
engine, each of ``tp`` ranks holding ``1/tp`` of the attention heads, of the MLP and of the cache.

How the model is split (Megatron's layout, over the compact forward of ``compact``):

- q/k/v and gate/up are column-parallel: rank ``r`` holds query heads ``[r H/tp, (r+1) H/tp)``,
  kv heads ``[r KV/tp, (r+1) KV/tp)`` (so every query head's kv head is local) and intermediate
  rows ``[r I/tp, (r+1) I/tp)``. ``num_attention_heads``, ``num_key_value_heads`` and
  ``intermediate_size`` must be divisible by ``tp`` (``check_tensor_parallel_shape``).
- o_proj and down_proj are row-parallel: each rank multiplies its columns into a partial sum, one
  all-reduce per projection adds them (two per layer), and the bias and the residual are added
  once, to the reduced sum (``ShardedCompactLM._add_linear_``).
- The embedding, the norms and the LM head are replicated (simplest; they are a small part of a
  large model's weights). Only the leader computes logits; only the leader samples.
- The KV cache is split by kv heads: each rank's ``SlotKVCache`` holds its own heads only.

Who runs what: TP rank 0, the *leader*, runs an ordinary ``NativeEngine`` (requests, scheduler,
sampling, stop rules) over a sharded forward and cache that *mirror* their work: every forward and
every cache change is described in a small command (op name and arguments, e.g. token ids,
positions, row indices) broadcast over the group. The other ranks, the *followers*, run
``TensorParallelFollower.follow()``, a blocking loop that executes commands until ``stop``. Cache
changes run on the leader first and travel queued with the next forward (one broadcast per decode
step, its few tensors inside the header, then the forward's all-reduces); a forward is announced before it runs,
so every rank enters its all-reduces together. A command that fails on a follower but not on the
leader means the replica has diverged: the follower raises and exits, and the leader's next
collective fails.

Weights: the leader keeps the full HF model (the target of ``update_weights`` and
``weight_update``, unchanged, so the cross-process weight sync needs no change) beside its shard.
When an update ends (``repack``), the leader scatters each sharded tensor's shards and broadcasts
the replicated ones over the group; each rank copies its part in place. The same transfer runs when
the engine is built, so the leader's weights are the replica's whatever the followers loaded. A
follower keeps only its shards: the projection weights of the model it was built from are released.

Failures are bounded: the group's timeout (``DEFAULT_TP_TIMEOUT_S``, set by ``new_tp_group``)
bounds every collective. While idle, the leader sends a keep-alive every quarter of it, so a
follower waits for the next command as long as the leader lives, and raises naming the leader once
it stops. A dead or stuck follower makes the leader's next collective raise
``TensorParallelError`` naming the TP rank (a follower on this host whose process is gone is named
as dead); every later step fails with the same error until the replica is rebuilt. On NCCL a
collective with a dead peer is aborted by the NCCL watchdog at the group's timeout instead.

Not supported: CUDA-graph and static decode (a TP engine decodes eagerly).

The wire (the group's collectives and errors, the commands' format and the leader's sender) is
``tp_wire``; this module splits the model and the cache and runs the two roles.

Use, on every rank of the rollout world once the default process group is up::

    group = new_tp_group(tp, timeout_s)  # collective: every rank builds every replica's group
    role = build_tp_engine(model, group, timeout_s=timeout_s, **native_engine_kwargs)
    if isinstance(role, TensorParallelFollower):
        role.follow()  # blocks until the leader's close(); raises TensorParallelError if it is lost
    else:
        engine = role.engine  # generate, update_weights / weight_update, sleep, wake_up as usual
        ...
        role.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.inference.compact import CompactCausalLM, KVAccess, LayerWeights, Packed
from hybridflow.inference.families import FAMILIES, config_problem
from hybridflow.inference.kv_cache import SlotKVCache
from hybridflow.inference.native import NativeEngine, default_kv_cache_bytes, resolve_dtype
from hybridflow.inference.tp_wire import (
    Command,
    CommandSender,
    GroupComm,
    Peer,
    TensorParallelError,
    receive_commands,
)

logger = logging.getLogger(__name__)

# Bounds every collective of a replica: a dead or stuck rank fails the others after this long
# instead of hanging them. Long enough for the slowest forward or weight transfer step.
DEFAULT_TP_TIMEOUT_S = 60.0

# Which LayerWeights fields are split, and how. Row-split tensors are a concatenation of blocks
# (q, k, v rows; gate, up rows) and each rank takes its share of every block; column-split tensors
# give each rank a range of input columns; the rest are replicated.
_ROW_SPLIT = ("qkv_weight", "qkv_bias", "gate_up_weight", "gate_up_bias")
_COLUMN_SPLIT = ("o_weight", "down_weight")
_REPLICATED = ("input_norm", "q_norm", "k_norm", "o_bias", "post_norm", "down_bias", "attn_out_norm", "mlp_out_norm")
# Mixture-of-experts tensors: never split, because ``check_tensor_parallel_shape`` refuses those families.
_NOT_SPLIT = ("router", "experts_gate_up", "experts_down")

# SlotKVCache's public methods, by how the leader's cache mirrors them (``_MirroredCache``). A
# public method in none of these makes ``build_tp_engine`` refuse to start: a new cache operation
# must be classified here, or followers would silently miss it.
_CACHE_MIRRORED = ("ensure_capacity", "release", "rebuild", "move_rows", "copy_prompts", "zero_rows",
                   "zero_prompt_slots")
_CACHE_ACCESS = ("decode_access", "prefill_access")
_CACHE_READ_ONLY = ("rows_that_fit", "aligned", "fits_alone", "prompt_row", "planned_nbytes")
# The prefix cache's copies out of and into rows: each rank would need its own block store of its
# heads, which is not built, so a tensor-parallel engine runs without the prefix cache and never
# calls these.
_CACHE_PREFIX_ONLY = ("read_positions", "write_positions")
# The same for CompactCausalLM (``_LeaderCompact`` overrides the mirrored ones).
_COMPACT_MIRRORED = ("forward", "set_weight_layout", "repack")
# ``release_packed`` (sleep level 2) acts on the leader alone: a follower keeping its packed copy
# is only memory, and the mirrored ``repack`` rebuilds every rank's. ``logits`` runs the replicated LM head on
# the leader's hidden states (a prompt-scoring prefill): no follower needs it.
_COMPACT_READ_ONLY = ("from_hf", "packed_tensors", "release_packed", "logits")



def check_tensor_parallel_shape(config: Any, tp: int) -> None:
    """Raise ``ValueError`` unless ``config``'s heads and MLP split evenly over ``tp`` ranks (and its
    family can be split at all: not the mixture-of-experts ones)."""
    if tp < 1:
        raise ValueError(f"tensor_model_parallel_size must be >= 1, got {tp}")
    family = FAMILIES.get(getattr(config, "model_type", None))
    if tp > 1 and family is not None and not family.tensor_parallel:
        raise ValueError(config_problem({"model_type": config.model_type}, tp))
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = int(getattr(config, key))
        if value % tp:
            raise ValueError(
                f"tensor parallelism splits {key} over the ranks of a replica, but {key}={value} is not "
                f"divisible by rollout.tensor_model_parallel_size={tp}; pick a size that divides it"
            )


def new_tp_group(
    tp: int, timeout_s: float = DEFAULT_TP_TIMEOUT_S, backend: str | None = None
) -> dist.ProcessGroup:
    """This rank's replica group: consecutive ranks ``[k tp, (k+1) tp)`` of the default group.

    Collective: every rank of the default group calls it (``new_group`` creates every replica's
    group on every rank). ``timeout_s`` bounds each collective of the replica; pass the same value
    to ``build_tp_engine``.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp < 1 or world % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must be >= 1 and divide the world size {world}")
    timeout = datetime.timedelta(seconds=timeout_s)
    mine: dist.ProcessGroup | None = None
    for start in range(0, world, tp):
        group = dist.new_group(list(range(start, start + tp)), timeout=timeout, backend=backend)
        if start <= rank < start + tp:
            mine = group
    assert mine is not None
    return mine


# ---------------------------------------------------------------------- weight shards


def _row_blocks(field: str, shape: Any) -> list[int]:
    """Sizes of the blocks a row-split tensor concatenates (full model, before the split)."""
    if field.startswith("qkv"):
        return [shape.num_heads * shape.head_dim] + [shape.num_kv_heads * shape.head_dim] * 2
    return [shape.intermediate_size] * 2


def _shard(field: str, full: torch.Tensor, shape: Any, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part of a full LayerWeights tensor, contiguous (replicated: ``full`` itself)."""
    if field in _ROW_SPLIT:
        parts, start = [], 0
        for block in _row_blocks(field, shape):
            share = block // size
            parts.append(full[start + rank * share : start + (rank + 1) * share])
            start += block
        return torch.cat(parts).contiguous()
    if field in _COLUMN_SPLIT:
        share = full.shape[1] // size
        return full[:, rank * share : (rank + 1) * share].contiguous()
    return full


def _layer_fields() -> list[str]:
    fields = [f.name for f in dataclasses.fields(LayerWeights)]
    unknown = set(fields) - set(_ROW_SPLIT + _COLUMN_SPLIT + _REPLICATED + _NOT_SPLIT)
    if unknown:
        raise NotImplementedError(
            f"LayerWeights fields {sorted(unknown)} are not classified for tensor parallelism: add them to "
            "the split or replicated lists in hybridflow/inference/tensor_parallel.py"
        )
    return fields


def _check_classified(cls: type, *groups: tuple[str, ...]) -> None:
    known = {name for group in groups for name in group}
    public = {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}
    public |= {name for name, value in vars(cls).items() if isinstance(value, staticmethod | classmethod)}
    unknown = sorted(public - known)
    if unknown:
        raise NotImplementedError(
            f"{cls.__name__} methods {unknown} are not classified for tensor parallelism (mirrored to the "
            "followers or read-only): classify them in hybridflow/inference/tensor_parallel.py"
        )


def _prepare_model(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """What NativeEngine does to its model before building its forward: device, dtype, no grads."""
    model.to(device=device)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
        parameter.data = parameter.data.to(dtype=dtype)
    return model.eval()



# ---------------------------------------------------------------------- the sharded forward


class ShardedCompactLM(CompactCausalLM):
    """This rank's shard of a ``CompactCausalLM`` (module docstring); o/down partial sums are all-reduced."""

    def __init__(self, full: CompactCausalLM, model: torch.nn.Module, comm: GroupComm, max_positions: int) -> None:
        shape = full.shape
        local = dataclasses.replace(
            shape,
            num_heads=shape.num_heads // comm.size,
            num_kv_heads=shape.num_kv_heads // comm.size,
            intermediate_size=shape.intermediate_size // comm.size,
        )
        fields = _layer_fields()
        layers = [
            LayerWeights(**{
                name: None if getattr(w, name) is None else _shard(name, getattr(w, name), shape, comm.rank, comm.size)
                for name in fields
            })
            for w in full.layers
        ]
        super().__init__(
            embed=full.embed, lm_head=full.lm_head, final_norm=full.final_norm, layers=layers, shape=local,
            rms_norm_eps=full.eps, rotary=full.rotary, max_positions=max_positions, layer_rotary=full.layer_rotary,
            sliding_windows=full.sliding_windows, numerics=full.numerics,
        )
        self.full_shape = shape
        self.comm = comm

    def _add_linear_(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, packed: Packed) -> None:
        """Row-parallel projection: ``residual += sum over ranks of x_r W_r^T, + b``, on every rank.

        The local product is a partial sum, so the single-device path's addmm onto the residual
        would add the residual ``tp`` times: reduce first, then add the bias and the residual once.
        """
        residual.add_(self._project(x, weight, bias, packed))

    def _project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed: Packed) -> torch.Tensor:
        """Row-parallel projection: the sum over ranks of x_r W_r^T, + b, on every rank."""
        partial = self._linear(x, weight, None, packed)
        self.comm.all_reduce(partial)
        if bias is not None:
            partial.add_(bias)  # HF's order: residual + (x W^T + b)
        return partial

    def transfer_weights(self, full: CompactCausalLM | None) -> None:
        """Leader (``full`` given): send every tensor's shards and replicas; followers: receive theirs.

        The leader's replicated tensors are its full model's own, so broadcasting them sends the
        update; its split tensors receive their part of the scatter like everyone else's.
        """
        comm = self.comm
        replicated = [self.embed, self.final_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for tensor in replicated:
            comm.broadcast(tensor, "transferring weights")
        for layer_index, layer in enumerate(self.layers):
            for name in _layer_fields():
                mine = getattr(layer, name)
                if mine is None:
                    continue
                if name in _REPLICATED:
                    comm.broadcast(mine, "transferring weights")
                    continue
                parts = None
                if full is not None:
                    source = getattr(full.layers[layer_index], name)
                    parts = [_shard(name, source, self.full_shape, r, comm.size) for r in range(comm.size)]
                comm.scatter(mine, parts, "transferring weights")


class _MirroredAccess:
    """A cache access on the leader, with how the followers rebuild it (``(method, arguments)``)."""

    def __init__(self, spec: Command, local: KVAccess) -> None:
        self.spec, self.local = spec, local

    def __call__(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.local(layer, keys, values)


class _LeaderCompact(ShardedCompactLM):
    """The leader's forward: announces each forward, weight transfer and layout change first."""

    def __init__(self, full: CompactCausalLM, model: torch.nn.Module, sender: CommandSender,
                 max_positions: int) -> None:
        super().__init__(full, model, sender.comm, max_positions)
        self.full = full
        self.sender = sender

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_access: KVAccess, key_length: int,
                with_logits: bool = True, all_hidden: bool = False) -> torch.Tensor | None:
        if not isinstance(kv_access, _MirroredAccess):
            raise TypeError("a tensor-parallel forward needs a cache access from the replica's mirrored cache")
        with self.sender.lock:
            self.sender.send(("forward", (kv_access.spec, input_ids, positions, key_length)))
            with self._in_step("forward"):
                return super().forward(input_ids, positions, kv_access, key_length, with_logits, all_hidden)

    @contextlib.contextmanager
    def _in_step(self, what: str) -> Iterator[None]:
        """A failure here, after the followers were told to start, leaves them waiting in a
        collective the leader will never join: the replica is out of step for good."""
        try:
            yield
        except TensorParallelError:
            raise
        except Exception as exc:
            self.comm.broken = TensorParallelError(
                f"tensor-parallel replica: the leader's {what} failed after the followers started it, so they "
                f"are out of step; rebuild the replica: {type(exc).__name__}: {exc}"
            )
            raise

    def set_weight_layout(self, layout: str, batch_hint: int = 1) -> None:
        super().set_weight_layout(layout, batch_hint)
        self.sender.post(("set_weight_layout", (self.weight_layout, batch_hint)))

    def repack(self) -> None:
        """After the full weights changed (an update, or the engine's start): send every rank its shards."""
        with self.sender.lock:
            self.sender.send(("weights", ()))
            with self._in_step("weight transfer"), torch.no_grad():
                self.transfer_weights(self.full)
        super().repack()


class _MirroredCache(SlotKVCache):
    """The leader's KV cache: each change runs here first, then is queued for the followers."""

    def __init__(self, sender: CommandSender, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sender = sender
        self._depth = 0  # > 0 inside a mirrored method: the calls it makes itself are not mirrored again
        sender.post(("cache_init", ({k: v for k, v in kwargs.items() if k != "device"},)))

    def _mirror(self, name: str, args: tuple[Any, ...], run: Any, flush: bool = False) -> Any:
        if self._depth:
            return run()
        self._depth += 1
        try:
            result = run()
        finally:
            self._depth -= 1
        self._sender.post(("cache", (name, args, result)), flush=flush)
        return result

    def ensure_capacity(self, length: int, live_rows: int) -> bool:
        generation = self.generation
        result = super().ensure_capacity(length, live_rows)
        if self.generation != generation:  # most steps change nothing: nothing to send
            self._sender.post(("cache", ("ensure_capacity", (length, live_rows), result)))
        return result

    def release(self) -> None:
        # Flushed: sleep() must free the followers' memory now. On a broken replica this is the
        # engine cleaning up after the failure: release locally, nobody is left to mirror to.
        if self._sender.comm.broken is not None:
            super().release()
            return
        self._mirror("release", (), super().release, flush=True)

    def rebuild(self) -> None:
        self._mirror("rebuild", (), super().rebuild, flush=True)

    def move_rows(self, destinations: list[int], sources: list[int], length: int) -> None:
        # Lists are copied: the command is pickled when it is sent, after the caller may reuse them.
        self._mirror("move_rows", (list(destinations), list(sources), length),
                     lambda: super(_MirroredCache, self).move_rows(destinations, sources, length))

    def copy_prompts(self, decode_rows: list[int], prompt_slots: list[int], length: int) -> None:
        self._mirror("copy_prompts", (list(decode_rows), list(prompt_slots), length),
                     lambda: super(_MirroredCache, self).copy_prompts(decode_rows, prompt_slots, length))

    def zero_rows(self, rows: list[int]) -> None:
        self._mirror("zero_rows", (list(rows),), lambda: super(_MirroredCache, self).zero_rows(rows))

    def zero_prompt_slots(self, slots: list[int]) -> None:
        self._mirror("zero_prompt_slots", (list(slots),), lambda: super(_MirroredCache, self).zero_prompt_slots(slots))

    def decode_access(self, batch_size: int, positions: torch.Tensor, key_length: int) -> KVAccess:
        local = super().decode_access(batch_size, positions, key_length)
        return _MirroredAccess(("decode_access", (batch_size, positions, key_length)), local)

    def prefill_access(self, prompt_slots: list[int], flat_index: torch.Tensor, flat_slots: torch.Tensor,
                       flat_positions: torch.Tensor, key_length: int) -> KVAccess:
        local = super().prefill_access(prompt_slots, flat_index, flat_slots, flat_positions, key_length)
        spec = ("prefill_access", (list(prompt_slots), flat_index, flat_slots, flat_positions, key_length))
        return _MirroredAccess(spec, local)


# ---------------------------------------------------------------------- the two roles


class TensorParallelLeader:
    """TP rank 0: ``engine`` is a NativeEngine like any other; ``close()`` stops the followers."""

    def __init__(self, engine: NativeEngine, sender: CommandSender | None, size: int) -> None:
        self.engine, self._sender, self.size = engine, sender, size
        self.rank = 0

    def close(self) -> None:
        """Send ``stop`` (the followers return from ``follow``). Idempotent; a broken replica sends nothing."""
        if self._sender is not None:
            sender, self._sender = self._sender, None
            sender.close()

    def __enter__(self) -> TensorParallelLeader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorParallelFollower:
    """TP rank > 0: ``follow()`` runs the leader's commands on this rank's shard until ``stop``."""

    def __init__(self, compact: ShardedCompactLM, comm: GroupComm, device: torch.device) -> None:
        self.compact, self.comm, self.device = compact, comm, device
        self.rank, self.size = comm.rank, comm.size
        self.cache: SlotKVCache | None = None
        self.commands = 0  # commands run so far (tests, progress)

    def follow(self) -> None:
        """Block running commands until the leader's ``stop``.

        Raises ``TensorParallelError`` when the leader is gone (no command, not even a keep-alive,
        within the group's timeout) or when a command fails here: this rank has then diverged from
        the leader and must not go on.
        """
        me = self.comm.peers[self.rank].describe()
        while True:
            for op, args in receive_commands(self.comm, self.device):
                if op == "stop":
                    return
                try:
                    self._run(op, args)
                except TensorParallelError:
                    raise
                except Exception as exc:
                    raise TensorParallelError(
                        f"{me}: command {op!r} failed here but not on the leader, so this rank has diverged "
                        f"and stops: {type(exc).__name__}: {exc}"
                    ) from exc
                self.commands += 1

    def _run(self, op: str, args: tuple[Any, ...]) -> None:
        if op == "noop":
            return
        if op == "forward":
            (method, access_args), input_ids, positions, key_length = args
            with torch.inference_mode():
                access = getattr(self._cache(), method)(*access_args)
                self.compact.forward(input_ids, positions, access, key_length, with_logits=False)
        elif op == "cache":
            name, call_args, expected = args
            result = getattr(self._cache(), name)(*call_args)
            if result != expected:
                raise RuntimeError(f"SlotKVCache.{name}{call_args} returned {result!r}, the leader's {expected!r}")
            if name == "release" and self.device.type == "cuda":
                torch.cuda.empty_cache()
        elif op == "cache_init":
            (kwargs,) = args
            self.cache = SlotKVCache(**kwargs, device=self.device)
        elif op == "weights":
            with torch.no_grad():
                self.compact.transfer_weights(None)
            self.compact.repack()
        elif op == "set_weight_layout":
            self.compact.set_weight_layout(*args)
        else:
            raise ValueError(f"unknown tensor-parallel command {op!r}")

    def _cache(self) -> SlotKVCache:
        if self.cache is None:
            raise RuntimeError("the leader sent a cache command before creating its cache")
        return self.cache


def build_tp_engine(
    model: torch.nn.Module,
    group: dist.ProcessGroup,
    *,
    timeout_s: float = DEFAULT_TP_TIMEOUT_S,
    **engine_kwargs: Any,
) -> TensorParallelLeader | TensorParallelFollower:
    """Build this rank's part of a tensor-parallel native engine replica over ``group``.

    Collective: every rank of ``group`` calls it with a model of the same architecture and the same
    ``engine_kwargs`` (NativeEngine's keyword arguments; ``device`` may differ per rank: ``cpu``
    with gloo, this rank's ``cuda`` device with NCCL). TP rank 0 gets a ``TensorParallelLeader``,
    whose ``engine`` serves requests; the others get a ``TensorParallelFollower`` and must call its
    ``follow()`` next (the leader's engine construction already sends it commands). The ranks'
    models, ``dtype`` and ``max_model_len`` must agree (checked); the leader's weights and cache
    settings are the replica's; ``kv_cache_memory_bytes`` unset is the smallest default budget
    over the ranks. ``timeout_s`` must be the group's timeout
    (``new_tp_group``): it sets the leader's keep-alive period and the error messages.

    Raises ``ValueError`` when the heads or MLP do not split over ``group``'s size or the ranks'
    models differ, and ``NotImplementedError`` for decode modes other than eager.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    check_tensor_parallel_shape(model.config, size)
    decode_mode = engine_kwargs.pop("decode_mode", None)
    if decode_mode not in (None, "eager"):
        raise NotImplementedError(f"a tensor-parallel engine decodes eagerly; decode_mode={decode_mode!r} is not supported")
    if size == 1:
        return TensorParallelLeader(NativeEngine(model=model, decode_mode="eager", **engine_kwargs), None, 1)
    if engine_kwargs.get("enable_prefix_caching", True):
        logger.info("tensor-parallel replica: the prefix cache is off (not built for split KV caches)")
    engine_kwargs["enable_prefix_caching"] = False
    _check_classified(SlotKVCache, _CACHE_MIRRORED, _CACHE_ACCESS, _CACHE_READ_ONLY, _CACHE_PREFIX_ONLY)
    _check_classified(CompactCausalLM, _COMPACT_MIRRORED, _COMPACT_READ_ONLY)
    device = torch.device(engine_kwargs.get("device", "cpu"))
    backend = dist.get_backend(group)
    if (backend == "nccl") != (device.type == "cuda"):
        raise ValueError(f"a tensor-parallel replica over {backend} needs its ranks' tensors on "
                         f"{'cuda' if backend == 'nccl' else 'cpu'}, got device {device}")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # object collectives and NCCL use the current device
    dtype = resolve_dtype(engine_kwargs.get("dtype", torch.float32))
    max_model_len = engine_kwargs.get("max_model_len") or int(model.config.max_position_embeddings)
    budget = engine_kwargs.get("kv_cache_memory_bytes") or default_kv_cache_bytes(device)
    me = {
        "peer": Peer(rank, dist.get_rank(), socket.gethostname(), os.getpid()),
        "model": _model_signature(model),
        "engine": {"dtype": str(dtype), "max_model_len": max_model_len},
        "budget": budget,
    }
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, me, group=group)
    for other in gathered[1:]:
        for key in ("model", "engine"):
            if other[key] != gathered[0][key]:
                diff = {k: (gathered[0][key].get(k), v) for k, v in other[key].items() if gathered[0][key].get(k) != v}
                raise ValueError(
                    f"tensor-parallel replica: {other['peer'].describe()} was built with a different {key} than "
                    f"TP rank 0 (rank 0's value, then its): {diff}"
                )
    peers = [g["peer"] for g in gathered]
    comm = GroupComm(group, device, peers, timeout_s)
    if rank > 0:
        _prepare_model(model, device, dtype)
        full = CompactCausalLM.from_hf(model, max_positions=max_model_len)
        compact = ShardedCompactLM(full, model, comm, max_model_len)
        _release_projections(model)
        return TensorParallelFollower(compact, comm, device)
    sender = CommandSender(comm)

    def compact_factory(hf_model: torch.nn.Module, positions: int) -> CompactCausalLM:
        return _LeaderCompact(CompactCausalLM.from_hf(hf_model, positions), hf_model, sender, positions)

    def cache_factory(**kwargs: Any) -> SlotKVCache:
        return _MirroredCache(sender, **kwargs)

    engine_kwargs["kv_cache_memory_bytes"] = min(g["budget"] for g in gathered)
    engine_kwargs["max_model_len"] = max_model_len
    try:
        engine = NativeEngine(model=model, decode_mode="eager", compact_factory=compact_factory,
                              cache_factory=cache_factory, **engine_kwargs)
        sender.post(("noop", ()), flush=True)  # the cache's creation reaches the followers now
    except BaseException:
        sender.close()
        raise
    return TensorParallelLeader(engine, sender, size)


def _model_signature(model: torch.nn.Module) -> dict[str, Any]:
    """What must agree between the ranks' models: architecture, shapes and rotary frequencies."""
    config = model.config
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings")
    signature: dict[str, Any] = {k: getattr(config, k, None) for k in keys}
    signature["shapes"] = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    signature["inv_freq"] = {name: buffer.double().cpu().tolist() for name, buffer in
                             model.model.rotary_emb.named_buffers() if name.endswith("inv_freq")}
    return signature


def _release_projections(model: torch.nn.Module) -> None:
    """Free a follower model's full projection weights: its shards are copies. The embedding, the
    norms, the LM head and the o/down biases (replicated) stay: the sharded forward uses them."""
    family = FAMILIES[model.config.model_type]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        split = [getattr(attn, name) for name in family.qkv] + [getattr(mlp, name) for name in family.gate_up]
        for module in (*split, attn.o_proj, mlp.down_proj):
            module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
        for module in split:
            if module.bias is not None:
                module.bias.data = torch.empty(0, dtype=module.bias.dtype, device=module.bias.device)


def tp_rank_layout(world_size: int, tp: int) -> list[list[int]]:
    """The replicas' global ranks: consecutive groups of ``tp`` (what ``new_tp_group`` builds)."""
    if tp < 1 or world_size % tp:
        raise ValueError(f"tensor_model_parallel_size={tp} must be >= 1 and divide the rollout world size {world_size}")
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


__all__: Sequence[str] = (
    "DEFAULT_TP_TIMEOUT_S",
    "ShardedCompactLM",
    "TensorParallelError",
    "TensorParallelFollower",
    "TensorParallelLeader",
    "build_tp_engine",
    "check_tensor_parallel_shape",
    "new_tp_group",
    "tp_rank_layout",
)

"""Sharded checkpoints: every rank writes its own shards of the model and the optimizer with
``torch.distributed.checkpoint`` (DCP); nothing is gathered to rank 0.

Layout of an engine's folder (``TrainEngine.save(..., sharded=True)``)::

    model/          config.json (+ generation config, tokenizer): the HF files without weights
    dcp/.metadata   DCP's index of every tensor chunk (shapes, which file, byte offsets)
    dcp/__<r>_0.distcp  rank r's chunks: "model.<name>" and "optim.<name>.<moment>"
    optim.json      the optimizer's hyperparameters (param groups by name) and the LR schedule
    rng/rank_<r>.safetensors  rank r's torch RNG states (CPU, and CUDA where used)

A checkpoint loads on any number of ranks: DCP reads each rank's part of every tensor from
whichever chunks overlap it (``load_dcp``), and ``read_model_tensors`` reads whole tensors
with no process group at all (export). Every value in ``dcp/`` is a tensor, so DCP never
unpickles a value (its byte items go through ``torch.load(weights_only=False)``, refused here).

``.metadata`` itself is a pickle. It is read with ``SafeUnpickler``, which builds only DCP's own
metadata records and a few torch value types (``torch.Size``, dtypes, layouts), so a planted
``.metadata`` cannot run code; it is also listed with its SHA-256 in the checkpoint manifest,
which the controller checks before anything is loaded. Every chunk must sit in a plain file of
``dcp/`` and every entry must be a tensor, or the checkpoint is refused naming the file.

RNG: each rank restores the state it saved when the world size is unchanged (bitwise resume).
On a different world size, rank r < the saved world size restores rank r's state and new ranks
keep their own (seeded) state; the generators the trainer relies on for shuffling are seeded
from the schedule's step, so only dropout-like randomness differs from an unchanged-size resume.
"""

from __future__ import annotations

import json
import math
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.training import distributed
from hybridflow.utils.errors import CheckpointError, one_line

DCP_DIR = "dcp"
METADATA_FILE = ".metadata"
OPTIM_JSON = "optim.json"
RNG_DIR = "rng"
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
FORMAT_VERSION = 1

# What a DCP ``.metadata`` pickle may build: DCP's own records and the torch values inside them.
# Anything else (os.system, builtins.eval, ...) is refused before it is called.
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
                 "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name (torch.strided): a dict lookup
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class SafeUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: every global outside ``_SAFE_GLOBALS`` (and torch dtypes) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")


def is_sharded_checkpoint(ckpt_dir: Path) -> bool:
    """Whether ``ckpt_dir`` holds a sharded engine checkpoint (else the full format)."""
    return (ckpt_dir / DCP_DIR / METADATA_FILE).is_file()


# ------------------------------------------------------------------------------------------ writing
def model_entries(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.<name>``: the model's own tensors (this rank's shards as DTensors), no copies."""
    return {MODEL_PREFIX + name: value for name, value in model.state_dict().items()}


def optimizer_entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``optim.<name>.<moment>``: the optimizer's state tensors by parameter name (this rank's
    shards), no copies."""
    names = {p: n for n, p in model.named_parameters()}
    return {
        f"{OPTIM_PREFIX}{names[p]}.{key}": value
        for p, state in optimizer.state.items()
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def optim_json(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> str:
    """Param groups (parameters by name, the hyperparameters as JSON) and the schedule."""
    names = {p: n for n, p in model.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
              for g in optimizer.param_groups]
    return json.dumps({"version": FORMAT_VERSION, "param_groups": groups, "scheduler": scheduler.state_dict()},
                      indent=1, default=_json_value)


def _json_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to {OPTIM_JSON}")


def save_dcp(entries: dict[str, torch.Tensor], dcp_dir: Path, *, no_dist: bool) -> None:
    """Each rank writes its own chunks of ``entries`` (one file per rank) and rank 0 the
    metadata: a collective unless ``no_dist``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    # sync_files=False: the checkpoint manager fsyncs the whole folder before publishing it.
    writer = FileSystemWriter(dcp_dir, single_file_per_rank=True, sync_files=False, thread_count=1)
    with _single_process_is_intended(no_dist):
        dcp.save(entries, storage_writer=writer, no_dist=no_dist)


@contextmanager
def _single_process_is_intended(no_dist: bool) -> Iterator[None]:
    """DCP warns on every single-process call that it assumes one process: here that is the plan."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_rng(rng_dir: Path, rank: int, device: torch.device) -> None:
    from safetensors.torch import save_file

    rng_dir.mkdir(parents=True, exist_ok=True)
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    save_file(states, rng_dir / f"rank_{rank}.safetensors")


# ------------------------------------------------------------------------------------------ reading
def read_metadata(dcp_dir: Path):
    """DCP's ``Metadata`` of ``dcp_dir``, read safely and checked: only tensors, each chunk in a
    plain file of ``dcp_dir``. ``CheckpointError`` naming the file otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = dcp_dir / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        with open(path, "rb") as fh:
            metadata = SafeUnpickler(fh).load()
    except Exception as exc:
        raise CheckpointError(f"{path}: refused to read checkpoint metadata: {one_line(exc)}") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path} is not DCP checkpoint metadata")
    not_tensors = [k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
    if not_tensors:
        # A byte entry would be read with torch.load(weights_only=False): never accepted.
        raise CheckpointError(f"{path} lists entries that are not tensors: {', '.join(map(str, not_tensors[:3]))}")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        plain = isinstance(name, str) and name == Path(name).name and name not in (".", "..")
        if not plain or not (dcp_dir / name).is_file():
            raise CheckpointError(f"{path} names a chunk file {name!r} that is not a file in {dcp_dir}")
    return metadata


def tensor_shapes(metadata, prefix: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name without ``prefix``: (full shape, dtype)} of the entries under ``prefix``."""
    return {
        key[len(prefix):]: (tuple(md.size), md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items() if key.startswith(prefix)
    }


def read_optim_json(path: Path) -> dict[str, Any]:
    """``optim.json``: param groups (parameters by name) and the schedule's state."""
    try:
        state = json.loads(path.read_text())
        if state.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {state.get('version')!r}, this hybridflow reads {FORMAT_VERSION}")
        if not isinstance(state.get("param_groups"), list) or not isinstance(state.get("scheduler"), dict):
            raise ValueError("expected 'param_groups' and 'scheduler'")
        if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in state["param_groups"]):
            raise ValueError("every param group needs its 'params' by name")
        if not isinstance(state["scheduler"].get("last_epoch"), int):
            raise ValueError("the schedule state lacks an integer last_epoch")
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint holds no optimizer state") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{path} is corrupt: {one_line(exc)}") from exc
    return state


@dataclass
class ShardedCheckpoint:
    """A sharded checkpoint read and checked against an engine, not yet applied."""

    path: Path
    metadata: Any  # DCP Metadata
    optim: dict[str, Any] | None  # optim.json; None without an optimizer


def check_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, metadata, optim: dict[str, Any],
                    ckpt_dir: Path) -> None:
    """``optim.json``'s groups name this optimizer's parameters, group by group, and every saved
    moment has its parameter's shape (or is a scalar, like Adam's step)."""
    path = ckpt_dir / OPTIM_JSON
    names = distributed.optimizer_param_names(model, optimizer)
    saved = [g["params"] for g in optim["param_groups"]]
    if saved != names:
        raise CheckpointError(f"{path} does not match this model's optimizer: its param groups name other parameters "
                              f"({sum(map(len, saved))} in {len(saved)} group(s), the model has "
                              f"{sum(map(len, names))} in {len(names)})")
    params, metadata_path = dict(model.named_parameters()), ckpt_dir / DCP_DIR / METADATA_FILE
    for key, (shape, _) in tensor_shapes(metadata, OPTIM_PREFIX).items():
        name = key.rpartition(".")[0]
        if name not in params:
            raise CheckpointError(f"{metadata_path} holds optimizer state for unknown parameter {name!r}")
        if shape and shape != tuple(params[name].shape):
            raise CheckpointError(f"{metadata_path}: optimizer state {key} has shape {shape}, the "
                                  f"parameter {tuple(params[name].shape)}")


def load_dcp(state: dict[str, torch.Tensor], dcp_dir: Path, *, no_dist: bool) -> None:
    """Fill ``state`` (empty tensors, DTensors for this rank's shards) from ``dcp_dir``: a
    collective unless ``no_dist``. Every key must be in the checkpoint. The reader unpickles
    ``.metadata`` with ``SafeUnpickler`` (and checks it), the planner refuses byte items."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = read_metadata(dcp_dir)
            metadata.storage_meta = metadata.storage_meta or _storage_meta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    planner = DefaultLoadPlanner(allow_partial_load=False)
    planner.load_bytes = _refuse_read_bytes  # type: ignore[method-assign]
    with _single_process_is_intended(no_dist):
        dcp.load(state, storage_reader=Reader(dcp_dir), planner=planner, no_dist=no_dist)


def _refuse_read_bytes(*_: Any) -> None:
    raise CheckpointError("the checkpoint holds a pickled value; only tensors are read")


def _storage_meta():
    from torch.distributed.checkpoint.metadata import StorageMeta

    return StorageMeta()


def optimizer_buffers(model: torch.nn.Module, optimizer: torch.optim.Optimizer, metadata) -> dict[str, torch.Tensor]:
    """Empty tensors to read the saved optimizer state into: a moment shaped and sharded like its
    parameter (a DTensor stays one), a scalar (Adam's step) as a plain tensor."""
    params = dict(model.named_parameters())
    buffers = {}
    for key, (shape, dtype) in tensor_shapes(metadata, OPTIM_PREFIX).items():
        param = params[key.rpartition(".")[0]]
        buffers[OPTIM_PREFIX + key] = torch.empty_like(param, dtype=dtype) if shape else torch.empty((), dtype=dtype)
    return buffers


def optimizer_state(
    optimizer: torch.optim.Optimizer, buffers: dict[str, torch.Tensor], optim: dict[str, Any]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` layout from the read buffers and ``optim.json``'s groups.
    A JSON list stands for a tuple where the optimizer has one (Adam's betas)."""
    ids = {name: i for i, name in enumerate(n for g in optim["param_groups"] for n in g["params"])}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in buffers.items():
        name, _, moment = key[len(OPTIM_PREFIX):].rpartition(".")
        state.setdefault(ids[name], {})[moment] = value
    groups = []
    for own, saved in zip(optimizer.param_groups, optim["param_groups"], strict=True):
        group = {k: tuple(v) if isinstance(own.get(k), tuple) and isinstance(v, list) else v for k, v in saved.items()}
        groups.append(group | {"params": [ids[n] for n in saved["params"]]})
    return {"state": state, "param_groups": groups}


def load_rng(rng_dir: Path, rank: int, device: torch.device) -> bool:
    """Restore rank ``rank``'s RNG states; False when the checkpoint has none for this rank
    (it was saved on fewer ranks: this rank keeps its own)."""
    from safetensors.torch import load_file

    path = rng_dir / f"rank_{rank}.safetensors"
    if not path.is_file():
        return False
    try:
        states = load_file(path)
        torch.set_rng_state(states["cpu"])
        if device.type == "cuda" and "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"], device)
    except Exception as exc:
        raise CheckpointError(f"{path} is not a readable RNG state: {one_line(exc)}") from exc
    return True


# ------------------------------------------------------------------------------------------- export
def read_model_tensors(dcp_dir: Path, names: list[str], metadata) -> dict[str, torch.Tensor]:
    """Whole tensors ``names`` (model names) from a sharded checkpoint, in this process only:
    what an export reads a few layers at a time."""
    shapes = tensor_shapes(metadata, MODEL_PREFIX)
    state = {MODEL_PREFIX + n: torch.empty(shapes[n][0], dtype=shapes[n][1]) for n in names}
    load_dcp(state, dcp_dir, no_dist=True)
    return {n: state[MODEL_PREFIX + n] for n in names}


def write_hf_weights(
    engine_dir: Path, out_dir: Path, *, max_shard_bytes: int, skip: frozenset[str] = frozenset()
) -> list[str]:
    """The model's weights from the shards under ``engine_dir`` as HF safetensors in ``out_dir``,
    a file at a time: each file's tensors are read (whole), written and dropped before the next,
    so memory holds about ``max_shard_bytes`` (or one larger tensor), never the whole model.
    One file is ``model.safetensors``; more get ``model.safetensors.index.json``. ``skip``: names
    left out (a tied output embedding). Returns the files written. No process group needed."""
    from safetensors.torch import save_file

    dcp_dir = engine_dir / DCP_DIR
    metadata = read_metadata(dcp_dir)
    shapes = {n: s for n, s in tensor_shapes(metadata, MODEL_PREFIX).items() if n not in skip}
    groups = _byte_groups(shapes, max_shard_bytes)
    files = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for names, file in zip(groups, files, strict=True):
        save_file(read_model_tensors(dcp_dir, names, metadata), out_dir / file, metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(*shape) for shape in shapes.values())},
                 "weight_map": {n: file for names, file in zip(groups, files, strict=True) for n in names}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return files


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _byte_groups(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], max_bytes: int) -> list[list[str]]:
    """Names in checkpoint order (layer by layer), cut into runs of at most ``max_bytes``."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = _nbytes(*shape)
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups

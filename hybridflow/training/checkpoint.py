"""The training engine's checkpoints: written whole or in shards, read and checked against the
engine before anything changes, then applied.

Two formats (``trainer.checkpoint_format``). Full: HF safetensors of the full model under
``model/`` and ``optim.pt`` with the optimizer (single-process layout) and schedule; several
ranks gather to rank 0, which writes. Sharded (``hybridflow.training.sharded_checkpoint``): every
rank writes its own shards of the model and the optimizer, nothing gathered. Either loads on any
number of ranks. A trainable-only checkpoint (a LoRA actor's adapters) holds only the parameters
that require grad; the full format writes them to ``model/trainable.safetensors``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.training import distributed, sharded_checkpoint
from hybridflow.training.sharded_checkpoint import ShardedCheckpoint
from hybridflow.utils.errors import CheckpointError, one_line

log = logging.getLogger(__name__)


class EngineCheckpoints:
    """Checkpoints of one engine's model, optimizer and schedule (``TrainEngine.save`` / ``load``).

    ``trainable_names`` and ``architecture`` are read from the model before it is sharded: FSDP2
    keeps the parameter names but renames the class (FSDPQwen2ForCausalLM), and exports keep the
    real name."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
        scheduler: torch.optim.lr_scheduler.LambdaLR | None, device: torch.device, *, data_parallel: bool,
        checkpoint_trainable_only: bool, trainable_names: frozenset[str], architecture: str,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.device = model, optimizer, scheduler, device
        self.data_parallel = data_parallel
        self.checkpoint_trainable_only = checkpoint_trainable_only
        self.trainable_names = trainable_names
        self.architecture = architecture

    def save_state(self, path: Path, extra: dict[str, Any]) -> None:
        """The model, optimizer and schedule with ``extra`` (plain values and tensors) in one file,
        replaced whole (a kill mid-write leaves the previous file). For a run's own scratch progress
        (the warm start's), not a checkpoint: no manifest, one rank, read back by ``load_state``."""
        assert self.optimizer is not None and self.scheduler is not None
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "extra": extra}
        partial = path.with_name(f".{path.name}.tmp")
        torch.save(state, partial)
        os.replace(partial, path)

    def load_state(self, path: Path) -> dict[str, Any]:
        """Put back what ``save_state`` wrote (tensors only: ``weights_only``, nothing unpickled runs)
        and return its ``extra``; any failure to read it raises."""
        assert self.optimizer is not None and self.scheduler is not None
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state["extra"]

    def save(self, out_dir: Path, tokenizer=None, *, sharded: bool = False) -> None:
        """Full format: HF safetensors of the full model under ``model/`` and ``optim.pt`` with the
        optimizer (single-process layout) and schedule; several ranks gather to rank 0, which
        writes. ``sharded``: every rank writes its own shards of the model and the optimizer,
        nothing gathered (``hybridflow.training.sharded_checkpoint``). Either way a collective
        when data-parallel, and ``load`` reads both on any number of ranks."""
        if sharded:
            self._save_sharded(out_dir, tokenizer)
            return
        if self.checkpoint_trainable_only:
            self._save_trainable(out_dir, tokenizer)
            return
        if self.data_parallel:
            self._save_gathered(out_dir, tokenizer)
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir / "model", safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir / "model")
        if self.optimizer is not None and self.scheduler is not None:
            torch.save(
                {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                out_dir / OPTIM_FILE,
            )

    def _save_sharded(self, out_dir: Path, tokenizer) -> None:
        rank = distributed.rank() if self.data_parallel else 0
        if rank == 0:
            self._save_model_files(out_dir / "model", tokenizer)
            if self.optimizer is not None and self.scheduler is not None:
                (out_dir / sharded_checkpoint.OPTIM_JSON).write_text(
                    sharded_checkpoint.optim_json(self.model, self.optimizer, self.scheduler)
                )
        entries = self._model_entries()
        if self.optimizer is not None:
            entries |= sharded_checkpoint.optimizer_entries(self.model, self.optimizer)
        sharded_checkpoint.save_dcp(entries, out_dir / sharded_checkpoint.DCP_DIR, no_dist=not self.data_parallel)
        sharded_checkpoint.save_rng(out_dir / sharded_checkpoint.RNG_DIR, rank, self.device)
        # Nobody reads the checkpoint (or renames its folder) before every rank has written.
        distributed.barrier()

    def _model_entries(self) -> dict[str, torch.Tensor]:
        """The model tensors a checkpoint holds (``sharded_checkpoint.model_entries``), only the
        trainable ones with ``checkpoint_trainable_only``."""
        entries = sharded_checkpoint.model_entries(self.model)
        if not self.checkpoint_trainable_only:
            return entries
        prefix = sharded_checkpoint.MODEL_PREFIX
        return {k: v for k, v in entries.items() if k.removeprefix(prefix) in self.trainable_names}

    def _save_trainable(self, out_dir: Path, tokenizer) -> None:
        """Full format, trainable parameters only: each gathered alone (a collective when sharded,
        small next to the model) and written by rank 0 with the optimizer state."""
        from safetensors.torch import save_file

        trainable = {name: distributed.gather_weight(value).detach().cpu().contiguous()
                     for name, value in self.model.state_dict().items() if name in self.trainable_names}
        optim_state = None
        if self.optimizer is not None and self.scheduler is not None:
            optim_state = (distributed.gather_optimizer_state(self.model, self.optimizer) if self.data_parallel
                           else self.optimizer.state_dict())
        if not self.data_parallel or distributed.is_rank_zero():
            out_dir.mkdir(parents=True, exist_ok=True)
            self._save_model_files(out_dir / "model", tokenizer)
            save_file(trainable, out_dir / "model" / TRAINABLE_FILE, metadata={"format": "pt"})
            if optim_state is not None:
                assert self.scheduler is not None
                torch.save({"optimizer": optim_state, "scheduler": self.scheduler.state_dict()}, out_dir / OPTIM_FILE)
        distributed.barrier()

    def _save_model_files(self, model_dir: Path, tokenizer) -> None:
        """The HF files of the model without its weights: config (the real class), generation
        config, tokenizer. An export adds the weights from the shards."""
        model_dir.mkdir(parents=True, exist_ok=True)
        self.model.config.save_pretrained(model_dir)
        _restore_architecture(model_dir, self.architecture)
        generation_config = getattr(self.model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(model_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(model_dir)

    def _save_gathered(self, out_dir: Path, tokenizer) -> None:
        weights = distributed.gather_model_state(self.model)
        optim_state = (
            distributed.gather_optimizer_state(self.model, self.optimizer) if self.optimizer is not None else {}
        )
        if distributed.is_rank_zero():
            out_dir.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(out_dir / "model", state_dict=weights, safe_serialization=True)
            _restore_architecture(out_dir / "model", self.architecture)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir / "model")
            if self.optimizer is not None and self.scheduler is not None:
                torch.save({"optimizer": optim_state, "scheduler": self.scheduler.state_dict()}, out_dir / OPTIM_FILE)
        # Nobody reads the checkpoint (or renames its folder) before rank 0 has finished writing.
        distributed.barrier()

    def read_checkpoint(self, ckpt_dir: Path) -> LoadedCheckpoint | ShardedCheckpoint:
        """Read ``ckpt_dir`` (either format) and check it against this engine, changing nothing:
        the name and shape of every weight and optimizer moment, and the schedule. Only the files
        ``save`` writes are read: the weight files that the safetensors index names (or
        ``model.safetensors``), never a glob; of a sharded checkpoint, its metadata and
        ``optim.json`` (the shards are read when applied). A refusal is a ``CheckpointError``
        naming the file. Sharded: no collective runs here, so every rank refuses alike."""
        if sharded_checkpoint.is_sharded_checkpoint(ckpt_dir):
            return self._read_sharded(ckpt_dir)
        trainable_file = ckpt_dir / "model" / TRAINABLE_FILE
        if self.checkpoint_trainable_only != trainable_file.is_file():
            saved, wanted = ("only trainable parameters", "the whole model") if trainable_file.is_file() else (
                "the whole model", "only trainable parameters")
            raise CheckpointError(f"{ckpt_dir / 'model'} holds {saved} but this engine loads {wanted}: a LoRA "
                                  f"checkpoint resumes with the actor.lora it was saved with")
        if self.checkpoint_trainable_only:
            weights = _read_weight_file(trainable_file, {})
        else:
            weights = _read_weights(ckpt_dir / "model")
        self._check_weights({k: tuple(v.shape) for k, v in weights.items()}, ckpt_dir / "model")
        optim_state = None
        if self.optimizer is not None and self.scheduler is not None:
            optim_state = _read_optimizer_file(ckpt_dir / OPTIM_FILE)
            self._check_optimizer_state(optim_state, ckpt_dir / OPTIM_FILE)
        return LoadedCheckpoint(ckpt_dir, weights, optim_state)

    def _read_sharded(self, ckpt_dir: Path) -> ShardedCheckpoint:
        dcp_dir = ckpt_dir / sharded_checkpoint.DCP_DIR
        metadata = sharded_checkpoint.read_metadata(dcp_dir)
        shapes = sharded_checkpoint.tensor_shapes(metadata, sharded_checkpoint.MODEL_PREFIX)
        self._check_weights({k: shape for k, (shape, _) in shapes.items()}, dcp_dir / sharded_checkpoint.METADATA_FILE)
        optim = None
        if self.optimizer is not None and self.scheduler is not None:
            optim = sharded_checkpoint.read_optim_json(ckpt_dir / sharded_checkpoint.OPTIM_JSON)
            sharded_checkpoint.check_optimizer(self.model, self.optimizer, metadata, optim, ckpt_dir)
        return ShardedCheckpoint(ckpt_dir, metadata, optim)

    def apply_checkpoint(self, loaded: LoadedCheckpoint | ShardedCheckpoint) -> None:
        """Put a checked checkpoint in place. Sharded: a collective (each rank keeps its shard)."""
        try:
            if isinstance(loaded, ShardedCheckpoint):
                self._apply_sharded(loaded)
            else:
                self._apply_full(loaded)
        except Exception as exc:
            raise CheckpointError(f"{loaded.path}: loading failed after its files were checked: {one_line(exc)}") from exc

    def _apply_full(self, loaded: LoadedCheckpoint) -> None:
        if self.data_parallel:
            distributed.load_model_state(self.model, loaded.weights)
        else:
            self.model.load_state_dict(loaded.weights, strict=False)
        if loaded.optim_state is not None:
            assert self.optimizer is not None and self.scheduler is not None
            if self.data_parallel:
                distributed.load_optimizer_state(self.model, self.optimizer, loaded.optim_state["optimizer"])
            else:
                self.optimizer.load_state_dict(loaded.optim_state["optimizer"])
            self._load_schedule(loaded.optim_state["scheduler"])

    def _apply_sharded(self, loaded: ShardedCheckpoint) -> None:
        """Every rank reads its part of every tensor into fresh buffers (one collective), so the
        engine changes only once the whole checkpoint has been read: a load holds one extra shard
        (this rank's model and optimizer) while it runs, never the whole model."""
        model_buffers = {k: torch.empty_like(v) for k, v in self._model_entries().items()}
        optim_buffers = {}
        if loaded.optim is not None:
            assert self.optimizer is not None
            optim_buffers = sharded_checkpoint.optimizer_buffers(self.model, self.optimizer, loaded.metadata)
        sharded_checkpoint.load_dcp(model_buffers | optim_buffers, loaded.path / sharded_checkpoint.DCP_DIR,
                                    no_dist=not self.data_parallel)
        with torch.no_grad():
            for key, value in self._model_entries().items():
                value.copy_(model_buffers[key])
        if loaded.optim is not None:
            assert self.optimizer is not None
            self.optimizer.load_state_dict(sharded_checkpoint.optimizer_state(self.optimizer, optim_buffers, loaded.optim))
            self._load_schedule(loaded.optim["scheduler"])
        rank = distributed.rank() if self.data_parallel else 0
        if not sharded_checkpoint.load_rng(loaded.path / sharded_checkpoint.RNG_DIR, rank, self.device):
            log.info("%s holds no RNG state for rank %d (saved on fewer ranks): it keeps its own", loaded.path, rank)

    def _load_schedule(self, saved: dict) -> None:
        assert self.scheduler is not None
        # Only the schedule's own keys: load_state_dict sets whatever it is given as attributes.
        own = self.scheduler.state_dict()
        self.scheduler.load_state_dict({k: saved[k] for k in own if k in saved})

    def _check_weights(self, shapes: dict[str, tuple[int, ...]], model_dir: Path) -> None:
        """Same names and shapes as the model (DTensor shapes are the full ones when sharded)."""
        expected = {name: tuple(t.shape) for name, t in self.model.state_dict().items()
                    if not self.checkpoint_trainable_only or name in self.trainable_names}
        # Tied embeddings are saved once; anything else missing is a real problem.
        missing = [k for k in expected if k not in shapes and not k.endswith("lm_head.weight")]
        unexpected = [k for k in shapes if k not in expected]
        wrong = [f"{k} {shape} (the model has {expected[k]})" for k, shape in shapes.items()
                 if k in expected and shape != expected[k]]
        if missing or unexpected or wrong:
            problems = [f"{label} {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
                        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if items]
            raise CheckpointError(f"the weights in {model_dir} do not match the model: {'; '.join(problems)}")

    def _check_optimizer_state(self, state: object, path: Path) -> None:
        """The single-process ``optimizer.state_dict()`` layout for this optimizer's parameters."""
        assert self.optimizer is not None and self.scheduler is not None

        def refuse(why: str) -> CheckpointError:
            return CheckpointError(f"{path} does not match this model's optimizer: {why}")

        if not isinstance(state, dict) or not isinstance(state.get("optimizer"), dict) or not isinstance(state.get("scheduler"), dict):
            raise refuse("expected a dict with 'optimizer' and 'scheduler' state")
        groups, moments = state["optimizer"].get("param_groups"), state["optimizer"].get("state")
        if not isinstance(groups, list) or not isinstance(moments, dict) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
        ):
            raise refuse("expected 'param_groups' (each with 'params') and 'state'")
        shapes = [[tuple(p.shape) for p in g["params"]] for g in self.optimizer.param_groups]
        if [len(g["params"]) for g in groups] != [len(s) for s in shapes]:
            raise refuse(f"parameters per group {[len(g['params']) for g in groups]}, the model has {[len(s) for s in shapes]}")
        shape_of = {pid: shape for g, group_shapes in zip(groups, shapes, strict=True)
                    for pid, shape in zip(g["params"], group_shapes, strict=True)}
        for pid, entry in moments.items():
            if pid not in shape_of or not isinstance(entry, dict):
                raise refuse(f"state for unknown parameter {pid!r}")
            for key, value in entry.items():
                # Adam's moments have the parameter's shape; its step count is a scalar.
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shape_of[pid]:
                    raise refuse(f"{key} of parameter {pid} has shape {tuple(value.shape)}, the parameter {shape_of[pid]}")
        missing = [k for k in ("last_epoch", "base_lrs") if k not in state["scheduler"]]
        if missing or not isinstance(state["scheduler"].get("last_epoch"), int):
            raise refuse(f"the schedule state lacks an integer last_epoch and base_lrs (missing {missing})")


OPTIM_FILE = "optim.pt"
TRAINABLE_FILE = "trainable.safetensors"  # a trainable-only checkpoint's weights (full format)
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass
class LoadedCheckpoint:
    """A checkpoint read and checked by ``EngineCheckpoints.read_checkpoint``, not yet applied."""

    path: Path
    weights: dict[str, torch.Tensor]
    optim_state: dict | None  # {"optimizer": ..., "scheduler": ...}; None without an optimizer


def _weight_files(model_dir: Path) -> list[Path]:
    """The files ``save_pretrained`` wrote: the shards its index names, or its one file."""
    index = model_dir / SAFETENSORS_INDEX
    if not index.is_file():
        return [model_dir / "model.safetensors"]
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        # A shard is a plain file name next to the index, never a path elsewhere.
        if not names or not all(isinstance(n, str) and n == Path(n).name and n not in (".", "..") for n in names):
            raise ValueError("weight_map must name files in its own folder")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{index} is corrupt: {one_line(exc)}") from exc
    return [model_dir / n for n in names]


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        weights.update(_read_weight_file(path, weights))
    return weights


def _read_weight_file(path: Path, earlier: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors, refused if it repeats a name of ``earlier`` shards."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        tensors = load_file(path)
    except Exception as exc:  # safetensors raises its own error type for a bad header
        raise CheckpointError(f"{path} is not a readable safetensors file: {one_line(exc)}") from exc
    repeated = sorted(set(tensors) & set(earlier))
    if repeated:
        raise CheckpointError(f"{path} repeats weights of another shard: {', '.join(repeated[:3])}")
    return tensors


def _read_optimizer_file(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint holds no optimizer state")
    try:
        # weights_only: tensors and plain containers only; a pickle that would build other
        # objects (and so could run code) is refused before anything in it executes.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: refused to load optimizer state: {one_line(exc)}") from exc


def _restore_architecture(model_dir: Path, architecture: str) -> None:
    """config.json names the class a loader should build: the model's own, not FSDP's wrapper."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = [architecture]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

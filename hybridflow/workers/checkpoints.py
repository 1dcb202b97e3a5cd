"""A training role's checkpoints: which format it saves (``trainer.checkpoint_format``) and how
its ranks load one together, refusing it on every rank at once."""

from __future__ import annotations

from pathlib import Path

from hybridflow.training import distributed
from hybridflow.training.engine import TrainEngine
from hybridflow.utils.errors import CheckpointError


def sharded_checkpoints(checkpoint_format: str, world_size: int) -> bool:
    """Whether a role saves sharded checkpoints (``trainer.checkpoint_format``): ``auto`` shards
    with more than one rank, where gathering the whole model on rank 0 is what a save would cost."""
    if checkpoint_format not in ("auto", "sharded", "full"):
        raise ValueError(f"trainer.checkpoint_format={checkpoint_format!r}: expected auto, sharded or full")
    return checkpoint_format == "sharded" or (checkpoint_format == "auto" and world_size > 1)


def load_engine_checkpoint(engine: TrainEngine, ckpt_dir: Path, role: str) -> str | None:
    """Load what ``engine.save`` wrote in ``ckpt_dir``: None when it is in place, else why it was
    refused (one line naming the file), with nothing changed.

    The refusal is returned, not raised: a raising rank makes a multi-rank Ray group tear itself
    down, and the controller must be able to try an older checkpoint on the same workers. Every
    rank checks the same files, then the ranks agree before the collective that applies them:
    one rank refusing alone would leave the others waiting in it."""
    try:
        loaded, refusal = engine.read_checkpoint(ckpt_dir), None
    except CheckpointError as exc:
        loaded, refusal = None, str(exc)
    if distributed.all_reduce_max(int(refusal is not None)):
        return refusal or f"{ckpt_dir}: another {role} rank refused this checkpoint"
    assert loaded is not None
    engine.apply_checkpoint(loaded)
    return None

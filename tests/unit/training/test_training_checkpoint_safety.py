"""Loading a checkpoint never runs code planted in it, and names the file it refused."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from hybridflow.models.loading import load_causal_lm
from hybridflow.models.tiny import write_tiny_model
from hybridflow.training.engine import OptimSpec, TrainEngine


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path) -> None:
    model_dir = write_tiny_model(tmp_path / "model")
    engine = TrainEngine(load_causal_lm(str(model_dir)), OptimSpec(lr=1e-3), torch.device("cpu"))
    engine.save(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / "optim.pt").write_bytes(pickle.dumps({"optimizer": _Payload(str(marker))}))
    with pytest.raises(RuntimeError, match="optim.pt: refused to load optimizer state"):
        engine.load(tmp_path / "ckpt")
    assert not marker.exists()


def test_a_truncated_optimizer_file_is_named(tmp_path) -> None:
    model_dir = write_tiny_model(tmp_path / "model")
    engine = TrainEngine(load_causal_lm(str(model_dir)), OptimSpec(lr=1e-3), torch.device("cpu"))
    engine.save(tmp_path / "ckpt")
    optim = tmp_path / "ckpt" / "optim.pt"
    optim.write_bytes(optim.read_bytes()[:100])
    with pytest.raises(RuntimeError, match="optim.pt: refused to load"):
        engine.load(tmp_path / "ckpt")

"""A checkpoint the engine refuses raises ``CheckpointError`` naming the file, and leaves the
engine exactly as it was (nothing half-loaded); only the files ``save`` writes are read."""

from __future__ import annotations

import json
import os
import pickle
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.utils.errors import CheckpointError
from hybridflow.workers.actor import ActorWorker

SPEC = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1)


def engine(seed: int) -> TrainEngine:
    return TrainEngine(build_tiny_model(SPEC, seed=seed), OptimSpec(lr=1e-2), torch.device("cpu"))


def state(e: TrainEngine) -> dict[str, torch.Tensor]:
    """Weights, Adam moments and the schedule's step: all that a load may change."""
    out = {f"w/{k}": v.detach().clone() for k, v in e.model.state_dict().items()}
    for i, s in enumerate(e.optimizer.state.values()):
        out |= {f"opt/{i}/{k}": v.clone() for k, v in s.items()}
    out["sched"] = torch.tensor(e.scheduler.last_epoch)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def step(e: TrainEngine) -> None:
    sum(p.square().sum() for p in e.model.parameters()).backward()
    e.optimizer.step()
    e.scheduler.step()
    e.optimizer.zero_grad()


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of a trained engine (seed 1, one step) and a different engine (seed 2, one
    step of its own) that will try to load it."""
    source = engine(1)
    step(source)
    source.save(tmp_path / "ckpt")
    target = engine(2)
    step(target)
    return source, target, tmp_path / "ckpt"


def test_a_good_checkpoint_loads_everything(saved):
    source, target, ckpt = saved
    target.load(ckpt)
    assert same(state(target), state(source))


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_refused_optimizer_file_leaves_the_weights_untouched(saved, tmp_path):
    _, target, ckpt = saved
    before = state(target)
    marker = tmp_path / "pwned"
    (ckpt / "optim.pt").write_bytes(pickle.dumps({"optimizer": _Payload(str(marker))}))
    with pytest.raises(CheckpointError) as info:
        target.load(ckpt)
    assert str(info.value).startswith(f"{ckpt / 'optim.pt'}: refused to load optimizer state: ")
    assert "\n" not in str(info.value)
    assert not marker.exists()
    assert same(state(target), before), "the weights were loaded before the optimizer file was refused"


def test_a_bad_safetensors_header_is_named(saved):
    _, target, ckpt = saved
    before = state(target)
    weights = ckpt / "model" / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a readable safetensors file"):
        target.load(ckpt)
    assert same(state(target), before)


@pytest.mark.parametrize("damage", ["missing", "shape", "unexpected"])
def test_weights_that_do_not_fit_the_model_are_refused_before_any_is_loaded(saved, damage):
    _, target, ckpt = saved
    before = state(target)
    path = ckpt / "model" / "model.safetensors"
    weights = load_file(path)
    name = sorted(weights)[-1]
    if damage == "missing":
        del weights[name]
    elif damage == "shape":
        weights[name] = torch.zeros(3, 3)
    else:
        weights["model.extra.weight"] = torch.zeros(2)
    save_file(weights, path, metadata={"format": "pt"})
    expected = {"missing": f"missing {name}", "shape": f"wrong shape {name} (3, 3)", "unexpected": "unexpected model.extra.weight"}
    with pytest.raises(CheckpointError) as info:
        target.load(ckpt)
    assert str(info.value).startswith(f"the weights in {ckpt / 'model'} do not match the model: ")
    assert expected[damage] in str(info.value)
    assert same(state(target), before)


def test_optimizer_state_that_does_not_fit_is_refused(saved):
    _, target, ckpt = saved
    before = state(target)
    optim = torch.load(ckpt / "optim.pt", weights_only=True)
    optim["optimizer"]["state"][0]["exp_avg"] = torch.zeros(7)
    torch.save(optim, ckpt / "optim.pt")
    with pytest.raises(CheckpointError, match=r"optim.pt does not match this model's optimizer: exp_avg of parameter 0"):
        target.load(ckpt)
    assert same(state(target), before)
    (ckpt / "optim.pt").unlink()
    with pytest.raises(CheckpointError, match=r"optim.pt is missing: the checkpoint holds no optimizer state"):
        target.load(ckpt)
    assert same(state(target), before)


def test_only_the_files_save_wrote_are_read(saved):
    source, target, ckpt = saved
    # A planted extra weight file would override the real one if the loader globbed.
    planted = {k: torch.full_like(v, 7.0) for k, v in load_file(ckpt / "model" / "model.safetensors").items()}
    save_file(planted, ckpt / "model" / "zz-planted.safetensors", metadata={"format": "pt"})
    target.load(ckpt)
    assert same(state(target), state(source))


def test_sharded_weights_are_read_through_their_index(saved, tmp_path):
    source, target, ckpt = saved
    model_dir = ckpt / "model"
    (model_dir / "model.safetensors").unlink()
    source.model.save_pretrained(model_dir, safe_serialization=True, max_shard_size="20KB")
    assert len(list(model_dir.glob("model-*.safetensors"))) > 1
    target.load(ckpt)
    assert same(state(target), state(source))
    index = model_dir / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][next(iter(data["weight_map"]))] = "../../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json is corrupt: weight_map must name files"):
        target.load(ckpt)


def test_the_actor_returns_a_refusal_rather_than_raising(saved):
    """A raise would tear down a multi-rank Ray group; the controller needs it to try another."""
    source, target, ckpt = saved
    worker = SimpleNamespace(engine=target)  # all that load_checkpoint uses
    before = state(target)
    good = (ckpt / "optim.pt").read_bytes()
    (ckpt / "optim.pt").write_bytes(b"not a zip file")
    refusal = ActorWorker.load_checkpoint(worker, str(ckpt))
    assert refusal is not None and refusal.startswith(f"{ckpt / 'optim.pt'}: refused to load optimizer state")
    assert same(state(target), before)
    (ckpt / "optim.pt").write_bytes(good)
    assert ActorWorker.load_checkpoint(worker, str(ckpt)) is None
    assert same(state(target), state(source))

"""Sharded checkpoints (``hybridflow.training.sharded_checkpoint``): every rank writes its own
shards, nothing gathered; a checkpoint saved on two gloo ranks resumes on one, two and four.

One spawn saves on two ranks (sharded and, for comparison, full), then resumes both in the same
processes: the next two steps are bitwise those of the uninterrupted run, as with the full format,
and each rank's RNG is back. A second spawn resumes on four ranks, and one rank resumes in this
process: the next two losses (the second one moved by the restored Adam moments) agree to 1e-6.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from hybridflow.algorithms import agg_loss, batch_counts
from hybridflow.controller.checkpoint import CheckpointManager
from hybridflow.controller.export import export_checkpoint
from hybridflow.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from hybridflow.training import distributed, sharded_checkpoint
from hybridflow.training.engine import OptimSpec, TrainEngine
from hybridflow.types import TrainBatch
from hybridflow.utils.errors import CheckpointError

SPEC = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
BATCH_SIZE = 8  # divides 1, 2 and 4 ranks
RESUMED_STEPS = 2  # the first checks the weights, the second the optimizer's moments too
LOSS_TOLERANCE = 1e-6
# forkserver: each rank is forked from a fresh single-threaded server that has imported torch and
# the model code once (spawned ranks each import them again: most of the test's minute on a busy
# 2-core machine). Not fork: forking this process, whose earlier tests left a hundred threads
# (and their locks) behind, hung a rank.
START_METHOD = "forkserver"
PRELOAD = ["torch", "transformers", "hybridflow.training.engine", "hybridflow.training.sharded_checkpoint"]


@pytest.fixture(autouse=True)
def threads():
    torch.set_num_threads(1)


def random_batch(seed: int = 5, prompt: int = 5, response: int = 7) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (BATCH_SIZE, prompt + response), generator=g)
    attention = torch.ones_like(ids)
    attention[0, prompt + response - 3 :] = 0  # a shorter response
    return TrainBatch(
        input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
        response_mask=attention[:, prompt:].float(), group_ids=torch.arange(BATCH_SIZE),
        rewards=torch.zeros(BATCH_SIZE), rollout_logprobs=torch.zeros(BATCH_SIZE, response), prompt_length=prompt,
    )


def make_engine(seed: int, world: int) -> TrainEngine:
    return TrainEngine(build_tiny_model(SPEC, seed=seed), OptimSpec(lr=1e-2), torch.device("cpu"),
                       data_parallel=world > 1)


def train_step(engine: TrainEngine, step: int, world: int) -> float:
    """One optimizer step on this rank's share of step ``step``'s batch; the whole batch's
    token-mean NLL before the update (summed over ranks)."""
    batch = random_batch(seed=step)
    shard = batch.chunk(world)[distributed.rank()] if world > 1 else batch
    num_tokens, _ = batch_counts(batch.response_mask)
    losses: list[float] = []

    def loss_fn(mb, logprobs, entropy):
        loss = agg_loss(-logprobs, mb.response_mask, "token-mean", global_num_tokens=num_tokens, dp_size=world)
        losses.append(float(loss.detach()) / world)
        return loss, {}

    engine.optimizer_step([shard], loss_fn, temperature=1.0, with_entropy=False)
    return distributed.all_reduce_sum(losses)[0]


def resumed_losses(engine: TrainEngine, world: int) -> list[float]:
    return [train_step(engine, step, world) for step in range(2, 2 + RESUMED_STEPS)]


def _two_ranks(rank: int, world: int, port: int, root: str, out: dict) -> None:
    torch.set_num_threads(1)
    distributed.init_process_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"))
    try:
        engine = make_engine(seed=4, world=world)
        train_step(engine, 1, world)
        torch.manual_seed(100 + rank)
        engine.save(Path(root, "sharded"), tokenizer=build_tiny_tokenizer() if rank == 0 else None, sharded=True)
        engine.save(Path(root, "full"))
        out[f"draw/{rank}"] = torch.rand(3)  # what a resumed rank must draw next
        saved = dict(engine.named_weights())
        if rank == 0:
            out["saved_weights"] = saved
        out["uninterrupted"] = resumed_losses(engine, world)
        weights = dict(engine.named_weights())
        for fmt in ("sharded", "full"):
            torch.manual_seed(999)
            resumed = make_engine(seed=7, world=world)
            resumed.load(Path(root, fmt))
            out[f"{fmt}/draw/{rank}"] = torch.rand(3)
            out[f"{fmt}/losses"] = resumed_losses(resumed, world)
            after = dict(resumed.named_weights())
            if rank == 0:
                out[f"{fmt}/same_weights"] = after.keys() == weights.keys() and all(
                    torch.equal(after[k], weights[k]) for k in weights)
    finally:
        distributed.close_process_group()


def _four_ranks(rank: int, world: int, port: int, root: str, out: dict) -> None:
    torch.set_num_threads(1)
    distributed.init_process_group(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                                   device=torch.device("cpu"))
    try:
        torch.manual_seed(999)
        resumed = make_engine(seed=7, world=world)
        resumed.load(Path(root, "sharded"))
        out[f"draw/{rank}"] = torch.rand(3)
        out["losses"] = resumed_losses(resumed, world)
    finally:
        distributed.close_process_group()


def spawn(fn, world: int, root: Path) -> dict:
    context = mp.get_context(START_METHOD)
    context.set_forkserver_preload(PRELOAD)
    with context.Manager() as manager:
        out = manager.dict()
        mp.start_processes(fn, args=(world, distributed.free_port(), str(root), out), nprocs=world, join=True,
                           start_method=START_METHOD)
        return dict(out)


def test_sharded_checkpoints_resume_on_one_two_and_four_ranks(tmp_path) -> None:
    one_rank = make_engine(seed=7, world=1)
    two = spawn(_two_ranks, 2, tmp_path)
    sharded = tmp_path / "sharded"
    # Each rank wrote its own shard file; nothing else holds tensors.
    assert sorted(p.name for p in (sharded / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in (sharded / "rng").iterdir()) == ["rank_0.safetensors", "rank_1.safetensors"]
    assert not list((sharded / "model").glob("*.safetensors"))

    # Same world size: bitwise, like the full format.
    assert two["sharded/losses"] == two["uninterrupted"] == two["full/losses"]
    assert two["sharded/same_weights"] and two["full/same_weights"]
    for rank in range(2):
        assert torch.equal(two[f"sharded/draw/{rank}"], two[f"draw/{rank}"])

    four = spawn(_four_ranks, 4, tmp_path)
    one_rank.load(sharded)
    one = resumed_losses(one_rank, world=1)
    for losses in (four["losses"], one):
        assert losses == pytest.approx(two["uninterrupted"], abs=LOSS_TOLERANCE, rel=0)
    # Ranks the checkpoint had restore their RNG; new ranks keep their own.
    for rank in range(2):
        assert torch.equal(four[f"draw/{rank}"], two[f"draw/{rank}"])
    assert not torch.equal(four["draw/2"], two["draw/0"])

    exported = export_from_shards(sharded, tmp_path)
    assert sorted(p.name for p in exported.glob("*.safetensors*")) == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
        "model.safetensors.index.json"]
    weights = {k: v for f in sorted(exported.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert "lm_head.weight" not in weights  # tied to the embedding: written once, as HF does
    saved = two["saved_weights"]
    assert weights.keys() == saved.keys() - {"lm_head.weight"}
    assert all(torch.equal(weights[k], saved[k]) for k in weights)


def export_from_shards(engine_dir: Path, tmp_path: Path) -> Path:
    """Export the two ranks' shards as a run's checkpoint (manifest and all), in files small
    enough that the export streams them in three parts."""
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", max_to_keep=None)
    manager.save(1, {"step": 1}, write_actor=lambda d: shutil.copytree(engine_dir, d))
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_1"
    listed = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"actor/dcp/.metadata", "actor/dcp/__0_0.distcp", "actor/dcp/__1_0.distcp",
            "actor/rng/rank_1.safetensors"} <= listed.keys()
    layer_bytes = sum(p.numel() * 4 for p in make_engine(seed=0, world=1).model.model.layers[0].parameters())
    return export_checkpoint(tmp_path / "run", tmp_path / "export", max_shard_bytes=layer_bytes + 1)


# ------------------------------------------------------------------------------ one process
def test_a_planted_metadata_pickle_is_refused_and_never_runs(tmp_path) -> None:
    engine = make_engine(seed=1, world=1)
    train_step(engine, 1, world=1)
    engine.save(tmp_path / "ckpt", sharded=True)
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (tmp_path / "ckpt" / "dcp" / ".metadata").write_bytes(pickle.dumps(Exploit()))
    other = make_engine(seed=2, world=1)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata: refused to read checkpoint metadata"):
        other.load(tmp_path / "ckpt")
    assert not marker.exists()
    assert all(torch.equal(v, other.model.state_dict()[k]) for k, v in before.items())


def test_metadata_that_does_not_fit_is_refused_naming_the_file(tmp_path) -> None:
    engine = make_engine(seed=1, world=1)
    train_step(engine, 1, world=1)
    engine.save(tmp_path / "ckpt", sharded=True)
    bigger = TrainEngine(build_tiny_model(TinyModelSpec(hidden_size=64, intermediate_size=256, num_hidden_layers=2)),
                         OptimSpec(lr=1e-2), torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata do not match the model: wrong shape"):
        bigger.load(tmp_path / "ckpt")
    # A chunk file outside the checkpoint folder is refused before anything is read.
    metadata = sharded_checkpoint.read_metadata(tmp_path / "ckpt" / "dcp")
    next(iter(metadata.storage_data.values())).relative_path = "../elsewhere.distcp"
    (tmp_path / "ckpt" / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="names a chunk file '../elsewhere.distcp'"):
        make_engine(seed=2, world=1).load(tmp_path / "ckpt")


def test_auto_shards_with_more_than_one_rank() -> None:
    from hybridflow.workers.checkpoints import sharded_checkpoints

    assert [sharded_checkpoints("auto", n) for n in (1, 2)] == [False, True]
    assert sharded_checkpoints("sharded", 1) and not sharded_checkpoints("full", 4)

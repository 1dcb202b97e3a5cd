"""The weight-sync verifier (rollout.verify_weight_sync): a clean sync passes and is timed, a byte
corrupted in one replica's engine during a sync (HYBRIDFLOW_FAULT) fails naming replica and tensor,
and replicas whose engine holds its own copy say once why they are not checked."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from hybridflow.cluster.worker_group import LocalWorkerGroup
from hybridflow.config import load_config
from hybridflow.controller.loops import make_trainer
from hybridflow.controller.replicas import RolloutReplicas, replica_role
from hybridflow.controller.setup import build_run
from hybridflow.data.tasks.arithmetic import write_arithmetic_task
from hybridflow.models.loading import load_causal_lm
from hybridflow.models.tiny import TinyModelSpec, write_tiny_model
from hybridflow.transfer.verify import (
    SentDigests,
    WeightSyncMismatch,
    held_digest,
    tensor_checksum,
)
from hybridflow.utils.faults import ENV
from hybridflow.workers.rollout import RolloutSetup, RolloutWorker, unverifiable_reason

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    spec = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1)
    return str(write_tiny_model(tmp_path_factory.mktemp("verify") / "model", spec, seed=3))


def _builder(setup: RolloutSetup):
    return lambda rank, world_size: RolloutWorker(rank, world_size, setup)


def replicas(model_dir: str, count: int, *, dtype: str = "float32", verify: bool = True) -> RolloutReplicas:
    setup = RolloutSetup(model_path=model_dir, engine="native", dtype=dtype, device=torch.device("cpu"),
                         max_batch_size=8, seed=0)
    groups = [LocalWorkerGroup(replica_role(k), _builder(dataclasses.replace(setup, name=replica_role(k))))
              for k in range(count)]
    return RolloutReplicas(groups, free_cache_engine=False, verify_weight_sync=verify)


def trained(model_dir: str) -> dict[str, torch.Tensor]:
    """Weights that differ from the replicas' initial ones, as after an update."""
    return {name: tensor + 0.01 for name, tensor in load_causal_lm(model_dir).state_dict().items()}


def test_the_checksum_changes_with_any_one_byte_and_not_otherwise() -> None:
    tensor = torch.randn(7, 5)
    base = tensor_checksum(tensor)
    assert tensor_checksum(tensor.clone()) == base
    raw = tensor.view(-1).view(torch.uint8)
    for position in range(raw.numel()):
        flipped = tensor.clone()
        flipped.view(-1).view(torch.uint8)[position] ^= 0x01
        assert tensor_checksum(flipped) != base, position
    odd = torch.arange(3, dtype=torch.uint8)  # a size that is no multiple of 4 bytes: summed by byte
    assert tensor_checksum(odd) == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_clean_sync_passes_and_its_check_is_timed(model_dir, dtype) -> None:
    two = replicas(model_dir, 2, dtype=dtype)
    two.update_weights(trained(model_dir).items(), version=1)  # the sent fp32 weights, held in `dtype`
    metrics = two.take_sync_metrics()
    assert metrics["timing_s/verify_weight_sync"] > 0
    assert two.take_sync_metrics() == {}  # taken


def test_a_byte_corrupted_in_one_replica_during_the_sync_fails_naming_it_and_the_tensor(model_dir, monkeypatch):
    two = replicas(model_dir, 2)
    weights = trained(model_dir)
    monkeypatch.setenv(ENV, "corrupt_weight_sync/rollout_replica_1@2")
    two.update_weights(weights.items(), version=1)  # not the faulted version: clean
    # The tiny model ties its embedding and output head: one storage, both names hold the flipped byte.
    with pytest.raises(WeightSyncMismatch, match=r"rollout replica 1 holds other weights than the trainer sent for "
                                                 r"2 tensor\(s\): lm_head\.weight, model\.embed_tokens\.weight"):
        two.update_weights(weights.items(), version=2)


def test_weights_handed_over_beside_the_actor_are_checked_against_what_was_handed(model_dir, monkeypatch) -> None:
    """trainer.hybrid_engine: an actor rank hands the weights to the replica in its own process
    (``update_weights(note_received=True)``), so the controller never holds them; the replica's
    checksums of what it was handed are what its engine's bytes are checked against, as a broadcast's."""
    two = replicas(model_dir, 2)
    weights = trained(model_dir)
    monkeypatch.setenv(ENV, "corrupt_weight_sync/rollout_replica_1@2")
    for version in (1, 2):
        for group in two.groups:
            group.call_one(0, RolloutWorker.update_weights, weights.items(), version, note_received=True)
        if version == 1:
            two.verify_sync()  # clean
            assert two.take_sync_metrics()["timing_s/verify_weight_sync"] > 0
    with pytest.raises(WeightSyncMismatch, match=r"rollout replica 1 .*lm_head\.weight"):
        two.verify_sync()


def test_without_the_check_the_corruption_goes_unnoticed(model_dir, monkeypatch) -> None:
    # What the verifier is for: the same fault with rollout.verify_weight_sync=false passes silently.
    two = replicas(model_dir, 2, verify=False)
    monkeypatch.setenv(ENV, "corrupt_weight_sync/rollout_replica_0@1")
    weights = trained(model_dir)
    two.update_weights(weights.items(), version=1)
    held, _ = two.groups[0].call_one(0, RolloutWorker.weights_digest)
    with pytest.raises(WeightSyncMismatch, match="rollout replica 0"):
        SentDigests(weights).check("rollout replica 0", held)
    assert two.take_sync_metrics() == {}


def test_a_replica_reporting_fewer_tensors_than_were_sent_is_named() -> None:
    sent = {"a": torch.ones(3), "b": torch.zeros(2)}
    with pytest.raises(WeightSyncMismatch, match="reports no digest for 1: b"):
        SentDigests(sent).check("rollout replica 3", held_digest(sent, ["a"]))


def test_replicas_whose_engine_holds_its_own_copy_say_why_once(model_dir, caplog) -> None:
    meta = torch.nn.Linear(2, 2, device="meta")
    assert "loads and holds its own copy" in unverifiable_reason(meta, 1)
    assert "tensor-parallel" in unverifiable_reason(torch.nn.Linear(2, 2), 2)
    assert unverifiable_reason(torch.nn.Linear(2, 2), 1) is None
    one = replicas(model_dir, 1)
    worker = one.groups[0].call_one(0, _worker)
    worker._unverifiable = unverifiable_reason(meta, 1)  # as a vLLM replica's meta model makes it
    with caplog.at_level(logging.INFO, logger="hybridflow.workers.rollout"):
        for version in (1, 2):
            one.update_weights(trained(model_dir).items(), version=version)
    said = [r.getMessage() for r in caplog.records if "weight sync not verified" in r.getMessage()]
    assert said == [("rollout replica 0: weight sync not verified: its engine (vLLM, SGLang) loads and holds its "
                     "own copy, out of reach of this process")]


def _worker(worker: RolloutWorker) -> RolloutWorker:
    return worker


def test_a_training_step_whose_sync_is_corrupted_fails_and_a_clean_one_logs_the_check(tmp_path, monkeypatch):
    """The whole loop: the sync after step 1 is checked by default (its seconds in step 1's
    metrics); with a byte flipped in the replica during the sync after step 2, the run stops
    there with the error naming the replica and the tensors."""
    model_dir = write_tiny_model(tmp_path / "model", TinyModelSpec(num_hidden_layers=1))
    train, val = write_arithmetic_task(tmp_path / "data", train_size=8, val_size=2)
    cfg = load_config("grpo", overrides=[
        f"model.path={model_dir}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"trainer.output_dir={tmp_path / 'out'}", "trainer.logger=[jsonl]", "trainer.progress_bar=false",
        "trainer.num_threads=1", "trainer.timeline=false", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.save_final=false", "trainer.val_before_train=false", "data.train_batch_size=2", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "data.max_response_length=3", "trainer.total_training_steps=3",
    ])
    monkeypatch.setenv(ENV, "corrupt_weight_sync/rollout_replica_0@2")
    run = build_run(cfg)
    try:
        with pytest.raises(WeightSyncMismatch, match=r"rollout replica 0 holds other weights than the trainer sent "
                                                     r"for \d+ tensor\(s\): .*model\.embed_tokens\.weight"):
            make_trainer(run).fit()
    finally:
        run.close()
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [s["training/global_step"] for s in steps] == [1.0]
    assert steps[0]["timing_s/verify_weight_sync"] > 0

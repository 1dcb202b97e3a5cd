"""``rollout.name=sglang`` against a real SGLang server: needs CUDA and ``pip install
'hybridflow[sglang]'``; skipped otherwise. The protocol tests against a fake server, which run
everywhere, are ``test_rollout_sglang.py``.

Not yet run on a GPU (no GPU was lent to the session that wrote them): read a failure here as
possibly this file's mistake as much as the engine's.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from hybridflow.models.tiny import TinyModelSpec, build_tiny_model, write_tiny_model
from hybridflow.inference.precision import DEFAULT_MAX_LOGPROB_MISMATCH
from hybridflow.rollout.sglang_engine import build_sglang_engine
from hybridflow.training.engine import TrainEngine
from hybridflow.types import GenerationRequest, SamplingParams, collate_trajectories

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs pip install 'hybridflow[sglang]'"),
]

# Head dim 64: SGLang's CUDA attention kernels take 64, 128, 256, not the default tiny model's 32.
SPEC = TinyModelSpec(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
EOS, PAD = 258, 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), SPEC, seed=1)


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = build_sglang_engine(model=build_tiny_model(SPEC, seed=1), device="cuda", dtype="float32", seed=0,
                                 max_batch_size=16, model_path=str(checkpoint))
    yield engine
    engine.close()


def requests(temperature: float, seed: int = 0) -> list[GenerationRequest]:
    return [GenerationRequest([257, 10 + i, 20 + 2 * i], SamplingParams(n=3, temperature=temperature, max_tokens=8,
                                                                       seed=seed + i)) for i in range(4)]


def test_generation_is_seeded_and_ends_with_a_finish_reason(engine):
    first, again = engine.generate_batch(requests(1.0)), engine.generate_batch(requests(1.0))
    assert [[t.response_ids for t in g] for g in first] == [[t.response_ids for t in g] for g in again]
    for group in first:
        assert len(group) == 3 and len({tuple(t.response_ids) for t in group}) > 1
        for t in group:
            assert 1 <= len(t.response_ids) <= 8 and len(t.rollout_logprobs) == len(t.response_ids)
            assert t.finish_reason in ("stop", "length")
            assert t.finish_reason == "length" or t.response_ids[-1] == EOS


def test_rollout_logprobs_match_the_trainer_recomputation(engine):
    trajectories = [t for group in engine.generate_batch(requests(0.7, seed=100)) for t in group]
    batch = collate_trajectories(trajectories, pad_token_id=PAD)
    trainer = TrainEngine(build_tiny_model(SPEC, seed=1), optim=None, device=torch.device("cuda"))
    logprobs, _ = trainer.compute_logprobs(batch.to("cuda"), temperature=0.7, micro_batch_size=6)
    mask = batch.response_mask.bool()
    difference = (logprobs.cpu()[mask] - batch.rollout_logprobs[mask]).abs()
    assert difference.mean() < DEFAULT_MAX_LOGPROB_MISMATCH, difference


def test_weights_from_the_update_group_change_what_is_generated(engine):
    greedy = [GenerationRequest([257, 30, 31], SamplingParams(greedy=True, max_tokens=6))]
    before = engine.generate_batch(greedy)[0][0]
    engine.update_weights(build_tiny_model(SPEC, seed=2).state_dict().items())
    changed = engine.generate_batch(greedy)[0][0]
    assert changed.rollout_logprobs != before.rollout_logprobs  # other weights, other distribution
    engine.update_weights(build_tiny_model(SPEC, seed=1).state_dict().items())
    restored = engine.generate_batch(greedy)[0][0]
    assert restored.response_ids == before.response_ids
    assert restored.rollout_logprobs == pytest.approx(before.rollout_logprobs, abs=1e-4)
    with pytest.raises(ValueError, match="has shape"):
        engine.update_weights([("model.embed_tokens.weight", torch.zeros(3, 3))])


def test_sleep_and_wake_keep_the_server_serving(engine):
    greedy = [GenerationRequest([257, 40], SamplingParams(greedy=True, max_tokens=5))]
    before = engine.generate_batch(greedy)[0][0].response_ids
    engine.sleep(1)
    engine.wake_up()
    assert engine.generate_batch(greedy)[0][0].response_ids == before
    weights = copy.deepcopy(build_tiny_model(SPEC, seed=1).state_dict())
    engine.sleep(2)
    engine.wake_up()
    with pytest.raises(RuntimeError, match="weights were released"):
        engine.generate_batch(greedy)
    engine.update_weights(weights.items())
    assert engine.generate_batch(greedy)[0][0].response_ids == before

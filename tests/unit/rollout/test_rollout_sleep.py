"""NativeEngine.sleep levels: level 1 frees the KV cache, level 2 the weights too, until a full
weight update brings them back (checked by bytes held, not RSS, which the allocator blurs)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models.loading import load_causal_lm
from hybridflow.inference import cpu_kernels
from hybridflow.inference.compact import onednn_packing_available
from hybridflow.inference.native import NativeEngine

from test_rollout_native_engine import PROMPTS, make_engine, make_model, request

torch.set_num_threads(1)

LAYOUTS = [(dtype, layout) for dtype in ("float32", "bfloat16") for layout in ("dense", "onednn")
           if layout == "dense" or onednn_packing_available(torch.device("cpu"), getattr(torch, dtype))]
LAYOUTS += [("bfloat16", "panels")] if cpu_kernels.available() else []


def outputs(engine: NativeEngine) -> list[list[tuple[list[int], list[float]]]]:
    requests = [request(p, temperature=1.0, max_tokens=8, seed=i, n=2) for i, p in enumerate(PROMPTS)]
    requests += [request(p, temperature=0.0, max_tokens=8) for p in PROMPTS]
    return [[(t.response_ids, t.rollout_logprobs) for t in r] for r in engine.generate_batch(requests)]


def test_level_one_keeps_the_weights():
    engine = make_engine()
    before = engine.weight_bytes
    outputs(engine)
    engine.sleep(level=1)
    assert engine.kv_cache_bytes == 0 and engine.weight_bytes == before > 0
    engine.wake_up()
    outputs(engine)


@pytest.mark.parametrize(("dtype", "layout"), LAYOUTS)
def test_level_two_frees_the_weights_and_a_full_update_restores_them(dtype, layout):
    donor = make_model(seed=1)
    engine = make_engine(make_model(), weight_layout=layout, dtype=dtype)
    held = engine.weight_bytes
    outputs(engine)
    engine.sleep(level=2)
    assert engine.weight_bytes == 0 and engine.kv_cache_bytes == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    engine.wake_up()
    with pytest.raises(RuntimeError, match=r"sleep\(level=2\).*update_weights"):
        engine.generate_batch([request(PROMPTS[0], max_tokens=2)])
    engine.update_weights(donor.state_dict().items(), max_bucket_bytes=4096)
    assert engine.weight_bytes == held
    assert outputs(engine) == outputs(make_engine(make_model(seed=1), weight_layout=layout, dtype=dtype))


def test_level_two_then_update_then_wake_up_in_that_order():
    donor = make_model(seed=1)
    engine = make_engine()
    engine.sleep(level=2)
    engine.update_weights(donor.state_dict().items())
    engine.wake_up()
    assert outputs(engine) == outputs(make_engine(make_model(seed=1)))


def test_a_partial_update_after_level_two_is_refused_and_leaves_the_weights_dropped():
    engine = make_engine()
    engine.sleep(level=2)
    engine.wake_up()
    partial = [(k, v) for k, v in make_model(seed=1).state_dict().items() if "layers.1." not in k]
    with pytest.raises(RuntimeError, match=r"left \d+ parameters unset \('model\.layers\.1\."):
        engine.update_weights(partial)
    assert engine.weight_bytes == 0
    with pytest.raises(RuntimeError, match="no weights"):
        engine.generate_batch([request(PROMPTS[0], max_tokens=2)])
    engine.update_weights(make_model(seed=1).state_dict().items())
    assert outputs(engine) == outputs(make_engine(make_model(seed=1)))


def test_level_two_works_for_a_model_loaded_from_a_checkpoint(tmp_path):
    """from_pretrained memory-maps the checkpoint on a CPU; the engine copies what it cannot free."""
    make_model().save_pretrained(tmp_path)
    engine = make_engine(load_causal_lm(str(tmp_path), device=torch.device("cpu")))
    expected = outputs(engine)
    engine.sleep(level=2)
    assert engine.weight_bytes == 0
    engine.wake_up()
    engine.update_weights(make_model().state_dict().items())
    assert outputs(engine) == expected


def test_sleep_rejects_unknown_levels():
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        make_engine().sleep(level=3)

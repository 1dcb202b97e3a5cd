"""CUDA-graph decode on a GPU: same tokens as eager decode, graphs follow weight updates and sleep.

Skipped without CUDA (CI has none); the GPU kit runs them (``scripts/gpu_checks.sh``, step pytest_gpu).
"""

from __future__ import annotations

import pytest
import torch
from test_rollout_native_engine import PROMPTS, make_engine, make_model, request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def generate(engine, max_tokens: int = 12) -> list[tuple[list[int], list[float]]]:
    requests = [request(p, temperature=0.0, max_tokens=max_tokens + i) for i, p in enumerate(PROMPTS)]
    requests += [request(p, temperature=0.8, n=3, seed=i, max_tokens=max_tokens) for i, p in enumerate(PROMPTS)]
    return [(t.response_ids, t.rollout_logprobs) for group in engine.generate_batch(requests) for t in group]


def assert_same(a: list[tuple[list[int], list[float]]], b: list[tuple[list[int], list[float]]]) -> None:
    for (ids_a, logprobs_a), (ids_b, logprobs_b) in zip(a, b, strict=True):
        assert ids_a == ids_b
        assert torch.allclose(torch.tensor(logprobs_a), torch.tensor(logprobs_b), atol=1e-4, rtol=0)


def test_cuda_graph_decode_generates_what_eager_decode_does():
    eager = make_engine(make_model(), device="cuda", decode_mode="eager")
    graphed = make_engine(make_model(), device="cuda", decode_mode="cuda_graph")
    assert graphed.decode_mode == "cuda_graph"
    assert_same(generate(graphed), generate(eager))
    decoder = graphed._runner.static_decoder
    assert decoder is not None and decoder.captures >= 2  # several batch buckets as rows finished
    captures = decoder.captures
    generate(graphed)  # the same shapes again: replays, no new captures
    assert decoder.captures == captures


def test_captured_graphs_see_weight_updates_and_survive_sleep():
    graphed = make_engine(make_model(), device="cuda", decode_mode="cuda_graph")
    eager = make_engine(make_model(), device="cuda", decode_mode="eager")
    generate(graphed)  # capture with the old weights
    new_weights = list(make_model(seed=1).state_dict().items())
    graphed.update_weights(new_weights)
    eager.update_weights(new_weights)
    assert_same(generate(graphed), generate(eager))
    graphed.sleep()
    assert graphed._runner.static_decoder is not None and graphed._runner.static_decoder.num_graphs == 0
    graphed.wake_up()
    assert_same(generate(graphed), generate(eager))

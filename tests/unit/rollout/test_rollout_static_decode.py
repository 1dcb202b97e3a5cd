"""Static-shape decode (the shapes CUDA graphs capture), run eagerly on CPU against the dynamic path."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_rollout_native_engine import PAD, PROMPTS, make_engine, make_model, request

from hybridflow.inference import graphs
from hybridflow.inference.compact import CompactCausalLM
from hybridflow.inference.graphs import StaticDecoder, batch_bucket, key_bucket, token_bucket
from hybridflow.inference.kv_cache import SlotKVCache

torch.set_num_threads(1)


def test_batch_buckets_pad_small_batches_to_powers_of_two_and_large_ones_to_steps():
    sizes = [1, 2, 3, 5, 8, 9, 16, 17, 33, 250]
    assert [batch_bucket(b, 256) for b in sizes] == [1, 2, 4, 8, 8, 16, 16, 32, 48, 256]
    assert batch_bucket(17, 20) == 20  # never more rows than the cache has
    assert batch_bucket(3, 3) == 3
    for bad in (0, 21):
        with pytest.raises(ValueError, match="outside"):
            batch_bucket(bad, 20)


def test_key_buckets_round_up_to_the_bucket_and_stop_at_the_capacity():
    assert [key_bucket(n, 1024) for n in (1, 64, 65, 128, 129, 256, 257, 1000)] == [
        64, 64, 128, 128, 256, 256, 512, 1024]
    assert key_bucket(300, 320) == 320
    assert key_bucket(40, 50) == 50 and key_bucket(90, 100) == 100
    with pytest.raises(ValueError, match="outside"):
        key_bucket(321, 320)


def test_token_buckets_are_powers_of_two_then_eight_per_doubling():
    assert [token_bucket(n) for n in (1, 3, 16, 17, 19, 32, 33, 100, 1000, 2048)] == [
        1, 4, 16, 18, 20, 32, 36, 104, 1024, 2048]
    for n in range(17, 5000):  # at most 1/8 of padding, and few widths
        assert n <= token_bucket(n) <= n + n // 8
    assert len({token_bucket(n) for n in range(1, 2049)}) <= 64
    with pytest.raises(ValueError, match=">= 1"):
        token_bucket(0)


def make_cache(rows: int, capacity: int, seed: int, dtype: torch.dtype = torch.float32) -> SlotKVCache:
    cache = SlotKVCache(num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype, device=torch.device("cpu"),
                        max_decode_rows=rows, prompt_rows=2, memory_budget_bytes=1 << 30, max_capacity=capacity)
    assert cache.ensure_capacity(capacity, live_rows=0)
    generator = torch.Generator().manual_seed(seed)
    assert cache.keys is not None and cache.values is not None
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    return cache


@torch.inference_mode()
def test_padded_static_step_equals_the_dynamic_step(monkeypatch):
    """Rows at different positions; 5 live rows pad to 8, 21 keys pad to 32 of 64 positions."""
    monkeypatch.setattr(graphs, "KEY_BUCKET", 16)
    compact = CompactCausalLM.from_hf(make_model(), max_positions=64)
    dynamic_cache, static_cache = make_cache(12, 64, seed=1), make_cache(12, 64, seed=1)
    tokens = torch.tensor([5, 17, 3, 200, 42])
    positions = torch.tensor([3, 20, 9, 0, 14])
    key_length = 21
    access = dynamic_cache.decode_access(5, positions, key_length)
    expected = compact.forward(tokens[:, None], positions[:, None], access, key_length)
    decoder = StaticDecoder(compact, static_cache, max_rows=12, pad_token_id=PAD, capture=False)
    got = decoder.forward(tokens, positions, key_length)
    assert expected is not None and got.shape == expected.shape == (5, compact.vocab_size)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    # Live rows got the same keys and values; padding rows [5, 8) wrote position 0 only; prompt rows
    # and rows past the bucket are untouched.
    assert static_cache.keys is not None and dynamic_cache.keys is not None
    assert torch.allclose(static_cache.keys[:, :5], dynamic_cache.keys[:, :5], atol=1e-6)
    assert torch.allclose(static_cache.values[:, :5], dynamic_cache.values[:, :5], atol=1e-6)
    changed = (static_cache.keys != dynamic_cache.keys).any(dim=(0, 2, 3))  # (rows, positions)
    assert changed[5:8, 0].all() and not changed[5:8, 1:].any()
    assert not changed[8:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.inference_mode()
def test_short_key_buckets_give_the_logits_of_the_full_bucket_to_the_bit(monkeypatch, dtype):
    """Reading 64 or 128 key positions instead of 256 changes no logit: the keys past a row's position get
    no weight, in bf16 (the static mode's precision on a CPU) and in float32."""
    compact = CompactCausalLM.from_hf(make_model().to(dtype), max_positions=256)
    generator = torch.Generator().manual_seed(5)
    for rows, key_length in ((8, 40), (3, 64), (5, 100), (16, 128)):
        tokens = torch.randint(1, 250, (rows,), generator=generator)
        positions = torch.randint(0, key_length, (rows,), generator=generator)
        positions[0] = key_length - 1
        assert key_bucket(key_length, 256) < graphs.KEY_BUCKET
        logits = {}
        for smallest in (graphs.MIN_KEY_BUCKET, graphs.KEY_BUCKET):  # the new buckets, then 256 keys always
            monkeypatch.setattr(graphs, "MIN_KEY_BUCKET", smallest)
            cache = make_cache(16, 256, seed=2, dtype=dtype)
            decoder = StaticDecoder(compact, cache, max_rows=16, pad_token_id=PAD, capture=False)
            logits[smallest] = decoder.forward(tokens, positions, key_length).clone()
        monkeypatch.undo()
        short, full = logits.values()
        assert torch.equal(short, full), (rows, key_length)


def run_mixed_workload(decode_mode: str) -> list[list[tuple[list[int], list[float]]]]:
    """Greedy and seeded sampled requests, more samples than rows, some arriving mid-flight."""
    engine = make_engine(make_model(), max_batch_size=6, decode_mode=decode_mode)

    async def serve() -> list:
        first = [engine.generate(request(p, temperature=0.0, max_tokens=9 + i)) for i, p in enumerate(PROMPTS)]
        started = [asyncio.ensure_future(c) for c in first]
        await asyncio.sleep(0.05)  # a few steps in: the rest join a running batch
        later = [engine.generate(request(p, temperature=0.9, n=3, seed=7 + i, max_tokens=12)) for i, p in enumerate(PROMPTS)]
        return list(await asyncio.gather(*started, *later))

    results = asyncio.run(serve())
    assert engine.stats.max_running == 6
    return [[(t.response_ids, t.rollout_logprobs) for t in group] for group in results]


def test_engine_static_decode_mode_generates_what_eager_mode_does():
    eager, static = run_mixed_workload("eager"), run_mixed_workload("static")
    for eager_group, static_group in zip(eager, static, strict=True):
        for (eager_ids, eager_logprobs), (static_ids, static_logprobs) in zip(eager_group, static_group, strict=True):
            assert static_ids == eager_ids
            assert torch.allclose(torch.tensor(static_logprobs), torch.tensor(eager_logprobs), atol=1e-5, rtol=0)


def test_bucketed_prefill_and_decode_generate_what_exact_shapes_do_in_float32():
    """Long prompts prefilled in chunks of a small budget (widths of 1-13 columns over 1-4 prompts,
    padded to buckets, keys to the bucket or the capacity), then sampled decode: same tokens, same logprobs."""
    prompts = [[(7 * i + j) % 250 + 1 for j in range(length)] for i, length in enumerate((23, 41, 9, 30, 57))]
    requests = [request(p, temperature=0.9, n=2, seed=3 + i, max_tokens=14) for i, p in enumerate(prompts)]
    results = {}
    for mode in ("eager", "static"):
        engine = make_engine(make_model(), max_batch_size=6, max_prefill_tokens=13, decode_mode=mode,
                             enable_prefix_caching=False)
        assert engine._runner.bucket_prefill == (mode == "static")
        groups = engine.generate_batch(requests)
        results[mode] = [[(t.response_ids, t.rollout_logprobs) for t in group] for group in groups]
    for eager_group, static_group in zip(results["eager"], results["static"], strict=True):
        for (eager_ids, eager_logprobs), (static_ids, static_logprobs) in zip(eager_group, static_group, strict=True):
            assert static_ids == eager_ids
            assert torch.allclose(torch.tensor(static_logprobs), torch.tensor(eager_logprobs), atol=1e-5, rtol=0)


def test_default_decode_mode_buckets_shapes_only_in_reduced_precision_on_a_cpu():
    """oneDNN keeps a kernel per matmul shape in bf16 (graphs module docstring); float32 stays exact-shape."""
    assert make_engine(make_model(), dtype="bfloat16").decode_mode == "static"
    assert make_engine(make_model(), dtype="bfloat16", decode_mode="eager").decode_mode == "eager"
    assert make_engine(make_model(), dtype="float32").decode_mode == "eager"


def test_decode_mode_is_checked():
    with pytest.raises(ValueError, match="decode_mode must be one of"):
        make_engine(decode_mode="graph")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            make_engine(decode_mode="cuda_graph")
    assert make_engine().decode_mode == "eager"  # the default off CUDA: padding would cost real work


def test_a_failed_graph_capture_falls_back_to_eager_decode(monkeypatch, caplog):
    def fail(self, tokens, positions, key_length):
        raise graphs.GraphCaptureError("capturing the decode step failed: an op a graph cannot hold")

    monkeypatch.setattr(StaticDecoder, "forward", fail)
    engine = make_engine(make_model(), decode_mode="static")
    requests = [request(p, temperature=0.0, max_tokens=6) for p in PROMPTS]
    got = [group[0].response_ids for group in engine.generate_batch(requests)]
    expected = [group[0].response_ids for group in make_engine(make_model()).generate_batch(requests)]
    assert got == expected
    assert engine.decode_mode == "eager"
    assert "decoding without CUDA graphs from now on" in caplog.text

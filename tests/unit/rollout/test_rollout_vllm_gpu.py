"""rollout.name=vllm on a GPU: the vLLM engine (GPU build, ``pip install -e '.[vllm]'``) against the
trainer's full-forward references, its sleep mode and a decode-throughput figure. Skipped without
CUDA or without a GPU build of vLLM (``engine_unavailable("vllm", "cuda")`` gives the reason).
They need a GPU machine where vLLM is installed: the machine the GPU kit (``scripts/gpu_checks.sh``)
is made for has none and no network, so there they skip with that reason. The CPU build's tests
are ``test_rollout_vllm.py``, whose model and references these reuse.

vLLM lets one engine with sleep mode use its CuMem memory pool per process ("CuMem allocator can
only be used for one instance per process"), so each group here builds its engine in a fresh
pytest process: ``python -m pytest -n 0 -s FILE::TestFloat32``, then ``FILE::TestBfloat16``, then
``-m slow FILE``. In a single run the engines are torn down between groups, and a group whose engine
cannot start because the pool is still held skips, naming the command that runs it alone.

Not yet run on a GPU (no GPU was lent to the session that wrote them): read a failure here as
possibly this file's mistake as much as the engine's.

vLLM's sleep levels (vLLM 0.32, ``CuMemBackend.suspend``): level 1 copies the weights to host
memory and discards the KV cache; level 2 discards both, and ``wake_up`` maps the weights' memory
back without their contents, so the next full weight update must come before generation.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# The CPU build's tests' tiny model and trainer-side references (imported, as test_rollout_cuda_graphs.py
# imports test_rollout_native_engine's: pytest puts this directory on sys.path).
from test_rollout_vllm import EOS, PAD, PROMPTS, make_model, reference_greedy, reference_logprobs, request, save_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.rollout import base, factory
from hybridflow.rollout.factory import EngineArgs, engine_unavailable
from hybridflow.inference.precision import DEFAULT_MAX_LOGPROB_MISMATCH
from hybridflow.types import Trajectory

# Why these cannot run here: no CUDA, and/or no GPU build of vLLM (missing, or its CPU build).
UNAVAILABLE = "; ".join(r for r in ("" if torch.cuda.is_available() else "needs CUDA",
                                     engine_unavailable("vllm", "cuda") or "") if r)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)]

# fp32 on both sides (references on the CPU): CUDA kernels reduce in another order than the CPU's,
# so the last bits differ a little more than the CPU build's 1e-4 (test_rollout_vllm.py).
FP32_TOLERANCE = 1e-3
# bf16 in vLLM against the trainer's recomputation, in fp32, of the weights it was sent (the
# checkpoint's rounded to bf16, as vLLM loads them): what is left is vLLM's bf16 activations. The mean
# absolute difference over all tokens is held to the health check's default ceiling
# (trainer.health.logprob_mismatch, 0.05) and no token may be off by BF16_MAX_TOKEN_DIFFERENCE or more.
# Measured on a CPU with Hugging Face's own bf16 forward of this model (wide random init, so large
# logits) against the same reference: mean 0.030, max 0.14; against the unrounded fp32 weights the
# weights' rounding adds to it (mean 0.042, max 0.37), which is why the reference is rounded first.
BF16_MAX_TOKEN_DIFFERENCE = 0.5


def build_engine(model_dir: Path, *, dtype: str, max_batch_size: int = 16, **kwargs) -> base.RolloutEngine:
    """A vLLM engine on the GPU over ``model_dir``; skips when another engine still holds vLLM's pool."""
    from hybridflow.models.loading import meta_causal_lm

    require_free_pool()
    return factory.build_rollout_engine(
        "vllm", EngineArgs(model=meta_causal_lm(model_dir), eos_token_ids=[EOS], pad_token_id=PAD,
                           max_batch_size=max_batch_size, device="cuda", dtype=dtype, seed=0, model_path=str(model_dir),
                           **kwargs),
    )


def require_free_pool() -> None:
    from vllm.device_allocator.cumem import CuMemAllocator

    if CuMemAllocator.get_instance().get_current_usage() != 0:
        pytest.skip("another vLLM engine in this process still holds vLLM's CuMem pool (one per process): "
                    "run this group in its own pytest process (this file's docstring)")


def shut_down(engine) -> None:
    """Close the engine and let go of vLLM's engine, so its GPU memory (and CuMem pool) is freed
    while pytest still holds the fixture's value."""
    engine.close()
    engine._llm = None
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def reference_model() -> Qwen2ForCausalLM:
    return make_model()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, reference_model) -> Path:
    return save_model(reference_model, tmp_path_factory.mktemp("vllm-gpu") / "model")


@pytest.fixture(scope="module")
def bf16_reference() -> Qwen2ForCausalLM:
    """The reference model's weights rounded to bf16, computed in fp32."""
    return make_model().to(torch.bfloat16).float()


def assert_logprobs_match(engine, reference_model, temperature: float, *, dtype: str) -> None:
    results = engine.generate_batch([request(p, n=2, temperature=temperature, max_tokens=12, seed=i)
                                     for i, p in enumerate(PROMPTS)])
    differences = []
    for samples in results:
        for t in samples:
            assert 1 <= len(t.response_ids) <= 12 and len(t.rollout_logprobs) == len(t.response_ids)
            differences.append((torch.tensor(t.rollout_logprobs) - reference_logprobs(reference_model, t, temperature))
                               .abs())
    difference = torch.cat(differences)
    if dtype == "float32":
        assert difference.max() < FP32_TOLERANCE, difference.max()
    else:
        assert difference.mean() < DEFAULT_MAX_LOGPROB_MISMATCH, difference.mean()
        assert difference.max() < BF16_MAX_TOKEN_DIFFERENCE, difference.max()


def greedy(engine, prompt: list[int], max_tokens: int = 8) -> Trajectory:
    return engine.generate_batch([request(prompt, temperature=0.0, max_tokens=max_tokens)])[0][0]


def pool_bytes(tag: str) -> tuple[int, int]:
    """Bytes vLLM's CuMem pool holds under ``tag``, and how many of them are backed up on the host."""
    from vllm.device_allocator.cumem import CuMemAllocator

    held = backed_up = 0
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        if data.tag == tag:
            held += data.handle[1]
            backed_up += data.handle[1] if data.cpu_backup_tensor is not None else 0
    return held, backed_up


def free_gpu_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


class TestFloat32:
    """One fp32 engine for the class; tests leave its weights as they found them."""

    @pytest.fixture(scope="class")
    def engine(self, model_dir) -> Iterator[base.RolloutEngine]:
        engine = build_engine(model_dir, dtype="float32")
        yield engine
        shut_down(engine)

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_rollout_logprobs_equal_the_trainers_recomputation(self, engine, reference_model, temperature):
        assert_logprobs_match(engine, reference_model, temperature, dtype="float32")

    def test_greedy_equals_the_full_forward_reference(self, engine, reference_model):
        for prompt in PROMPTS:
            assert greedy(engine, prompt, 10).response_ids == reference_greedy(reference_model, prompt, 10)

    def test_per_sample_seeds_are_reproducible(self, engine):
        def draw(seed: int) -> list[list[int]]:
            (samples,) = engine.generate_batch([request(PROMPTS[0], n=4, max_tokens=8, seed=seed)])
            return [t.response_ids for t in samples]

        first = draw(7)
        assert len(set(map(tuple, first))) > 1  # each sample its own seed
        assert draw(7) == first
        mixed = engine.generate_batch([request(PROMPTS[2], n=2, max_tokens=8, seed=1),
                                       request(PROMPTS[0], n=4, max_tokens=8, seed=7)])
        assert [t.response_ids for t in mixed[1]] == first  # batched with others: same tokens
        assert draw(8) != first

    def test_weight_update_makes_greedy_outputs_those_of_the_new_model(self, engine, reference_model):
        new = make_model(seed=1)
        before = greedy(engine, PROMPTS[3])
        try:
            engine.update_weights(new.state_dict().items())
            after = greedy(engine, PROMPTS[3])
            assert after.response_ids == reference_greedy(new, PROMPTS[3], 8) != before.response_ids
            assert torch.allclose(torch.tensor(after.rollout_logprobs), reference_logprobs(new, after, 1.0),
                                  atol=FP32_TOLERANCE, rtol=0)
            with engine.weight_update() as apply:  # in buckets, as a broadcast sync applies them
                items = list(reference_model.state_dict().items())
                apply(items[: len(items) // 2])
                apply(items[len(items) // 2 :])
            assert greedy(engine, PROMPTS[3]).response_ids == before.response_ids
        finally:
            engine.update_weights(reference_model.state_dict().items())

    def test_a_manifest_mismatch_is_refused_before_any_data_moves(self, engine, monkeypatch):
        before = greedy(engine, PROMPTS[1])
        calls: list[object] = []
        monkeypatch.setattr(engine._llm, "collective_rpc", lambda *a, **k: calls.append(a))
        with pytest.raises(ValueError, match=r"unknown parameter 'model.norm.weights'"):
            with engine.weight_update() as apply:
                apply([("model.norm.weight", torch.ones(128)), ("model.norm.weights", torch.ones(128))])
        with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(128,\) in the rollout model"):
            engine.update_weights([("model.norm.weight", torch.ones(64))])
        assert calls == []
        monkeypatch.undo()
        assert greedy(engine, PROMPTS[1]).response_ids == before.response_ids  # nothing was loaded

    def test_sleep_level_1_frees_the_kv_cache_and_wake_up_restores_generation(self, engine):
        seeded = request(PROMPTS[0], n=2, max_tokens=8, seed=3)
        before = [t.response_ids for t in engine.generate_batch([seeded])[0]]
        kv_bytes, _ = pool_bytes("kv_cache")
        weight_bytes, _ = pool_bytes("weights")
        assert kv_bytes > 0 and weight_bytes > 0
        awake = free_gpu_bytes()
        engine.sleep(1)
        try:
            asleep = free_gpu_bytes()
            print(f"\nsleep(1) freed {(asleep - awake) / 2**30:.2f} GiB (KV cache {kv_bytes / 2**30:.2f} GiB)")
            assert asleep - awake >= 0.9 * kv_bytes
            assert pool_bytes("weights") == (weight_bytes, weight_bytes)  # level 1 keeps the weights on the host
            with pytest.raises(RuntimeError, match="asleep: call wake_up"):
                engine.generate_batch([seeded])
        finally:
            engine.wake_up()
        assert free_gpu_bytes() < asleep
        assert [t.response_ids for t in engine.generate_batch([seeded])[0]] == before

    def test_sleep_level_2_discards_the_weights_and_an_update_restores_generation(self, engine, reference_model):
        """Last in the class: after it, the engine holds the reference weights again only by the update."""
        seeded = request(PROMPTS[1], n=2, max_tokens=8, seed=4)
        before = [t.response_ids for t in engine.generate_batch([seeded])[0]]
        kv_bytes, _ = pool_bytes("kv_cache")
        weight_bytes, _ = pool_bytes("weights")
        awake = free_gpu_bytes()
        engine.sleep(2)
        try:
            asleep = free_gpu_bytes()
            print(f"\nsleep(2) freed {(asleep - awake) / 2**30:.2f} GiB "
                  f"(KV cache {kv_bytes / 2**30:.2f} GiB, weights {weight_bytes / 2**30:.4f} GiB)")
            assert asleep - awake >= 0.9 * (kv_bytes + weight_bytes)
            assert pool_bytes("weights") == (weight_bytes, 0)  # level 2: no host copy of the weights
        finally:
            engine.wake_up()
        engine.update_weights(reference_model.state_dict().items())  # the trainer's sync after a level-2 sleep
        for prompt in PROMPTS:
            assert greedy(engine, prompt, 10).response_ids == reference_greedy(reference_model, prompt, 10)
        again = engine.generate_batch([seeded])[0]
        assert [t.response_ids for t in again] == before
        for t in again:
            assert torch.allclose(torch.tensor(t.rollout_logprobs), reference_logprobs(reference_model, t, 1.0),
                                  atol=FP32_TOLERANCE, rtol=0)


class TestBfloat16:
    """The same checkpoint served in bf16: logprobs within the documented looser tolerance."""

    @pytest.fixture(scope="class")
    def engine(self, model_dir) -> Iterator[base.RolloutEngine]:
        engine = build_engine(model_dir, dtype="bfloat16")
        yield engine
        shut_down(engine)

    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_rollout_logprobs_are_within_the_bf16_tolerance(self, engine, bf16_reference, temperature):
        assert_logprobs_match(engine, bf16_reference, temperature, dtype="bfloat16")


# ------------------------------------------------------------------ throughput

BATCH, PROMPT_TOKENS, MAX_TOKENS, REPEATS = 256, 32, 128, 3


def qwen25_05b_shaped_model() -> Qwen2ForCausalLM:
    """Random weights in Qwen2.5-0.5B's shape (tied embeddings), context long enough for the run."""
    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=PROMPT_TOKENS + MAX_TOKENS, tie_word_embeddings=True,
        eos_token_id=EOS, pad_token_id=PAD,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).eval()


def decode_tokens_per_s(engine, prompts: list[list[int]]) -> float:
    """Decode rate without the prefill: ``batch x (max_tokens - 1) / (t_full - t_one)``, medians
    of REPEATS after a warm-up (as bench/rollout_gpu_decode.py measures the native engine)."""

    def run(max_tokens: int) -> float:
        requests = [request(p, max_tokens=max_tokens, ignore_eos=True, seed=i) for i, p in enumerate(prompts)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        results = engine.generate_batch(requests)
        torch.cuda.synchronize()
        assert all(len(t.response_ids) == max_tokens for (t,) in results)
        return time.perf_counter() - start

    run(MAX_TOKENS)  # warm-up: cache sizing, kernel selection, graph captures
    full = statistics.median(run(MAX_TOKENS) for _ in range(REPEATS))
    one = statistics.median(run(1) for _ in range(REPEATS))
    return len(prompts) * (MAX_TOKENS - 1) / (full - one)


@pytest.mark.slow
def test_decode_throughput_native_against_vllm_at_batch_256(tmp_path):
    """A figure, not a bound: prints decode tokens/s of both engines in bf16 and their ratio. Both
    run as hybridflow drives them: every sample seeded (vLLM samples seeded rows with per-request
    generators), prefix caching off (the prompts repeat across timed runs), CUDA graphs on."""
    from hybridflow.inference.native import NativeEngine

    require_free_pool()

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, PAD, (BATCH, PROMPT_TOKENS), generator=generator).tolist()
    model = qwen25_05b_shaped_model()
    model_dir = save_model(model.to(torch.bfloat16), tmp_path / "qwen2.5-0.5b-shaped")

    native = NativeEngine(model=model, eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=BATCH, device="cuda",
                          dtype=torch.bfloat16, decode_mode="cuda_graph", enable_prefix_caching=False)
    native_rate = decode_tokens_per_s(native, prompts)
    del native, model
    gc.collect()
    torch.cuda.empty_cache()

    vllm_engine = build_engine(model_dir, dtype="bfloat16", max_batch_size=BATCH, enable_prefix_caching=False)
    try:
        vllm_rate = decode_tokens_per_s(vllm_engine, prompts)
    finally:
        shut_down(vllm_engine)
    print(f"\n{torch.cuda.get_device_name()}: decode tokens/s at batch {BATCH} (prompt {PROMPT_TOKENS}, "
          f"{MAX_TOKENS} tokens, bf16, Qwen2.5-0.5B shape): native {native_rate:.0f}, vLLM {vllm_rate:.0f}, "
          f"native/vLLM {native_rate / vllm_rate:.2f}")
    assert native_rate > 0 and vllm_rate > 0

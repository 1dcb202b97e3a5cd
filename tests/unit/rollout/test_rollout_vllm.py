"""rollout.name=vllm: the vLLM engine against full-forward references on a tiny real Qwen2 model.

Tests marked ``vllm`` need vLLM (on a CPU its CPU build: ``scripts/test_vllm_cpu.sh`` installs it
into a fresh environment and runs ``pytest -m vllm``) and skip without it. The rest check what
must hold without vLLM: registration, the config-time checks, the rollout worker's meta model.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.models.tiny import build_tiny_tokenizer
from hybridflow.rollout import base, factory
from hybridflow.rollout.factory import ROLLOUT_ENGINES, EngineArgs, EngineSpec, engine_unavailable
from hybridflow.types import GenerationRequest, SamplingParams, Trajectory

EOS, PAD, VOCAB = 258, 256, 272
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42], [100, 101, 102, 103, 104]]
# fp32 on both sides; vLLM's CPU kernels (fused qkv, its attention) differ from HF's in the last bits.
LOGPROB_TOLERANCE = 1e-4


def make_model(seed: int = 0) -> Qwen2ForCausalLM:
    """A 2-layer random Qwen2 whose greedy output depends on the whole context (untied, wide init:
    the built-in tiny model greedily repeats its last token). Head size 32: one vLLM's CPU
    attention supports."""
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
        eos_token_id=EOS, pad_token_id=PAD,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).eval()


def save_model(model: Qwen2ForCausalLM, out: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out)
    return out


def request(prompt: list[int], **params) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(prompt), params=SamplingParams(**params))


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token == EOS:
            break
    return ids[len(prompt):]


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, trajectory: Trajectory, temperature: float) -> torch.Tensor:
    """Teacher-forced log_softmax(logits / T) of each response token: what the trainer computes."""
    ids = torch.tensor([trajectory.prompt_ids + trajectory.response_ids])
    logits = model(ids).logits[0, len(trajectory.prompt_ids) - 1 : -1]
    response = torch.tensor(trajectory.response_ids)
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, response[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def reference_model() -> Qwen2ForCausalLM:
    return make_model()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, reference_model) -> Path:
    return save_model(reference_model, tmp_path_factory.mktemp("vllm") / "model")


@pytest.fixture(scope="module")
def engine(model_dir):
    """One engine for the module (vLLM takes seconds to start); tests leave its weights as found."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install_vllm_cpu.sh)")
    if engine_unavailable("vllm", "cpu") is not None:
        pytest.skip(engine_unavailable("vllm", "cpu"))
    from hybridflow.models.loading import meta_causal_lm

    built = factory.build_rollout_engine(
        "vllm", EngineArgs(model=meta_causal_lm(model_dir), eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=16,
                           device="cpu", dtype="float32", seed=0, enforce_eager=True, model_path=str(model_dir)),
    )
    yield built
    built.close()


# ------------------------------------------------------------------ generation


@pytest.mark.vllm
def test_generates_n_samples_from_token_ids(engine):
    (samples,) = engine.generate_batch([request(PROMPTS[1], n=4, max_tokens=6, seed=1)])
    assert len(samples) == 4
    for t in samples:
        assert t.prompt_ids == PROMPTS[1]
        assert 1 <= len(t.response_ids) <= 6 and all(0 <= x < VOCAB for x in t.response_ids)
        assert t.loss_mask == [1] * len(t.response_ids)
        assert len(t.rollout_logprobs) == len(t.response_ids)
        assert t.finish_reason in ("stop", "length")
    assert len({tuple(t.response_ids) for t in samples}) > 1  # each sample its own seed


@pytest.mark.vllm
def test_same_seed_same_tokens_and_other_seeds_differ(engine):
    def draw(seed: int) -> list[list[int]]:
        return [t.response_ids for t in engine.generate_batch([request(PROMPTS[0], n=3, max_tokens=8, seed=seed)])[0]]

    first = draw(7)
    assert draw(7) == first
    # Batched with other requests, the same seed still gives the same tokens.
    mixed = engine.generate_batch([request(PROMPTS[2], n=2, max_tokens=8, seed=1),
                                   request(PROMPTS[0], n=3, max_tokens=8, seed=7)])
    assert [t.response_ids for t in mixed[1]] == first
    assert draw(8) != first


@pytest.mark.vllm
def test_greedy_equals_the_full_forward_reference(engine, reference_model):
    results = engine.generate_batch([request(p, temperature=0.0, max_tokens=10) for p in PROMPTS])
    for prompt, (t,) in zip(PROMPTS, results, strict=True):
        assert t.response_ids == reference_greedy(reference_model, prompt, 10)


@pytest.mark.vllm
def test_stop_token_ids_end_a_sample_and_max_tokens_ends_it_by_length(engine, reference_model):
    greedy = reference_greedy(reference_model, PROMPTS[1], 8)
    stop = greedy[3]
    (t,) = engine.generate_batch([request(PROMPTS[1], temperature=0.0, max_tokens=8, stop_token_ids=[stop])])[0]
    assert t.response_ids == greedy[: greedy.index(stop) + 1]
    assert (t.finish_reason, t.stop_reason) == ("stop", stop)
    (t,) = engine.generate_batch([request(PROMPTS[1], max_tokens=5, ignore_eos=True, seed=3)])[0]
    assert (len(t.response_ids), t.finish_reason) == (5, "length")


@pytest.mark.vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_equal_the_trainers_recomputation(engine, reference_model, temperature):
    results = engine.generate_batch([request(p, n=2, temperature=temperature, max_tokens=12, seed=i)
                                     for i, p in enumerate(PROMPTS)])
    for samples in results:
        for t in samples:
            expected = reference_logprobs(reference_model, t, temperature)
            got = torch.tensor(t.rollout_logprobs)
            assert torch.allclose(got, expected, atol=LOGPROB_TOLERANCE, rtol=0), (got - expected).abs().max()


@pytest.mark.vllm
def test_greedy_logprobs_use_temperature_one_and_top_logprobs_come_along(engine, reference_model):
    (t,) = engine.generate_batch([request(PROMPTS[0], temperature=0.0, max_tokens=6, logprobs=3)])[0]
    expected = reference_logprobs(reference_model, t, 1.0)
    assert torch.allclose(torch.tensor(t.rollout_logprobs), expected, atol=LOGPROB_TOLERANCE, rtol=0)
    assert t.top_logprobs is not None and len(t.top_logprobs) == len(t.response_ids)
    for token, top, lp in zip(t.response_ids, t.top_logprobs, t.rollout_logprobs, strict=True):
        assert len(top) >= 3 and top[token] == pytest.approx(lp)  # greedy: the sampled token is the top one


@pytest.mark.vllm
def test_seeded_prompts_beyond_one_steps_token_budget(engine):
    """More prompt tokens than one step takes (2048): on a CPU vLLM must not split a seeded
    prompt over steps (its generator rewind fails there), so they wait for the next step whole."""
    prompts = [[(7 * i + j) % 250 for j in range(200)] for i in range(14)]
    results = engine.generate_batch([request(p, max_tokens=3, seed=i) for i, p in enumerate(prompts)])
    assert all(1 <= len(t.response_ids) <= 3 for (t,) in results)
    alone = engine.generate_batch([request(prompts[9], max_tokens=3, seed=9)])[0][0]
    assert results[9][0].response_ids == alone.response_ids


@pytest.mark.vllm
def test_concurrent_generate_calls_share_steps_and_match_generate_batch(engine):
    requests = [request(p, n=2, max_tokens=6, seed=10 + i) for i, p in enumerate(PROMPTS)]

    async def concurrently() -> list[list[Trajectory]]:
        return list(await asyncio.gather(*(engine.generate(r) for r in requests)))

    together = asyncio.run(concurrently())
    batched = engine.generate_batch(requests)
    assert [[t.response_ids for t in g] for g in together] == [[t.response_ids for t in g] for g in batched]


@pytest.mark.vllm
def test_a_cancelled_caller_leaves_the_others_served(engine):
    keep_request = request(PROMPTS[0], max_tokens=6, seed=1)

    async def one_cancelled() -> list[Trajectory]:
        keep = asyncio.ensure_future(engine.generate(keep_request))
        drop = asyncio.ensure_future(engine.generate(request(PROMPTS[1], n=3, max_tokens=50, ignore_eos=True)))
        await asyncio.sleep(0)  # both requests are in; the driver task has started
        drop.cancel()
        return await keep

    kept = asyncio.run(one_cancelled())
    assert [t.response_ids for t in kept] == [t.response_ids for t in engine.generate_batch([keep_request])[0]]
    assert engine._pending == {}  # the cancelled request's samples were aborted


# ------------------------------------------------------------------ weights


@pytest.mark.vllm
def test_weight_update_makes_outputs_those_of_the_new_weights(engine, reference_model):
    new = make_model(seed=1)
    before = engine.generate_batch([request(PROMPTS[3], temperature=0.0, max_tokens=8)])[0][0]
    try:
        engine.update_weights(new.state_dict().items())
        (t,) = engine.generate_batch([request(PROMPTS[3], temperature=0.0, max_tokens=8)])[0]
        assert t.response_ids == reference_greedy(new, PROMPTS[3], 8) != before.response_ids
        assert torch.allclose(torch.tensor(t.rollout_logprobs), reference_logprobs(new, t, 1.0),
                              atol=LOGPROB_TOLERANCE, rtol=0)
        # Bucket by bucket, as a broadcast sync applies it: no step in between, same result.
        with engine.weight_update() as apply:
            items = list(reference_model.state_dict().items())
            apply(items[: len(items) // 2])
            apply(items[len(items) // 2 :])
        (t,) = engine.generate_batch([request(PROMPTS[3], temperature=0.0, max_tokens=8)])[0]
        assert t.response_ids == before.response_ids
    finally:
        engine.update_weights(reference_model.state_dict().items())


@pytest.mark.vllm
def test_a_bucket_with_an_unknown_name_or_wrong_shape_is_refused_before_any_data_moves(engine, monkeypatch):
    calls: list[object] = []
    monkeypatch.setattr(engine._llm, "collective_rpc", lambda *a, **k: calls.append(a))
    good = ("model.norm.weight", torch.ones(128))
    with pytest.raises(ValueError, match=r"unknown parameter 'model.norm.weights'; did you mean 'model.norm.weight'"):
        with engine.weight_update() as apply:
            apply([good, ("model.norm.weights", torch.ones(128))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(128,\) in the rollout model but \(64,\)"):
        engine.update_weights([("model.norm.weight", torch.ones(64))])
    assert calls == []  # the whole bucket is checked before vLLM is touched


# ------------------------------------------------------------------ sleep


@pytest.mark.vllm
def test_sleep_refuses_requests_until_wake_up(engine):
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        engine.sleep(3)
    before = engine.generate_batch([request(PROMPTS[0], max_tokens=4, seed=2)])[0][0].response_ids
    for level in (1, 2):
        engine.sleep(level)
        with pytest.raises(RuntimeError, match="asleep: call wake_up"):
            engine.generate_batch([request(PROMPTS[0], max_tokens=4)])
        engine.wake_up()
        assert engine.generate_batch([request(PROMPTS[0], max_tokens=4, seed=2)])[0][0].response_ids == before
    engine.wake_up()  # waking an awake engine is harmless


# ------------------------------------------------------------------ without vLLM


def test_vllm_is_registered_as_loading_its_own_weights():
    spec = ROLLOUT_ENGINES["vllm"]
    assert (spec.package, spec.extra, spec.loads_own_weights) == ("vllm", "vllm-cpu", True)


def test_availability_tells_the_cpu_build_from_a_gpu_build_without_importing_vllm(monkeypatch):
    monkeypatch.setattr(factory, "_has_distribution", lambda name: name == "vllm-cpu")
    assert factory._vllm_available(torch.device("cpu")) is None
    assert "pip install 'hybridflow[vllm]'" in factory._vllm_available(torch.device("cuda"))
    monkeypatch.setattr(factory, "_has_distribution", lambda name: False)
    assert "bash scripts/install_vllm_cpu.sh" in factory._vllm_available(torch.device("cpu"))
    assert factory._vllm_available(torch.device("cuda")) is None


def test_a_missing_vllm_names_the_install_script(monkeypatch):
    monkeypatch.setattr(factory.importlib.util, "find_spec", lambda name: None)
    message = engine_unavailable("vllm", "cpu")
    assert message is not None and "bash scripts/install_vllm_cpu.sh" in message


@pytest.mark.parametrize(("overrides", "match"), [
    (["rollout.top_p=0.9"], "rollout.name=vllm reports logprobs after top-p/top-k filtering"),
    (["rollout.top_k=20"], "use rollout.top_p=1 and rollout.top_k=-1, or rollout.name=native"),
    (["trainer.n_workers=2"], "would start 2 rollout replicas"),
])
def test_unsupported_vllm_settings_are_config_errors(overrides, match):
    from hybridflow.api import make_config
    from hybridflow.config import ConfigError
    from hybridflow.config.validate import validate_config

    with pytest.raises(ConfigError, match=match):
        validate_config(make_config(overrides=["rollout.name=vllm", *overrides]))


def test_the_rollout_worker_builds_a_meta_model_for_an_engine_that_loads_its_own(monkeypatch, model_dir):
    from hybridflow.workers.rollout import RolloutSetup, RolloutWorker

    seen: dict[str, object] = {}

    def build(args: EngineArgs) -> object:
        seen.update(vars(args))
        return object()

    monkeypatch.setitem(ROLLOUT_ENGINES, "own", EngineSpec(build=build, loads_own_weights=True))
    setup = RolloutSetup(model_path=str(model_dir), engine="own", dtype="auto", device=torch.device("cpu"),
                         max_batch_size=4, seed=0)
    worker = RolloutWorker(0, 1, setup)
    model = seen["model"]
    assert isinstance(model, torch.nn.Module) and worker.model is model
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert seen["model_path"] == str(model_dir) and seen["dtype"] == "float32"

"""Partial rollout in NativeEngine: a weight update lands while samples are being generated.

Every token records the policy version that produced it, samples in flight continue from the
tokens they have, and (by default) their keys and values are recomputed under the new weights, so
each token's rollout logprob is exactly that of its own version over the whole context, checked
against plain Hugging Face forwards of the two models. The update is triggered deterministically
from a token listener, which runs on the event-loop thread between two steps.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.inference.native import NativeEngine, TokenEvent
from hybridflow.types import UNVERSIONED_TOKEN, GenerationRequest, SamplingParams, Trajectory

torch.set_num_threads(1)

EOS, PAD, VOCAB = 258, 256, 272

OLD, NEW = 1, 2  # the policy versions the "trainer" gives its two weight updates
SWITCH_AFTER = 5  # tokens of the listened sample generated under OLD before the update lands
MAX_TOKENS = 16
PROMPT = [5, 6, 7, 8, 9, 10, 11]
LONG_PROMPT = list(range(20, 50))  # 30 tokens: prefilled in chunks of 4 over several steps
ATOL = 1e-5  # fp32, as the engine's other logprob-parity tests


def make_model(seed: int) -> torch.nn.Module:
    """A 2-layer random Qwen2 (untied, wide init: its outputs depend on the whole context, as in
    test_rollout_native_engine); two seeds give two policy versions."""
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
        initializer_range=0.2, eos_token_id=EOS, pad_token_id=PAD,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).eval()


def make_engine(**kwargs) -> NativeEngine:
    options = {"eos_token_ids": [EOS], "pad_token_id": PAD, "max_batch_size": 8, "seed": 0}
    options.update(kwargs)
    engine = NativeEngine(model=make_model(seed=0), **options)
    engine.update_weights(make_model(seed=0).state_dict().items(), version=OLD)  # the trainer's first sync
    return engine


def request(prompt: list[int], request_id: str, **params) -> GenerationRequest:
    params = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "seed": 3, **params}
    return GenerationRequest(prompt_ids=list(prompt), params=SamplingParams(**params), request_id=request_id)


@pytest.fixture(scope="module")
def models() -> dict[int, torch.nn.Module]:
    """The plain HF models of each version (the engine owns and fuses its own copy)."""
    return {OLD: make_model(seed=0), NEW: make_model(seed=1)}


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, trajectory: Trajectory) -> torch.Tensor:
    """log_softmax of each response token under ``model`` over the full prefix (temperature 1)."""
    ids = torch.tensor([trajectory.prompt_ids + trajectory.response_ids])
    logits = model(ids).logits[0, len(trajectory.prompt_ids) - 1 : -1]
    response = torch.tensor(trajectory.response_ids)
    return torch.log_softmax(logits, dim=-1).gather(-1, response[:, None]).squeeze(-1)


def expected_logprobs(models: dict[int, torch.nn.Module], trajectory: Trajectory) -> torch.Tensor:
    """Each token's logprob under the weights of the version it records."""
    assert trajectory.token_versions is not None
    per_version = {version: reference_logprobs(model, trajectory) for version, model in models.items()}
    return torch.stack([per_version[v][i] for i, v in enumerate(trajectory.token_versions)])


def assert_exact(models: dict[int, torch.nn.Module], trajectory: Trajectory) -> None:
    got, expected = torch.tensor(trajectory.rollout_logprobs), expected_logprobs(models, trajectory)
    assert torch.allclose(got, expected, atol=ATOL, rtol=0), (got - expected).abs().max()


def run_with_update(
    engine: NativeEngine, first: list[GenerationRequest], late: list[GenerationRequest] = ()
) -> tuple[list[list[Trajectory]], list[list[Trajectory]], list[TokenEvent]]:
    """Serve ``first``; once sample 0 of ``first[0]`` has ``SWITCH_AFTER`` tokens, update the
    weights to version NEW (from its token listener), then submit ``late``."""
    events: list[TokenEvent] = []
    new_weights = make_model(seed=1).state_dict()

    async def main() -> tuple[list[list[Trajectory]], list[list[Trajectory]]]:
        switched = asyncio.Event()

        def listener(event: TokenEvent) -> None:
            events.append(event)
            produced = sum(1 for e in events if e.sample_index == 0)
            if event.sample_index == 0 and produced == SWITCH_AFTER and not switched.is_set():
                engine.update_weights(new_weights.items(), version=NEW)
                switched.set()

        engine.add_token_listener(first[0].request_id, listener)
        running = asyncio.gather(*(engine.generate(r) for r in first))
        await switched.wait()
        late_results = await asyncio.gather(*(engine.generate(r) for r in late))
        return await running, list(late_results)

    first_results, late_results = asyncio.run(main())
    return first_results, late_results, events


def test_without_an_update_every_token_carries_the_one_version(models):
    engine = make_engine()
    assert engine.policy_version == OLD
    results = engine.generate_batch([request(PROMPT, "a", n=2), request([42], "b")])
    for trajectories in results:
        for trajectory in trajectories:
            assert trajectory.token_versions == [OLD] * MAX_TOKENS
            assert_exact({OLD: models[OLD]}, trajectory)
    assert engine.stats.recomputed_tokens == 0


def test_an_update_without_a_version_counts_on_from_the_last_one():
    engine = make_engine()
    engine.update_weights(make_model(seed=1).state_dict().items())
    assert engine.policy_version == OLD + 1
    with engine.weight_update(version=7) as apply:
        apply(list(make_model(seed=1).state_dict().items()))
    ((trajectory,),) = engine.generate_batch([request(PROMPT, "a", max_tokens=3)])
    assert trajectory.token_versions == [7, 7, 7]


def test_samples_in_flight_continue_under_the_new_weights_with_exact_logprobs(models):
    engine = make_engine()
    (running,), (late,), events = run_with_update(engine, [request(PROMPT, "a", n=2)], [request(PROMPT, "late")])
    for trajectory in running:
        # Continued, not restarted: one trajectory of MAX_TOKENS tokens spanning both versions.
        assert len(trajectory.response_ids) == MAX_TOKENS and trajectory.finish_reason == "length"
        assert trajectory.token_versions == [OLD] * SWITCH_AFTER + [NEW] * (MAX_TOKENS - SWITCH_AFTER)
        assert_exact(models, trajectory)
    # The versions were streamed with the tokens too.
    assert [e.policy_version for e in events if e.sample_index == 0] == running[0].token_versions
    # Both running rows were re-prefilled once: prompt and tokens so far, all but the one they feed next.
    assert engine.stats.recomputed_tokens == 2 * (len(PROMPT) - 1 + SWITCH_AFTER)
    # A request admitted after the update is all NEW, as if the engine had always had those weights.
    (trajectory,) = late
    assert trajectory.token_versions == [NEW] * MAX_TOKENS
    assert_exact(models, trajectory)
    fresh = NativeEngine(model=make_model(seed=1), eos_token_ids=[EOS], pad_token_id=PAD, max_batch_size=8)
    ((alone,),) = fresh.generate_batch([request(PROMPT, "late")])
    assert alone.response_ids == trajectory.response_ids


def test_a_prompt_prefilled_under_the_old_weights_is_prefilled_again_once_for_its_waiting_samples(models):
    # Two rows: samples 2 and 3 wait, their prompt prefilled under OLD, until 0 and 1 finish.
    engine = make_engine(max_batch_size=2)
    ((samples,), _, _) = run_with_update(engine, [request(PROMPT, "a", n=4)])
    for trajectory in samples[:2]:
        assert trajectory.token_versions == [OLD] * SWITCH_AFTER + [NEW] * (MAX_TOKENS - SWITCH_AFTER)
    for trajectory in samples[2:]:
        assert trajectory.token_versions == [NEW] * MAX_TOKENS
    for trajectory in samples:
        assert_exact(models, trajectory)
    # The two running rows, then the prompt slot once (not once per waiting sample).
    assert engine.stats.recomputed_tokens == 2 * (len(PROMPT) - 1 + SWITCH_AFTER) + len(PROMPT) - 1


def test_a_prompt_being_prefilled_in_chunks_starts_again_under_the_new_weights(models):
    # 4 prompt tokens a step: "long" (29 to prefill) is still prefilling when "a" has 5 tokens.
    engine = make_engine(max_prefill_tokens=4)
    ((running,), (long_sample,)), _, _ = run_with_update(
        engine, [request(PROMPT, "a"), request(LONG_PROMPT, "long")])
    assert running.token_versions == [OLD] * SWITCH_AFTER + [NEW] * (MAX_TOKENS - SWITCH_AFTER)
    assert long_sample.token_versions == [NEW] * MAX_TOKENS
    assert_exact(models, running)
    assert_exact(models, long_sample)
    # The running row (re-prefilled 4 tokens a forward), then the chunks "long" had done under OLD:
    # steps 1-2 prefill "a" (6 tokens) and "long"'s first 2, steps 3-6 decode "a" while "long"
    # gets 4 more tokens each, and the update lands after step 6, so 2 + 4 * 4 = 18.
    assert engine.stats.recomputed_tokens == (len(PROMPT) - 1 + SWITCH_AFTER) + 18


def test_keeping_the_old_keys_and_values_is_cheaper_and_not_exact(models):
    engine = make_engine(recompute_stale_kv=False)
    (running,), _, _ = run_with_update(engine, [request(PROMPT, "a", n=2)])
    assert engine.stats.recomputed_tokens == 0
    for trajectory in running:
        assert trajectory.token_versions == [OLD] * SWITCH_AFTER + [NEW] * (MAX_TOKENS - SWITCH_AFTER)
        got, expected = torch.tensor(trajectory.rollout_logprobs), expected_logprobs(models, trajectory)
        # Tokens before the update are exact; after it they attend over keys of the old weights.
        assert torch.allclose(got[:SWITCH_AFTER], expected[:SWITCH_AFTER], atol=ATOL, rtol=0)
        assert (got[SWITCH_AFTER:] - expected[SWITCH_AFTER:]).abs().max() > 1e-3


def test_trajectory_token_versions_must_align():
    Trajectory([1], [2, 3], [1, 0], [-0.1, 0.0], "stop", token_versions=[4, UNVERSIONED_TOKEN])
    with pytest.raises(ValueError, match="token versions"):
        Trajectory([1], [2, 3], [1, 1], [-0.1, -0.2], "stop", token_versions=[4])


def test_updates_from_another_thread_at_any_moment_keep_every_token_exact(models):
    """Updates land whenever they land (also between a step's planning and its forward): whatever
    the timing, each token's logprob is its own version's. Odd versions are OLD's weights, even
    ones NEW's."""
    engine = make_engine(max_batch_size=4, max_prefill_tokens=8)
    MAX_UPDATES = 20  # noqa: N806  (each one costs the next step a re-prefill)
    weights = {OLD: list(make_model(seed=0).state_dict().items()), NEW: list(make_model(seed=1).state_dict().items())}
    done = threading.Event()

    def updater() -> None:
        version = OLD
        while not done.is_set() and version < OLD + MAX_UPDATES:
            version += 1
            engine.update_weights(weights[OLD if version % 2 else NEW], version=version)
            time.sleep(0.005)

    thread = threading.Thread(target=updater)
    thread.start()
    try:
        requests = [request(PROMPT, "a", n=3, max_tokens=24), request(LONG_PROMPT, "long", n=2, max_tokens=24),
                    request([42], "short", max_tokens=24)]
        results = engine.generate_batch(requests)
    finally:
        done.set()
        thread.join()
    seen: set[int] = set()
    for trajectories in results:
        for trajectory in trajectories:
            assert trajectory.token_versions is not None
            seen.update(trajectory.token_versions)
            by_weights = Trajectory(**{**trajectory.__dict__, "token_versions": [
                OLD if v % 2 else NEW for v in trajectory.token_versions]})
            assert_exact(models, by_weights)
    assert len(seen) > 2  # several updates landed mid-flight

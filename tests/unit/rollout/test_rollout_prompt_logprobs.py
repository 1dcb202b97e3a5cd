"""The native engine's prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's): every prompt position's
logprob of the prompt's own next token, its rank and the top k, equal to an HF forward's log_softmax in float32,
whether the prompt is prefilled in one forward, in chunks over several steps beside running decodes, or after its
prefix is already in the prefix cache (a scoring request prefills its whole prompt)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridflow.types import PromptLogprobs, SamplingParams, Trajectory

from test_rollout_native_engine import PROMPTS, make_engine, make_model, request

torch.set_num_threads(1)

LONG_PROMPT = [(11 * i + 5) % 250 for i in range(41)]
TOLERANCE = 1e-5  # fp32 compact forward vs HF's (the engine's own parity bound is 1e-4 on logits)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_model()


@torch.no_grad()
def hf_prompt_scores(model: torch.nn.Module, prompt: list[int], top: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """log_softmax of an HF forward over the prompt: each next token's logprob, rank, and the top ``top`` values."""
    logprobs = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)  # (P - 1, V)
    chosen = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    return chosen[:, 0], ranks, logprobs.topk(max(top, 1), dim=-1).values[:, :top]


def check(model: torch.nn.Module, prompt: list[int], scored: PromptLogprobs | None, top: int) -> None:
    assert scored is not None
    expected, ranks, top_values = hf_prompt_scores(model, prompt, top)
    assert len(scored.token_logprobs) == len(prompt) - 1
    torch.testing.assert_close(torch.tensor(scored.token_logprobs), expected, rtol=0, atol=TOLERANCE)
    assert scored.ranks == ranks
    if top:
        assert scored.top is not None and all(len(t) == top for t in scored.top)
        got = torch.tensor([sorted(t.values(), reverse=True) for t in scored.top]).reshape(-1, top)
        torch.testing.assert_close(got, top_values, rtol=0, atol=TOLERANCE)
    else:
        assert scored.top is None


@pytest.mark.parametrize("top", [0, 3])
def test_prompt_logprobs_equal_an_hf_forward_at_every_position(model, top):
    engine = make_engine(model=make_model())
    prompts = PROMPTS + [LONG_PROMPT]
    results = engine.generate_batch([request(p, n=2, temperature=1.0, max_tokens=3, prompt_logprobs=top)
                                     for p in prompts])
    for prompt, samples in zip(prompts, results, strict=True):
        for sample in samples:  # every sample of the request carries its prompt's scores
            check(model, prompt, sample.prompt_logprobs, top)
    assert engine.generate_batch([request(PROMPTS[0], max_tokens=2)])[0][0].prompt_logprobs is None  # not asked


def test_a_prompt_prefilled_in_chunks_beside_a_running_decode_is_scored_whole(model):
    engine = make_engine(model=make_model(), max_prefill_tokens=4)

    async def main() -> tuple[list[Trajectory], list[Trajectory]]:
        first = asyncio.ensure_future(engine.generate(request(PROMPTS[0], temperature=0.0, max_tokens=30)))
        while engine.stats.steps < 2:
            await asyncio.sleep(0.001)
        second = await engine.generate(request(LONG_PROMPT, temperature=0.0, max_tokens=2, prompt_logprobs=2))
        return await first, second

    first, second = asyncio.run(main())
    assert engine.stats.prefill_forwards >= 1 + 10  # 40 prefix tokens in chunks of 4: scored over 10 steps
    check(model, LONG_PROMPT, second[0].prompt_logprobs, 2)
    assert first[0].prompt_logprobs is None


def test_a_cached_prefix_is_prefilled_again_to_be_scored(model):
    engine = make_engine(model=make_model())
    engine.generate_batch([request(LONG_PROMPT, temperature=0.0, max_tokens=2)])  # caches the prompt's blocks
    hits = engine.stats.prefix_cache_hit_tokens
    engine.generate_batch([request(LONG_PROMPT, temperature=0.0, max_tokens=2)])
    assert engine.stats.prefix_cache_hit_tokens > hits  # the prefix is cached indeed
    hits, prefilled = engine.stats.prefix_cache_hit_tokens, engine.stats.prefill_tokens
    (scored,), = engine.generate_batch([request(LONG_PROMPT, temperature=0.0, max_tokens=2, prompt_logprobs=0)])
    assert engine.stats.prefix_cache_hit_tokens == hits  # no lookup: its whole prompt is prefilled and scored
    assert engine.stats.prefill_tokens - prefilled == len(LONG_PROMPT) - 1
    check(model, LONG_PROMPT, scored.prompt_logprobs, 0)


def test_a_one_token_prompt_has_nothing_to_score_and_bad_values_are_refused():
    engine = make_engine()
    (sample,), = engine.generate_batch([request([7], max_tokens=2, prompt_logprobs=0)])
    assert sample.prompt_logprobs == PromptLogprobs([], [], None)
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        engine.generate_batch([request([1, 2], max_tokens=2, prompt_logprobs=10**6)])

"""Sampling functions alone: filters, penalties, logprob convention, counter-based randomness."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.inference.sampling import (
    SamplingTensors,
    _mul32,
    apply_repetition_penalty,
    check_sampling_params,
    compute_token_logprobs,
    compute_top_logprobs,
    counter_uniforms,
    derive_sample_seed,
    filter_min_p,
    filter_top_k_top_p,
    sample_tokens,
    split_key,
)
from hybridflow.types import SamplingParams

torch.set_num_threads(1)

INF = float("inf")


def _tensors(*params: SamplingParams, keys: list[int] | None = None, counters: list[int] | None = None) -> SamplingTensors:
    keys = keys if keys is not None else [derive_sample_seed(7, i) for i in range(len(params))]
    counters = counters if counters is not None else [0] * len(params)
    return SamplingTensors.from_params(list(params), keys, counters, "cpu")


def test_derive_sample_seed_is_stable_and_separates_neighbouring_seeds():
    assert derive_sample_seed(5, 2) == derive_sample_seed(5, 2)
    # Consecutive request seeds must not share streams across sample indices.
    assert derive_sample_seed(1, 0) != derive_sample_seed(0, 1)
    assert len({derive_sample_seed(s, j) for s in range(20) for j in range(20)}) == 400
    assert 0 <= derive_sample_seed(123, 7) < 2**64


def test_mul32_is_multiplication_modulo_two_to_the_32():
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 123456789, 3141592653]
    for constant in (0x7FEB352D, 0x846CA68B, 1, 0xFFFFFFFF):
        got = _mul32(torch.tensor(values, dtype=torch.long), constant).tolist()
        assert got == [(v * constant) % 2**32 for v in values]


def test_counter_uniforms_are_reproducible_distinct_and_in_range():
    keys = torch.tensor([split_key(derive_sample_seed(3, j)) for j in range(4)] * 2, dtype=torch.long)
    counters = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    first, again = counter_uniforms(keys, counters), counter_uniforms(keys, counters)
    assert torch.equal(first, again)
    assert len(set(first.tolist())) == 8  # each (key, counter) its own draw
    # One row's draw does not depend on its neighbours.
    assert counter_uniforms(keys[2:3], counters[2:3]).item() == first[2].item()


def test_counter_uniforms_are_uniform():
    # 20000 draws of one stream (one key, successive counters) and across keys: flat histograms.
    stream = counter_uniforms(torch.tensor([split_key(derive_sample_seed(0, 0))] * 20000), torch.arange(20000))
    across = counter_uniforms(
        torch.tensor([split_key(derive_sample_seed(s, 0)) for s in range(20000)]), torch.zeros(20000, dtype=torch.long)
    )
    for draws in (stream, across):
        assert draws.min() > 0 and draws.max() <= 1
        counts = torch.histc(draws, bins=10, min=0, max=1)
        assert counts.min() > 1800 and counts.max() < 2200  # expected 2000 per bin, sd ~42
        assert draws.mean().item() == pytest.approx(0.5, abs=0.01)


def test_filter_top_p_keeps_smallest_set_reaching_the_mass():
    # probs 0.5, 0.3, 0.15, 0.05 (shuffled in the vocabulary so the scatter-back is exercised).
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]] * 4)
    logits = probs.log()
    top_k = torch.full((4,), 10**9)
    top_p = torch.tensor([0.7, 0.79, 0.81, 1e-9])
    kept = filter_top_k_top_p(logits, top_k, top_p).isfinite()
    # 0.7 and 0.79: {0.5, 0.3} (0.5 alone falls short);
    # 0.81: adds 0.15; tiny: the most likely token only.
    assert kept.tolist() == [
        [False, True, False, True],
        [False, True, False, True],
        [True, True, False, True],
        [False, True, False, False],
    ]


def test_filter_top_k_then_top_p_and_kept_logits_unchanged():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [3.0, 1.0, 2.0, 0.0]])
    out = filter_top_k_top_p(logits, torch.tensor([2, 1]), torch.tensor([1.0, 1.0]))
    assert torch.equal(out[0], torch.tensor([3.0, -INF, 2.0, -INF]))
    assert torch.equal(out[1], torch.tensor([3.0, -INF, -INF, -INF]))
    # top_p applies to the top-k-renormalised distribution: softmax([3, 2]) = [0.731, 0.269].
    out = filter_top_k_top_p(logits[:1], torch.tensor([2]), torch.tensor([0.72]))
    assert torch.equal(out[0], torch.tensor([3.0, -INF, -INF, -INF]))


def test_filter_top_p_one_keeps_every_token_despite_rounding():
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)) * 10
    out = filter_top_k_top_p(logits, torch.full((3,), 10**9), torch.ones(3))
    assert torch.equal(out, logits)


def test_filter_min_p_is_relative_to_the_top_probability():
    # probs 0.5, 0.3, 0.15, 0.05: min_p 0.2 keeps p >= 0.1 (drops 0.05); 0.7 keeps p >= 0.35; 0 keeps all.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3).log()
    kept = filter_min_p(logits, torch.tensor([0.2, 0.7, 0.0])).isfinite()
    assert kept.tolist() == [[True, True, True, False], [True, False, False, False], [True, True, True, True]]


def test_repetition_penalty_matches_hugging_face():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(1))
    history = torch.tensor([[3, 5, 5, 7], [0, 1, 2, 11]])
    seen = torch.zeros(2, 12, dtype=torch.bool).scatter(1, history, True)
    got = apply_repetition_penalty(logits, seen, torch.tensor([1.3, 1.3]))
    want = RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    assert torch.allclose(got, want)


def test_logprob_is_temperature_scaled_and_unfiltered():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(temperature=0.7, top_k=2, repetition_penalty=1.5)
    seen = torch.tensor([[True, False, False, False]])
    tokens, logprobs = sample_tokens(logits, _tensors(params), seen=seen)
    token = int(tokens[0])
    assert token in (0, 1)  # top-k 2
    expected = torch.log_softmax(logits[0] / 0.7, dim=-1)[token]
    assert logprobs[0].item() == pytest.approx(expected.item(), abs=1e-6)
    # The renormalised (filtered) logprob differs: the convention is not that one.
    filtered = torch.log_softmax(logits[0, :2] / 0.7, dim=-1)[token]
    assert abs(logprobs[0].item() - filtered.item()) > 1e-2


def test_greedy_rows_take_argmax_with_temperature_one_logprob():
    logits = torch.tensor([[0.1, 2.0, 0.3], [1.5, 0.2, 0.1]])
    sampling = _tensors(SamplingParams(temperature=0.0), SamplingParams(greedy=True, temperature=0.5))
    assert sampling.all_greedy
    tokens, logprobs = sample_tokens(logits, sampling)
    assert tokens.tolist() == [1, 0]
    expected = torch.log_softmax(logits, dim=-1)[[0, 1], [1, 0]]
    assert torch.allclose(logprobs, expected)


def test_greedy_with_repetition_penalty_avoids_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    seen = torch.tensor([[True, False, False]])
    tokens, _ = sample_tokens(logits, _tensors(SamplingParams(temperature=0.0, repetition_penalty=1.2)), seen=seen)
    assert tokens.tolist() == [1]  # 2.0 / 1.2 < 1.9
    with pytest.raises(ValueError, match="seen-token mask"):
        sample_tokens(logits, _tensors(SamplingParams(temperature=0.0, repetition_penalty=1.2)))


def test_a_rows_draws_do_not_depend_on_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 50, generator=g)
    others = torch.randn(5, 50, generator=g)
    params = SamplingParams(temperature=1.0)
    key = derive_sample_seed(11, 0)
    alone = [int(sample_tokens(row, _tensors(params, keys=[key], counters=[t]))[0][0]) for t in range(20)]
    mixed = []
    batch = torch.cat([others[:2], row, others[2:]])
    rows = [SamplingParams(temperature=0.9)] * 2 + [params] + [SamplingParams(temperature=1.3, top_k=5)] * 3
    for step in range(20):
        keys = [derive_sample_seed(100 + step, i) for i in range(6)]  # the other rows change every call
        keys[2] = key
        tokens, _ = sample_tokens(batch, _tensors(*rows, keys=keys, counters=[step] * 6))
        mixed.append(int(tokens[2]))
    assert alone == mixed
    assert len(set(alone)) > 3  # it really sampled


def test_sampled_frequencies_follow_the_filtered_distribution():
    # 4000 rows with their own keys: the empirical frequencies of a top-k 2 row must match the
    # renormalised top-2 probabilities and never show a filtered-out token.
    logits = torch.tensor([1.0, 0.0, 0.5, -2.0]).repeat(4000, 1)
    keys = [derive_sample_seed(3, i) for i in range(4000)]
    sampling = _tensors(*[SamplingParams(temperature=1.0, top_k=2)] * 4000, keys=keys)
    tokens, _ = sample_tokens(logits, sampling)
    counts = torch.bincount(tokens, minlength=4).float() / 4000
    p0 = 1 / (1 + math.exp(-0.5))  # softmax([1.0, 0.5])[0]
    assert counts[1] == 0 and counts[3] == 0
    assert counts[0].item() == pytest.approx(p0, abs=0.03)


def test_unfiltered_frequencies_follow_softmax_at_the_temperature():
    logits = torch.tensor([1.0, 0.0, 0.5, -2.0])
    keys = [derive_sample_seed(4, i) for i in range(8000)]
    tokens, _ = sample_tokens(logits.repeat(8000, 1), _tensors(*[SamplingParams(temperature=0.5)] * 8000, keys=keys))
    counts = torch.bincount(tokens, minlength=4).float() / 8000
    assert torch.allclose(counts, torch.softmax(logits / 0.5, dim=-1), atol=0.02)


def test_adjust_changes_the_draw_but_not_the_logprob():
    logits = torch.tensor([[2.0, 1.0, 0.5]])

    def only_last(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([[-INF, -INF, 0.0]]).expand_as(x)

    tokens, logprobs = sample_tokens(logits, _tensors(SamplingParams(temperature=1.0)), adjust=only_last)
    assert tokens.tolist() == [2]
    assert logprobs.item() == pytest.approx(torch.log_softmax(logits[0], -1)[2].item(), abs=1e-6)


def test_compute_token_logprobs_matches_manual():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
    tokens = torch.tensor([0, 6, 3])
    temps = torch.tensor([1.0, 0.5, 2.0])
    got = compute_token_logprobs(logits, tokens, temps)
    for i in range(3):
        want = torch.log_softmax(logits[i] / temps[i], dim=-1)[tokens[i]]
        assert got[i].item() == pytest.approx(want.item(), abs=1e-6)


def test_compute_top_logprobs_are_the_largest_of_the_same_distribution():
    logits = torch.randn(2, 9, generator=torch.Generator().manual_seed(5))
    values, ids = compute_top_logprobs(logits, torch.tensor([1.0, 0.5]), 3)
    full = torch.log_softmax(logits / torch.tensor([[1.0], [0.5]]), dim=-1)
    want_values, want_ids = full.topk(3, dim=-1)
    assert torch.equal(ids, want_ids) and torch.allclose(values, want_values, atol=1e-6)


def test_flags_summarise_which_stages_rows_need():
    sampling = _tensors(SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.5, min_p=0.1))
    assert not sampling.all_greedy and sampling.any_greedy
    assert sampling.needs_filter and sampling.needs_min_p and not sampling.needs_penalty
    plain = _tensors(SamplingParams(temperature=0.8))
    assert not (plain.any_greedy or plain.needs_filter or plain.needs_min_p)
    assert plain.top_k.tolist() == [torch.iinfo(torch.long).max]  # -1 (off) stored as "no bound"
    with pytest.raises(ValueError, match="2 params, 1 keys"):
        SamplingTensors.from_params([SamplingParams()] * 2, [1], [0, 0], "cpu")


def test_check_sampling_params_names_the_field():
    check_sampling_params(SamplingParams(top_k=5, stop_token_ids=[1], min_p=0.1, logprobs=3), vocab_size=10)
    cases = [
        (SamplingParams(top_k=0), "top_k"),
        (SamplingParams(stop_token_ids=[1, 10]), r"stop_token_ids \[10\]"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(logprobs=11), "logprobs"),
        (SamplingParams(stop=["ok", ""]), "empty string"),
    ]
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            check_sampling_params(params, vocab_size=10)

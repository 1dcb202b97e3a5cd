"""Sampling functions alone: filters, logprob convention, per-row seeding, stop detection."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.rollout.sampling import (
    NO_STOP_TOKEN,
    SamplingTensors,
    check_sampling_params,
    compute_token_logprobs,
    derive_sample_seed,
    filter_top_k_top_p,
    is_stop_token,
    make_sample_generator,
    sample_tokens,
)
from hybridflow.types import SamplingParams

torch.set_num_threads(1)

INF = float("inf")


def _tensors(*params: SamplingParams, eos: tuple[int, ...] = ()) -> SamplingTensors:
    return SamplingTensors.from_params(list(params), list(eos), "cpu")


def test_derive_sample_seed_is_stable_and_separates_neighbouring_seeds():
    assert derive_sample_seed(5, 2) == derive_sample_seed(5, 2)
    # Consecutive request seeds must not share streams across sample indices.
    assert derive_sample_seed(1, 0) != derive_sample_seed(0, 1)
    assert len({derive_sample_seed(s, j) for s in range(20) for j in range(20)}) == 400
    assert 0 <= derive_sample_seed(123, 7) < 2**64


def test_make_sample_generator_reproduces_its_stream():
    a = torch.rand(5, generator=make_sample_generator(9, 3, "cpu"))
    b = torch.rand(5, generator=make_sample_generator(9, 3, "cpu"))
    c = torch.rand(5, generator=make_sample_generator(9, 4, "cpu"))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


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


def test_logprob_is_temperature_scaled_and_unfiltered():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    params = SamplingParams(temperature=0.7, top_k=2)
    tokens, logprobs = sample_tokens(logits, _tensors(params), [None], torch.Generator().manual_seed(0))
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
    tokens, logprobs = sample_tokens(logits, sampling, [None, None], torch.Generator())
    assert tokens.tolist() == [1, 0]
    expected = torch.log_softmax(logits, dim=-1)[[0, 1], [1, 0]]
    assert torch.allclose(logprobs, expected)


def test_seeded_row_draws_do_not_depend_on_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 50, generator=g)
    others = torch.randn(5, 50, generator=g)
    params = SamplingParams(temperature=1.0, seed=11)
    alone = []
    gen = make_sample_generator(11, 0, "cpu")
    for _ in range(20):
        alone.append(int(sample_tokens(row, _tensors(params), [gen], torch.Generator().manual_seed(1))[0][0]))
    mixed = []
    gen = make_sample_generator(11, 0, "cpu")
    batch = torch.cat([others[:2], row, others[2:]])
    rows = [SamplingParams(temperature=0.9)] * 2 + [params] + [SamplingParams(temperature=1.3, top_k=5)] * 3
    for step in range(20):
        shared = torch.Generator().manual_seed(100 + step)  # the shared stream differs every call
        tokens, _ = sample_tokens(batch, _tensors(*rows), [None, None, gen, None, None, None], shared)
        mixed.append(int(tokens[2]))
    assert alone == mixed
    assert len(set(alone)) > 3  # it really sampled


def test_sampled_frequencies_follow_the_filtered_distribution():
    # 4000 identical rows through one shared draw: the empirical frequencies of a top-k 2 row
    # must match the renormalised top-2 probabilities and never show a filtered-out token.
    logits = torch.tensor([1.0, 0.0, 0.5, -2.0]).repeat(4000, 1)
    sampling = _tensors(*[SamplingParams(temperature=1.0, top_k=2)] * 4000)
    tokens, _ = sample_tokens(logits, sampling, [None] * 4000, torch.Generator().manual_seed(3))
    counts = torch.bincount(tokens, minlength=4).float() / 4000
    p0 = 1 / (1 + math.exp(-0.5))  # softmax([1.0, 0.5])[0]
    assert counts[1] == 0 and counts[3] == 0
    assert counts[0].item() == pytest.approx(p0, abs=0.03)


def test_compute_token_logprobs_matches_manual():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
    tokens = torch.tensor([0, 6, 3])
    temps = torch.tensor([1.0, 0.5, 2.0])
    got = compute_token_logprobs(logits, tokens, temps)
    for i in range(3):
        want = torch.log_softmax(logits[i] / temps[i], dim=-1)[tokens[i]]
        assert got[i].item() == pytest.approx(want.item(), abs=1e-6)


def test_stop_tokens_merge_request_and_engine_ids_per_row():
    sampling = _tensors(SamplingParams(stop_token_ids=[7, 9]), SamplingParams(), eos=(3,))
    assert sampling.stop_token_ids.tolist() == [[3, 7, 9], [3, NO_STOP_TOKEN, NO_STOP_TOKEN]]
    assert is_stop_token(torch.tensor([9, 9]), sampling.stop_token_ids).tolist() == [True, False]
    assert is_stop_token(torch.tensor([3, 3]), sampling.stop_token_ids).tolist() == [True, True]


def test_select_narrows_rows_and_recomputes_all_greedy():
    sampling = _tensors(SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.5))
    assert not sampling.all_greedy and sampling.needs_filter
    first = sampling.select(torch.tensor([0]))
    assert first.batch_size == 1 and first.all_greedy
    second = sampling.select(torch.tensor([1]))
    assert second.top_p.tolist() == [0.5] and second.temperatures.tolist() == pytest.approx([0.8])


def test_check_sampling_params_names_the_field():
    check_sampling_params(SamplingParams(top_k=5, stop_token_ids=[1]), vocab_size=10)
    with pytest.raises(ValueError, match="top_k"):
        check_sampling_params(SamplingParams(top_k=0), vocab_size=10)
    with pytest.raises(ValueError, match=r"stop_token_ids \[10\]"):
        check_sampling_params(SamplingParams(stop_token_ids=[1, 10]), vocab_size=10)


def test_sample_tokens_rejects_misaligned_generators():
    with pytest.raises(ValueError, match="2 generators for 1 rows"):
        sample_tokens(torch.zeros(1, 4), _tensors(SamplingParams()), [None, None], torch.Generator())

"""Metric computations checked against numbers worked out by hand (and pass@k by enumeration)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from hybridflow.tracking import metrics as m
from hybridflow.tracking.metrics import (
    compute_batch_metrics,
    compute_throughput_metrics,
    compute_validation_metrics,
    pass_at_k,
    reduce_metrics,
)

torch.set_num_threads(1)


def _batch(**overrides):
    kwargs = dict(
        scores=torch.tensor([1.0, 0.0, 0.5, 0.5]),
        response_lengths=torch.tensor([3, 8, 8, 1]),
        prompt_lengths=torch.tensor([2, 4, 4, 6]),
        max_response_length=8,
        # Masked-out entries are +-100: if masking were ignored, max/min/mean would show it.
        advantages=torch.tensor(
            [[1.0, 2.0, 100.0], [-1.0, -100.0, -100.0], [0.5, 0.5, 0.5], [3.0, 100.0, -100.0]]
        ),
        response_mask=torch.tensor(
            [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
        ),
    )
    kwargs.update(overrides)
    return kwargs


def test_batch_metrics_hand_checked():
    got = compute_batch_metrics(**_batch())
    expected = {
        "critic/score/mean": 0.5,
        "critic/score/max": 1.0,
        "critic/score/min": 0.0,
        # valid tokens: 1, 2, -1, 0.5, 0.5, 0.5, 3  -> sum 6.5 over 7
        "critic/advantages/mean": 6.5 / 7,
        "critic/advantages/max": 3.0,
        "critic/advantages/min": -1.0,
        "response_length/mean": 5.0,
        "response_length/max": 8.0,
        "response_length/min": 1.0,
        "response_length/clip_ratio": 0.5,  # two of four reached 8
        "prompt_length/mean": 4.0,
        "prompt_length/max": 6.0,
        "prompt_length/min": 2.0,
    }
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
        assert isinstance(got[key], float), key


def test_batch_metrics_without_advantages_has_no_advantage_keys():
    got = compute_batch_metrics(**_batch(advantages=None))
    assert not any(k.startswith("critic/advantages/") for k in got)
    assert got[m.SCORE_MEAN] == pytest.approx(0.5)


def test_batch_metrics_empty_mask_gives_nan_advantages_not_zero():
    got = compute_batch_metrics(**_batch(response_mask=torch.zeros(4, 3)))
    for key in (m.ADVANTAGES_MEAN, m.ADVANTAGES_MAX, m.ADVANTAGES_MIN):
        assert math.isnan(got[key])


def test_batch_metrics_bool_mask_and_clip_ratio_zero():
    got = compute_batch_metrics(
        **_batch(response_mask=_batch()["response_mask"].bool(), max_response_length=9)
    )
    assert got[m.RESPONSE_LENGTH_CLIP_RATIO] == 0.0
    assert got[m.ADVANTAGES_MAX] == 3.0


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"response_lengths": torch.tensor([1, 2, 3])}, "response_lengths"),
        ({"prompt_lengths": torch.ones(4, 2)}, "prompt_lengths"),
        ({"response_mask": torch.ones(3, 3)}, "response_mask"),
        ({"advantages": torch.ones(4, 2)}, "advantages"),
        ({"scores": torch.tensor([])}, "scores"),
        ({"max_response_length": 0}, "max_response_length"),
    ],
)
def test_batch_metrics_shape_errors_name_the_argument(override, needle):
    with pytest.raises(ValueError, match=needle):
        compute_batch_metrics(**_batch(**override))


def test_throughput_metrics():
    got = compute_throughput_metrics(num_tokens=1000, step_time_s=2.0, n_gpus=4)
    assert got == {
        "perf/total_num_tokens": 1000,
        "perf/time_per_step": 2.0,
        "perf/throughput": 125.0,
    }


@pytest.mark.parametrize(
    "args, needle",
    [
        ((10, 0.0, 1), "step_time_s"),
        ((10, float("nan"), 1), "step_time_s"),
        ((10, 1.0, 0), "n_gpus"),
        ((-1, 1.0, 1), "num_tokens"),
    ],
)
def test_throughput_metrics_rejects_bad_inputs(args, needle):
    with pytest.raises(ValueError, match=needle):
        compute_throughput_metrics(*args)


def _pass_at_k_brute_force(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(
                _pass_at_k_brute_force(n, c, k), abs=1e-12
            ), (n, c, k)


def test_pass_at_k_is_not_the_biased_formula():
    # n=4, c=1, k=2: unbiased 1 - C(3,2)/C(4,2) = 0.5; the biased 1-(3/4)^2 = 0.4375.
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)


def test_pass_at_k_large_n_stays_finite():
    assert 0.0 < pass_at_k(2000, 3, 1000) < 1.0
    assert pass_at_k(2000, 3, 1) == pytest.approx(3 / 2000)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_validation_metrics_without_groups():
    got = compute_validation_metrics(["a", "a", "b"], [1.0, 0.0, 0.5])
    assert got == {
        "val/score/mean": pytest.approx(0.5),
        "val/a/score/mean": 0.5,
        "val/b/score/mean": 0.5,
    }


def test_validation_metrics_with_groups_hand_checked():
    sources = ["a"] * 8 + ["openai/gsm8k"] * 2
    scores = [1, 0, 1, 1, 0, 0, 0, 1, 0.2, 0.6]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    got = compute_validation_metrics(sources, scores, groups)
    expected = {
        "val/score/mean": 4.8 / 10,
        "val/a/score/mean": 0.5,
        "val/openai/gsm8k/score/mean": 0.4,
        # source a: n=4; group 0 has c=3, group 1 has c=1
        "val/a/score/mean@4": 0.5,
        "val/a/pass@1": (3 / 4 + 1 / 4) / 2,
        "val/a/pass@2": (1.0 + (1 - 3 / 6)) / 2,  # 1 - C(1,2)/C(4,2) = 1; 1 - C(3,2)/C(4,2)
        "val/a/pass@4": 1.0,
        # source openai/gsm8k: n=2; 0.6 > 0.5 is correct, 0.2 is not
        "val/openai/gsm8k/score/mean@2": 0.4,
        "val/openai/gsm8k/pass@1": 0.5,
        "val/openai/gsm8k/pass@2": 1.0,
    }
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key


def test_validation_metrics_k_ladder_stops_at_smallest_group():
    # groups of 6 and 3 samples: k = 1, 2, 3 (never 4: the 3-sample prompt cannot estimate it)
    got = compute_validation_metrics(["s"] * 9, [1.0] * 9, [0] * 6 + [1] * 3)
    assert sorted(k for k in got if "pass@" in k) == [
        "val/s/pass@1",
        "val/s/pass@2",
        "val/s/pass@3",
    ]
    assert "val/s/score/mean@3" in got


def test_validation_metrics_single_sample_groups_add_no_at_k():
    got = compute_validation_metrics(["a", "a"], [1.0, 0.0], [0, 1])
    assert not any("@" in key for key in got)


def test_validation_metrics_errors():
    with pytest.raises(ValueError, match="mixes data sources"):
        compute_validation_metrics(["a", "b"], [1.0, 0.0], [0, 0])
    with pytest.raises(ValueError, match="2 data sources but 1 scores"):
        compute_validation_metrics(["a", "b"], [1.0])
    with pytest.raises(ValueError, match="group ids"):
        compute_validation_metrics(["a"], [1.0], [0, 1])
    with pytest.raises(ValueError, match="no validation samples"):
        compute_validation_metrics([], [])


def test_reduce_metrics_means_over_dicts_that_have_the_key():
    got = reduce_metrics(
        [
            {"actor/pg_loss": 1.0, "actor/kl_loss": torch.tensor(2.0)},
            {"actor/pg_loss": np.float32(3.0)},
            {"actor/pg_loss": 5},
        ]
    )
    assert list(got) == ["actor/pg_loss", "actor/kl_loss"]
    assert got["actor/pg_loss"] == pytest.approx(3.0)
    assert got["actor/kl_loss"] == pytest.approx(2.0)
    assert reduce_metrics([]) == {}


def test_reduce_metrics_rejects_non_scalars():
    with pytest.raises(TypeError, match="'x'"):
        reduce_metrics([{"x": "1.0"}])
    with pytest.raises(ValueError, match="'y'"):
        reduce_metrics([{"y": torch.ones(2)}])


def test_metric_names_are_verl_names():
    assert m.timing_key("gen") == m.TIMING_GEN == "timing_s/gen"
    assert m.val_score_key("openai/gsm8k") == "val/openai/gsm8k/score/mean"
    assert m.val_mean_at_k_key("x", 8) == "val/x/score/mean@8"
    assert m.val_pass_at_k_key("x", 8) == "val/x/pass@8"


def test_critic_metrics_over_masked_in_tokens_by_hand() -> None:
    """values (0, 1, 2) against returns (1, 1, 3): residuals (1, 0, 1) have variance 1/3, the
    returns 4/3, so the values explain 1 - (1/3)/(4/3) = 3/4 of it. The masked-out fourth token
    (a huge value) is not counted anywhere."""
    values = torch.tensor([[0.0, 1.0, 2.0, 1e6]])
    returns = torch.tensor([[1.0, 1.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    got = m.compute_critic_metrics(values=values, returns=returns, response_mask=mask)
    assert (got["critic/values/mean"], got["critic/values/max"], got["critic/values/min"]) == (1.0, 2.0, 0.0)
    assert got["critic/returns/mean"] == pytest.approx(5 / 3) and (got["critic/returns/max"], got["critic/returns/min"]) == (3.0, 1.0)
    assert got["critic/vf_explained_var"] == pytest.approx(0.75, abs=1e-5)
    assert math.isnan(m.compute_critic_metrics(values=values, returns=returns, response_mask=mask * 0)["critic/vf_explained_var"])

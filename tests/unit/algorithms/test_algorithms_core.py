"""Masked statistics, name suggestions and the registry helpers."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.core import (
    UnknownNameError,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    register_into,
    resolve,
    suggest,
)

torch.set_num_threads(1)


def test_masked_sum_and_mean_ignore_masked_values_even_when_non_finite() -> None:
    x = torch.tensor([[1.0, 2.0, float("-inf")], [4.0, float("nan"), 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    # 1 + 2 + 4 + 6 = 13 over 4 tokens
    assert masked_sum(x, mask).item() == 13.0
    assert masked_mean(x, mask).item() == pytest.approx(13 / 4)
    # per row: (1 + 2)/2 = 1.5, (4 + 6)/2 = 5
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 5.0]))


def test_masked_mean_of_empty_rows_is_zero() -> None:
    x = torch.tensor([[3.0, 5.0], [7.0, 9.0]])
    mask = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([0.0, 7.0]))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_var_is_bessel_corrected() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # values 1, 2, 3, 4: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    # biased 5/4 = 1.25, unbiased 5/3
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(1.25)
    assert masked_var(x, mask).item() == pytest.approx(5 / 3)
    assert masked_var(x, mask).item() == pytest.approx(torch.tensor([1.0, 2, 3, 4]).var().item())


def test_masked_var_of_fewer_than_two_samples_is_zero() -> None:
    x = torch.tensor([[5.0, 6.0]])
    assert masked_var(x, torch.tensor([[1.0, 0.0]])).item() == 0.0
    assert masked_var(x, torch.zeros(1, 2)).item() == 0.0


def test_masked_whiten_matches_hand_numbers() -> None:
    x = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # mean 2.5, unbiased var 5/3 → scale 1/sqrt(5/3 + 1e-8)
    scale = (5 / 3 + 1e-8) ** -0.5
    expected = (torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 9.0]]) - 2.5) * scale
    torch.testing.assert_close(masked_whiten(x, mask), expected)
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), expected + 2.5)


def test_masked_whiten_of_constant_values_is_zero() -> None:
    x = torch.full((2, 3), 4.0)
    out = masked_whiten(x, torch.ones(2, 3))
    assert torch.isfinite(out).all()
    assert out.abs().max().item() == 0.0


def test_suggest_handles_case_separators_and_typos() -> None:
    options = ["token-mean", "seq-mean-token-sum", "grpo", "rloo"]
    assert suggest("Token_Mean", options) == "token-mean"
    assert suggest("gpro", options) == "grpo"
    assert suggest("zzzzzz", options) == ""


def test_registry_rejects_duplicates_and_suggests_on_unknown() -> None:
    registry: dict = {}

    @register_into(registry, "alpha", "thing")
    def alpha() -> int:
        return 1

    assert resolve(registry, "alpha", "thing") is alpha
    with pytest.raises(ValueError, match="already registered"):
        register_into(registry, "alpha", "thing")(lambda: 2)
    expected = r"unknown thing 'alpah'; expected one of: alpha\. Did you mean 'alpha'\?"
    with pytest.raises(UnknownNameError, match=expected):
        resolve(registry, "alpah", "thing")
    with pytest.raises(KeyError):
        resolve(registry, "beta", "thing")


def test_resolve_imports_module_function_paths() -> None:
    assert resolve({}, "hybridflow.algorithms.core:masked_sum", "thing") is masked_sum
    with pytest.raises(UnknownNameError, match="cannot import module"):
        resolve({}, "no_such_module_xyz:fn", "thing")
    with pytest.raises(UnknownNameError, match="has no callable 'nope'"):
        resolve({}, "hybridflow.algorithms.core:nope", "thing")

"""On-policy distillation's advantages, with hand-worked numbers."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms.distillation import (
    compute_distillation_advantages,
    compute_reverse_kl,
    discounted_future_sum,
)


def test_reverse_kl_is_student_minus_teacher_on_the_mask() -> None:
    student = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-0.5, -3.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert compute_reverse_kl(student, teacher, mask).tolist() == [[-0.5, 1.0, 0.0]]


def test_advantage_is_the_negated_reverse_kl_plus_weighted_task_advantage() -> None:
    task = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])  # (B=2, R=3)
    student = torch.tensor([[-1.0, -2.0, -7.0], [-0.25, -4.0, -4.0]])
    teacher = torch.tensor([[-0.5, -3.0, -1.0], [-0.25, -1.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out = compute_distillation_advantages(task, student, teacher, mask, kl_coef=2.0, reward_weight=0.5)
    # k = [[-0.5, 1, 0], [0, -3, 0]]; A = 0.5 * task - 2 * k on the mask.
    assert out.advantages.tolist() == [[1.5, -1.5, 0.0], [-0.5, 6.0, 0.0]]
    assert out.reverse_kl == pytest.approx((-0.5 + 1.0 + 0.0 - 3.0) / 4)


def test_pure_distillation_ignores_the_task_and_a_perfect_student_gets_nothing() -> None:
    task = torch.tensor([[3.0, 3.0]])
    same = torch.tensor([[-0.7, -0.1]])
    out = compute_distillation_advantages(task, same, same.clone(), torch.ones(1, 2), kl_coef=1.0, reward_weight=0.0)
    assert out.advantages.tolist() == [[0.0, 0.0]]
    assert out.reverse_kl == 0.0


def test_discount_sums_later_tokens_signal_back() -> None:
    values = torch.tensor([[1.0, 2.0, 4.0]])
    assert discounted_future_sum(values, 0.5).tolist() == [[1.0 + 0.5 * 2.0 + 0.25 * 4.0, 2.0 + 0.5 * 4.0, 4.0]]
    assert discounted_future_sum(values, 0.0).tolist() == values.tolist()
    task = torch.zeros(1, 3)
    student = torch.tensor([[-1.0, -1.0, -1.0]])
    teacher = torch.tensor([[-1.0, -2.0, -1.5]])  # k = [0, 1, 0.5]
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the last token is not the student's: its k does not count
    out = compute_distillation_advantages(task, student, teacher, mask, kl_coef=1.0, reward_weight=1.0, discount=1.0)
    assert out.advantages.tolist() == [[-1.0, -1.0, 0.0]]


def test_bad_arguments_are_refused() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="discount"):
        compute_distillation_advantages(x, x, x, torch.ones(1, 2), kl_coef=1.0, reward_weight=1.0, discount=1.5)
    with pytest.raises(ValueError, match="kl_coef"):
        compute_distillation_advantages(x, x, x, torch.ones(1, 2), kl_coef=-1.0, reward_weight=1.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_distillation_advantages(x, x, torch.zeros(1, 3), torch.ones(1, 2), kl_coef=1.0, reward_weight=1.0)

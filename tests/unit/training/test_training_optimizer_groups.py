"""``OptimSpec.group_lrs``: parameters named by a prefix train at their own peak lr, the schedule scales
every group alike, and without groups the optimizer is the one-group AdamW it always was."""

from __future__ import annotations

import pytest
import torch

from hybridflow.training.optimizer import OptimSpec, build_optimizer


class Scored(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.score = torch.nn.Linear(4, 1, bias=False)


def test_a_prefix_gets_its_own_lr_under_the_same_schedule():
    model = Scored()
    spec = OptimSpec(lr=1e-3, warmup_steps=2, group_lrs=(("score.", 1e-1),))
    optimizer, scheduler = build_optimizer(model, spec)
    rest, head = optimizer.param_groups
    assert [id(p) for p in head["params"]] == [id(model.score.weight)]
    assert {id(p) for p in rest["params"]} == {id(model.body.weight), id(model.body.bias)}
    assert (rest["lr"], head["lr"]) == pytest.approx((0.5e-3, 0.5e-1))  # warm-up step 1 of 2 scales both
    optimizer.step()
    scheduler.step()
    assert (rest["lr"], head["lr"]) == pytest.approx((1e-3, 1e-1))


def test_without_groups_there_is_one_group_and_a_prefix_naming_nothing_is_refused():
    optimizer, _ = build_optimizer(Scored(), OptimSpec(lr=1e-3))
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["lr"] == 1e-3
    with pytest.raises(ValueError, match="'head.'"):
        build_optimizer(Scored(), OptimSpec(lr=1e-3, group_lrs=(("head.", 1e-1),)))

"""Property tests (hypothesis) over random shapes, masks, groups and splits.

- Splitting a mini-batch into micro-batches, and micro-batches over data-parallel ranks, gives
  the whole mini-batch's loss and gradient, for every aggregation mode and every policy loss
  whose token losses depend only on their own sequence.
- Group-baseline advantages sum to zero over each group.
- Every estimator and loss returns finite values on degenerate inputs: all-equal rewards,
  length-1 responses, fully masked rows and batches.
"""

from __future__ import annotations

from functools import partial

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridflow.algorithms import (
    ADV_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    batch_counts,
)
from _algorithm_calls import estimate, policy_loss

torch.set_num_threads(1)

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# clip_cov and kl_cov pick their tokens by covariance ranking over the whole (micro-)batch, so
# a split changes which tokens are picked: they are batch-level by design, like verl's.
SPLIT_INVARIANT_LOSSES = sorted(set(POLICY_LOSSES) - {"clip_cov", "kl_cov"})


@st.composite
def ragged_batches(draw, min_rows: int = 1, max_rows: int = 8, max_len: int = 6):
    """(lengths, seed): row lengths in [0, max_len] (0: a fully masked row)."""
    rows = draw(st.integers(min_rows, max_rows))
    length = draw(st.integers(1, max_len))
    lengths = draw(st.lists(st.integers(0, length), min_size=rows, max_size=rows))
    seed = draw(st.integers(0, 2**31 - 1))
    return lengths, length, seed


def _tensors(lengths: list[int], length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float64)  # (B, R)
    old = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 3  # (B, R)
    new = (old + 0.3 * torch.randn(rows, length, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(rows, length, generator=g, dtype=torch.float64)
    return mask, old, new, adv


def _split_points(draw, rows: int) -> list[int]:
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, rows - 1)), max_size=3)))) if rows > 1 else []
    return [0, *cuts, rows]


@PROPERTY
@given(batch=ragged_batches(), data=st.data(), mode=st.sampled_from(LOSS_AGG_MODES))
def test_aggregation_is_split_invariant(batch, data, mode) -> None:
    lengths, length, seed = batch
    mask, _, new, adv = _tensors(lengths, length, seed)
    token_loss = lambda rows: (new[rows] * adv[rows]).tanh()  # noqa: E731 - a per-token loss
    whole = agg_loss(token_loss(slice(None)), mask, mode, loss_scale_factor=float(length))
    (whole_grad,) = torch.autograd.grad(whole, new)
    tokens, seqs = batch_counts(mask)
    points = _split_points(data.draw, len(lengths))
    total = sum(
        agg_loss(token_loss(slice(a, b)), mask[a:b], mode, global_num_tokens=tokens, global_num_seqs=seqs,
                 loss_scale_factor=float(length))
        for a, b in zip(points, points[1:])
    )
    (split_grad,) = torch.autograd.grad(total, new)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(split_grad, whole_grad)


@PROPERTY
@given(batch=ragged_batches(min_rows=2), data=st.data(), loss_mode=st.sampled_from(SPLIT_INVARIANT_LOSSES),
       agg_mode=st.sampled_from(LOSS_AGG_MODES))
def test_policy_losses_are_split_invariant_over_micro_batches_and_ranks(batch, data, loss_mode, agg_mode) -> None:
    """Ranks each accumulate their micro-batches; the all-reduce averages the rank gradients."""
    lengths, length, seed = batch
    mask, old, new, adv = _tensors(lengths, length, seed)
    fn = partial(policy_loss, loss_mode)
    common = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=agg_mode, loss_scale_factor=float(length))

    def loss(rows: slice, **kw):
        value, _ = fn(old_logprobs=old[rows], logprobs=new[rows], advantages=adv[rows], response_mask=mask[rows],
                      rollout_logprobs=old[rows], dro_beta=0.1, **common, **kw)
        return value

    whole = loss(slice(None))
    (whole_grad,) = torch.autograd.grad(whole, new)
    tokens, seqs = batch_counts(mask)
    rows = len(lengths)
    dp = data.draw(st.integers(1, min(3, rows)))
    rank_bounds = [round(r * rows / dp) for r in range(dp + 1)]
    grads, losses = [], []
    for a, b in zip(rank_bounds, rank_bounds[1:]):
        micro = [a, *sorted({data.draw(st.integers(a, b)) for _ in range(2)} - {a, b}), b]
        rank_loss = sum(
            loss(slice(x, y), global_num_tokens=tokens, global_num_seqs=seqs, dp_size=dp)
            for x, y in zip(micro, micro[1:])
        )
        (g,) = torch.autograd.grad(rank_loss, new)
        grads.append(g)
        losses.append(rank_loss.detach())
    torch.testing.assert_close(sum(grads) / dp, whole_grad)
    torch.testing.assert_close(sum(losses) / dp, whole.detach())


@PROPERTY
@given(
    group_sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo", "opo", "gpg"]),
    equal=st.booleans(),
)
def test_group_baseline_advantages_sum_to_zero_per_group(group_sizes, seed, estimator, equal) -> None:
    g = torch.Generator().manual_seed(seed)
    group_ids = torch.repeat_interleave(torch.arange(len(group_sizes)) * 7 + 3, torch.tensor(group_sizes))
    # Shuffle: group members need not be adjacent.
    group_ids = group_ids[torch.randperm(len(group_ids), generator=g)]
    rows, length = len(group_ids), 4
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    scores = torch.full((rows,), 0.5) if equal else torch.randint(0, 3, (rows,), generator=g).float()
    rewards = torch.zeros(rows, length)
    rewards[torch.arange(rows), lengths - 1] = scores
    name = "grpo" if estimator == "dr_grpo" else estimator
    adv, _ = estimate(name, token_level_rewards=rewards, response_mask=mask, group_ids=group_ids,
                                     norm_adv_by_std_in_grpo=estimator != "dr_grpo")
    assert torch.isfinite(adv).all()
    per_sample = adv[torch.arange(rows), 0]  # outcome advantages are constant along a response
    # OPO weights its baseline by length, so it is the length-weighted sum that is zero.
    weight = lengths.float() if name == "opo" else torch.ones(rows)
    for gid in group_ids.unique():
        members = group_ids == gid
        if int(members.sum()) == 1:
            continue  # a group of one has no baseline (verl): its advantage is its reward
        assert float((per_sample[members] * weight[members]).sum()) == pytest.approx(0.0, abs=1e-4)


def _estimator_inputs(rows: int, length: int, lengths: list[int], rewards_equal: bool):
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.zeros(rows, length)
    last = (torch.tensor(lengths) - 1).clamp(min=0)
    rewards[torch.arange(rows), last] = 1.0 if rewards_equal else torch.arange(rows).float() % 2
    return dict(
        token_level_rewards=rewards * mask,
        response_mask=mask,
        group_ids=torch.arange(rows) // 2,  # groups of two
        values=torch.zeros(rows, length),
        reward_baselines=torch.full((rows,), 0.5),
        reward_components=torch.stack([torch.arange(rows).float() % 2, torch.ones(rows)], dim=-1),
        old_logprobs=torch.full((rows, length), -0.7),
        sum_pi_squared=torch.full((rows, length), 0.3),
        implicit_rewards=torch.full((rows, length), 0.1),
    )


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
@pytest.mark.parametrize(
    ("lengths", "equal"),
    [([3, 3, 3, 3], True), ([1, 1, 1, 1], False), ([1, 1, 1, 1], True), ([0, 2, 0, 3], False), ([0, 0, 0, 0], True)],
    ids=["all-equal", "length-1", "length-1-equal", "empty-rows", "all-empty"],
)
def test_every_estimator_is_finite_on_degenerate_inputs(name, lengths, equal) -> None:
    inputs = _estimator_inputs(4, 3, lengths, equal)
    adv, returns = estimate(name, **inputs)
    assert adv.shape == returns.shape == (4, 3)
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    assert (adv[inputs["response_mask"] == 0] == 0).all(), "masked tokens get no advantage"


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("lengths", [[1, 1], [0, 0], [0, 3]], ids=["length-1", "all-empty", "one-empty"])
def test_every_policy_loss_is_finite_with_finite_gradient_on_degenerate_inputs(name, agg_mode, lengths) -> None:
    mask, old, new, _ = _tensors(lengths, 3, seed=0)
    adv = torch.zeros_like(old)  # all-equal rewards: zero advantages
    loss, metrics = policy_loss(name, old_logprobs=old, logprobs=new, advantages=adv, response_mask=mask,
                                          clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=agg_mode,
                                          rollout_logprobs=old, dro_beta=0.1)
    assert math.isfinite(float(loss.detach()))
    (grad,) = torch.autograd.grad(loss, new, allow_unused=True)
    assert grad is None or torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values()), metrics

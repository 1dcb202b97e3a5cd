"""Token-budget micro-batches (packed and padded), micro-batch count agreement, KK balancing and its metrics."""

from __future__ import annotations

import math
import random

import pytest

from hybridflow.data.batching import (
    WorkloadModel,
    agree_num_micro_batches,
    balanced_kk,
    balanced_partitions,
    flatten_partitions,
    global_seqlen_metrics,
    greedy_partition,
    karmarkar_karp,
    num_micro_batches_for_budget,
    padded_budget_partitions,
    padded_cost,
    partition_spread,
    partition_sums,
    refine_by_swaps,
    token_budget_partitions,
)


def lognormal_lengths(seed: int, n: int, mu: float = 6.0, sigma: float = 1.0, cap: int = 8192) -> list[int]:
    """Long-tailed response lengths (median e^6 ≈ 400 tokens), as RL rollouts produce."""
    rng = random.Random(seed)
    return [max(1, min(cap, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def assert_is_partition(parts: list[list[int]], n: int) -> None:
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(n)), "every index exactly once"
    assert all(p for p in parts), "no empty part"


# ------------------------------------------------------------------------------ workload


def test_workload_model_is_linear_plus_quadratic():
    model = WorkloadModel(linear_coef=10.0, quadratic_coef=2.0)
    assert model.costs([0, 1, 3]) == [0.0, 12.0, 48.0]  # 10·3 + 2·9 = 48
    # (2h + 2kv + 3i) for h=4, kv=2, i=8: 8 + 4 + 24 = 36.
    assert WorkloadModel.for_transformer(4, 8, kv_size=2) == WorkloadModel(36.0, 1.0)
    with pytest.raises(ValueError):
        WorkloadModel(linear_coef=-1.0)


# ------------------------------------------------------------------------------ partitioning


def test_karmarkar_karp_hand_worked():
    # Differencing [8,7,6,5,4]: 8-7→1, 6-5→1, then 4-1→3, 3-1→2: parts {7,5,4}=16, {8,6}=14.
    weights = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(weights, 2)
    assert parts == [[1, 3, 4], [0, 2]]
    assert partition_sums(weights, parts) == [16.0, 14.0]
    # The textbook instance where LDM misses the perfect split {8,7} / {6,5,4}; one swap finds it.
    assert partition_spread(weights, balanced_kk(weights, 2)) == 0.0


def test_equal_size_gives_exact_counts():
    weights = [float(w) for w in lognormal_lengths(1, 96)]
    for k in (2, 4, 8):
        for partitioner in (karmarkar_karp, balanced_kk, greedy_partition):
            parts = partitioner(weights, k, equal_size=True)
            assert_is_partition(parts, 96)
            assert [len(p) for p in parts] == [96 // k] * k
    with pytest.raises(ValueError, match="multiple of 4"):
        karmarkar_karp(weights[:10], 4, equal_size=True)
    with pytest.raises(ValueError, match="non-empty"):
        karmarkar_karp(weights[:3], 4)


@pytest.mark.parametrize("n,k", [(64, 4), (128, 8), (256, 8)])
@pytest.mark.parametrize("equal_size", [True, False])
def test_kk_spread_not_worse_than_greedy_on_lognormal_workloads(n, k, equal_size):
    workload = WorkloadModel()
    for seed in range(10):
        costs = workload.costs(lognormal_lengths(seed, n))
        ours = partition_spread(costs, balanced_partitions(lognormal_lengths(seed, n), k, equal_size=equal_size))
        greedy = partition_spread(costs, greedy_partition(costs, k, equal_size=equal_size))
        assert ours <= greedy, (seed, ours, greedy)


def test_swap_refinement_fixes_equal_size_kk_on_heavy_tails():
    """Plain equal-size KK (verl's) leaves the part with the longest sequence far heavier than
    greedy does; the swap refinement brings it below greedy and never makes a split worse."""
    workload = WorkloadModel()
    plain_total = refined_total = greedy_total = 0.0
    for seed in range(10):
        costs = workload.costs(lognormal_lengths(seed, 256))
        plain = karmarkar_karp(costs, 8, equal_size=True)
        refined = refine_by_swaps(costs, plain)
        assert sorted(map(len, refined)) == sorted(map(len, plain))
        assert partition_spread(costs, refined) <= partition_spread(costs, plain)
        plain_total += partition_spread(costs, plain)
        refined_total += partition_spread(costs, refined)
        greedy_total += partition_spread(costs, greedy_partition(costs, 8, equal_size=True))
    assert plain_total > greedy_total > 10 * refined_total


def test_groups_stay_on_one_rank():
    lengths = lognormal_lengths(3, 48)
    group_ids = [i // 4 for i in range(48)]  # 12 prompts x 4 samples
    parts = balanced_partitions(lengths, 4, group_ids=group_ids)
    assert_is_partition(parts, 48)
    assert [len(p) for p in parts] == [12] * 4
    for part in parts:
        groups = {group_ids[i] for i in part}
        assert sorted(part) == sorted(i for i in range(48) if group_ids[i] in groups)
    with pytest.raises(ValueError, match="groups of one size"):
        balanced_partitions(lengths[:6], 2, group_ids=[0, 0, 0, 1, 1, 2])


def test_flatten_partitions_puts_each_part_in_its_chunk():
    parts = [[0, 5], [1, 4], [2, 3]]
    order = flatten_partitions(parts)
    assert [order[r * 2 : r * 2 + 2] for r in range(3)] == parts
    with pytest.raises(ValueError):
        flatten_partitions([[0, 1], [2]])


def test_global_seqlen_metrics_hand_worked():
    lengths = [1, 2, 3, 10, 20, 30]
    metrics = global_seqlen_metrics(lengths, [[0, 5], [1, 4], [2, 3]])
    # Contiguous split: [1,2]=3, [3,10]=13, [20,30]=50. Balanced: 31, 22, 13.
    assert metrics == {
        "global_seqlen/min": 3.0,
        "global_seqlen/max": 50.0,
        "global_seqlen/minmax_diff": 47.0,
        "global_seqlen/balanced_min": 13.0,
        "global_seqlen/balanced_max": 31.0,
        "global_seqlen/mean": 22.0,
    }


# ------------------------------------------------------------------------------ token budget


def test_token_budget_hand_worked():
    lengths = [5, 5, 4, 3, 3]  # 20 tokens, budget 10: two micro-batches fit exactly.
    # Plain KK splits 11/9 (over budget); the refinement finds {5,5} / {4,3,3}.
    assert partition_sums(lengths, karmarkar_karp(lengths, 2)) == [11.0, 9.0]
    assert token_budget_partitions(lengths, 10) == [[0, 1], [2, 3, 4]]
    assert num_micro_batches_for_budget(lengths, 10) == 2
    # Forcing four: all fit, heaviest workload first (two 3s = 6 tokens beat one 5).
    assert token_budget_partitions(lengths, 10, num_micro_batches=4) == [[3, 4], [0], [1], [2]]


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_micro_batches_fit_and_are_few(seed):
    lengths = lognormal_lengths(seed, 64, mu=5.0, cap=2000)
    budget = 4096
    parts = token_budget_partitions(lengths, budget)
    assert_is_partition(parts, 64)
    sums = partition_sums(lengths, parts)
    assert max(sums) <= budget
    lower_bound = -(-sum(lengths) // budget)
    assert lower_bound <= len(parts) <= lower_bound + 1
    costs = WorkloadModel().costs(lengths)
    workloads = [sum(costs[i] for i in p) for p in parts]
    assert workloads == sorted(workloads, reverse=True)
    # The agreed count can only be larger; the budget still holds.
    more = token_budget_partitions(lengths, budget, num_micro_batches=len(parts) + 3)
    assert_is_partition(more, 64)
    assert len(more) == len(parts) + 3 and max(partition_sums(lengths, more)) <= budget


def test_micro_batch_count_agreement():
    rank_lengths = [lognormal_lengths(s, 32, mu=5.0, cap=2000) for s in range(4)]
    counts = [num_micro_batches_for_budget(lengths, 2048) for lengths in rank_lengths]
    agreed = agree_num_micro_batches(counts)
    assert agreed == max(counts)
    for lengths in rank_lengths:
        parts = token_budget_partitions(lengths, 2048, num_micro_batches=agreed)
        assert len(parts) == agreed and max(partition_sums(lengths, parts)) <= 2048
    with pytest.raises(ValueError):
        agree_num_micro_batches([])


def test_token_budget_errors_say_what_to_change():
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu"):
        token_budget_partitions([10, 300], 256)
    with pytest.raises(ValueError, match="fewer than"):
        token_budget_partitions([100, 100, 100], 200, num_micro_batches=1)
    with pytest.raises(ValueError, match="non-empty"):
        token_budget_partitions([1, 1], 10, num_micro_batches=3)


# --------------------------------------------------------------------------------------------
# Padded token-budget micro-batches


@pytest.mark.parametrize("seed", range(5))
def test_padded_budget_micro_batches_fit_and_group_similar_lengths(seed):
    rng = random.Random(seed)
    prompts = [rng.randint(4, 40) for _ in range(64)]
    responses = [min(512, int(rng.lognormvariate(math.log(40), 1.0)) + 1) for _ in range(64)]
    parts = padded_budget_partitions(prompts, responses, 1024)
    assert sorted(i for p in parts for i in p) == list(range(64))
    assert all(padded_cost(prompts, responses, p) <= 1024 for p in parts)
    costs = [padded_cost(prompts, responses, p) for p in parts]
    assert costs == sorted(costs, reverse=True)  # heaviest first
    # Grouped by length, the rectangles waste far less than one fixed split of 8 rows in order.
    fixed = [list(range(i, i + 8)) for i in range(0, 64, 8)]
    valid = sum(prompts) + sum(responses)
    assert sum(costs) - valid < 0.5 * (sum(padded_cost(prompts, responses, p) for p in fixed) - valid)


def test_padded_budget_micro_batches_to_an_agreed_count():
    prompts, responses = [5] * 6, [1, 2, 3, 10, 11, 12]
    own = padded_budget_partitions(prompts, responses, 64)
    forced = padded_budget_partitions(prompts, responses, 64, num_micro_batches=len(own) + 2)
    assert len(forced) == len(own) + 2 and all(padded_cost(prompts, responses, p) <= 64 for p in forced)
    with pytest.raises(ValueError, match="fewer than"):
        padded_budget_partitions(prompts, responses, 64, num_micro_batches=len(own) - 1)
    with pytest.raises(ValueError, match="more than the micro-batch budget"):
        padded_budget_partitions(prompts, responses, 16)

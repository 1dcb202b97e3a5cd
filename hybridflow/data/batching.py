"""Who computes which samples, and in which micro-batch: pure functions on sequence lengths.

Three decisions of a training step depend only on how long each sample is:

- **Balance over data-parallel ranks** (``trainer.balance_batch``): a synchronous step waits for
  its slowest rank, so each rank should get the same *workload*, not the same sample count.
  ``balanced_partitions`` splits samples (or whole prompt groups) over ranks with
  Karmarkar–Karp largest differencing on a workload model that is linear + quadratic in length,
  then refines with pairwise swaps (equal-size KK alone is worse than greedy on heavy tails).
- **Token-budget micro-batches** (``actor.use_dynamic_bsz``): a micro-batch holds as many samples
  as fit ``max_token_len`` tokens, so short samples are not run one tiny batch at a time and
  long ones do not blow the memory. ``token_budget_partitions`` returns the index lists.
- **The same number of micro-batches on every rank**: FSDP gathers parameters per forward, so
  ranks must run equally many; ``agree_num_micro_batches`` takes every rank's own need.

Everything returns plain index lists; the caller selects rows of its own batch type. Nothing
here imports torch, so it runs anywhere in microseconds.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

# verl's workload model (verl/utils/seqlen_balancing.py: calculate_workload = 24576·L + L²):
# 12·h²·L dense + 2·h·L² attention multiply-adds of a 7B layer (h = 4096), divided by 2·h.
VERL_LINEAR_COEF = 24576.0


@dataclass(frozen=True)
class WorkloadModel:
    """Cost of one sequence of L tokens: ``linear_coef * L + quadratic_coef * L**2``.

    The linear term is the dense layers (projections, MLP, LM head), paid once per token; the
    quadratic term is causal attention, paid once per (query, key) pair.
    """

    linear_coef: float = VERL_LINEAR_COEF
    quadratic_coef: float = 1.0

    def __post_init__(self) -> None:
        if self.linear_coef < 0 or self.quadratic_coef < 0 or self.linear_coef + self.quadratic_coef == 0:
            raise ValueError(f"workload coefficients must be >= 0 and not both 0, got {self}")

    @staticmethod
    def for_transformer(hidden_size: int, intermediate_size: int, kv_size: int | None = None) -> WorkloadModel:
        """Coefficients from a decoder layer's shapes (per layer; the layer count cancels).

        Dense FLOPs per token: 2·(h·h [q] + 2·h·kv [k, v] + h·h [o] + 3·h·i [gated MLP]).
        Causal attention: QKᵀ and AV cost 2·2·h per (query, key) pair over L²/2 pairs, i.e.
        2·h·L². Dividing both by 2·h leaves ``(2h + 2kv + 3i)·L + L²``.
        """
        kv = hidden_size if kv_size is None else kv_size
        return WorkloadModel(linear_coef=float(2 * hidden_size + 2 * kv + 3 * intermediate_size), quadratic_coef=1.0)

    def cost(self, length: int) -> float:
        return self.linear_coef * length + self.quadratic_coef * length * length

    def costs(self, lengths: Sequence[int]) -> list[float]:
        return [self.cost(int(n)) for n in lengths]


# --------------------------------------------------------------------------------------------
# Partitioning
# --------------------------------------------------------------------------------------------


def _check_partition_args(num_items: int, k: int, equal_size: bool) -> None:
    if k < 1:
        raise ValueError(f"number of partitions must be >= 1, got {k}")
    if num_items < k:
        raise ValueError(f"cannot split {num_items} items into {k} non-empty partitions")
    if equal_size and num_items % k != 0:
        raise ValueError(f"equal_size partitions need a multiple of {k} items, got {num_items}")


class _State:
    """One candidate solution of KK: k partitions, kept sorted by sum, largest first."""

    def __init__(self, parts: list[tuple[float, list[int]]]) -> None:
        # Among equal sums, empty parts go last, so a merge pairs them with the other state's
        # heaviest (non-empty) part and no partition is left empty while items remain.
        self.parts = sorted(parts, key=lambda p: (-p[0], -len(p[1]), p[1]))

    @property
    def spread(self) -> float:
        return self.parts[0][0] - self.parts[-1][0]

    def merge(self, other: _State) -> _State:
        # Largest of one with smallest of the other: the differencing step that cancels spread.
        pairs = zip(self.parts, reversed(other.parts))
        return _State([(mine[0] + theirs[0], mine[1] + theirs[1]) for mine, theirs in pairs])


def karmarkar_karp(weights: Sequence[float], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Split item indices into ``k`` partitions with near-equal weight sums (largest differencing).

    Each item starts as its own k-way state; the two states with the largest spread are merged
    (heaviest part of one with the lightest of the other) until one state is left. With
    ``equal_size`` the initial states hold k items of adjacent weight, one per part, so every
    partition ends with exactly ``len(weights) // k`` items.

    Returns ``k`` lists of indices (each sorted), ordered from heaviest to lightest partition.
    """
    _check_partition_args(len(weights), k, equal_size)
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    if equal_size:
        seeds = [order[start : start + k] for start in range(0, len(order), k)]
        states = [_State([(float(weights[i]), [i]) for i in seed]) for seed in seeds]
    else:
        states = [_State([(float(weights[i]), [i])] + [(0.0, []) for _ in range(k - 1)]) for i in order]
    # heapq is a min-heap: key on -spread; the counter makes ties deterministic.
    heap = [(-s.spread, n, s) for n, s in enumerate(states)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, counter, merged))
        counter += 1
    return [sorted(items) for _, items in heap[0][2].parts]


def greedy_partition(weights: Sequence[float], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Longest-processing-time greedy: heaviest item first onto the lightest (non-full) partition.

    The baseline KK is measured against; same contract as ``karmarkar_karp``.
    """
    _check_partition_args(len(weights), k, equal_size)
    capacity = len(weights) // k if equal_size else len(weights)
    sums = [0.0] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        target = min((p for p in range(k) if len(parts[p]) < capacity), key=lambda p: (sums[p], p))
        sums[target] += float(weights[i])
        parts[target].append(i)
    ranked = sorted(range(k), key=lambda p: (-sums[p], p))
    return [sorted(parts[p]) for p in ranked]


def refine_by_swaps(
    weights: Sequence[float], partitions: Sequence[Sequence[int]], max_swaps: int | None = None
) -> list[list[int]]:
    """Improve a partition by swapping single items between the heaviest or lightest part and another.

    Equal-size KK (each initial state holds k items of adjacent weight, one per part) can only
    move weight between parts in steps of the gaps between neighbours, so one very long
    sequence in a heavy-tailed batch leaves its part far above the rest. A swap keeps every
    part's size. Each round takes the swap, between the heaviest part and another or the
    lightest and another, that leaves the smallest spread; it moves d with 0 < d < (gap
    between the two parts), so the spread never grows and the sum of squared part sums
    strictly falls, which ends the loop. Returns the parts heaviest first.
    """
    parts = [list(p) for p in partitions]
    sums = partition_sums(weights, parts)
    limit = 10 * len(weights) if max_swaps is None else max_swaps
    for _ in range(limit):
        move = _best_move(weights, parts, sums)
        if move is None:
            break
        a, b, i, j, moved = move
        parts[a][parts[a].index(i)] = j
        parts[b][parts[b].index(j)] = i
        sums[a] -= moved
        sums[b] += moved
    ranked = sorted(range(len(parts)), key=lambda p: (-sums[p], sorted(parts[p])))
    return [sorted(parts[p]) for p in ranked]


def _best_move(
    weights: Sequence[float], parts: list[list[int]], sums: list[float]
) -> tuple[int, int, int, int, float] | None:
    """(heavier part, lighter part, item out of heavier, item out of lighter, weight moved) of
    the swap that leaves the smallest spread, or None when no swap improves."""
    heavy = max(range(len(parts)), key=lambda p: sums[p])
    light = min(range(len(parts)), key=lambda p: sums[p])
    pairs = {(heavy, p) for p in range(len(parts)) if sums[p] < sums[heavy]}
    pairs |= {(p, light) for p in range(len(parts)) if sums[p] > sums[light]}
    best: tuple[tuple[float, float], tuple[int, int, int, int, float]] | None = None
    for a, b in sorted(pairs):
        swap = _nearest_half_gap_swap(weights, parts[a], parts[b], sums[a] - sums[b])
        if swap is None:
            continue
        i, j, moved = swap
        after = list(sums)
        after[a] -= moved
        after[b] += moved
        # Lexicographic: smaller spread first, then the larger fall of the sum of squares.
        key = (max(after) - min(after), moved * moved - moved * (sums[a] - sums[b]))
        if best is None or key < best[0]:
            best = (key, (a, b, i, j, moved))
    return None if best is None else best[1]


def _nearest_half_gap_swap(
    weights: Sequence[float], heavier: list[int], lighter: list[int], gap: float
) -> tuple[int, int, float] | None:
    """(item of heavier, item of lighter, weight moved) with the moved weight nearest gap/2 in (0, gap)."""
    lighter_sorted = sorted(lighter, key=lambda j: weights[j])
    lighter_weights = [weights[j] for j in lighter_sorted]
    best: tuple[float, int, int, float] | None = None
    for i in heavier:
        # The ideal partner weighs weights[i] - gap/2; only its two neighbours can be nearest.
        pos = bisect.bisect_left(lighter_weights, weights[i] - gap / 2)
        for q in (pos - 1, pos):
            if 0 <= q < len(lighter_sorted):
                moved = weights[i] - lighter_weights[q]
                if 0 < moved < gap:
                    score = abs(gap - 2 * moved)
                    if best is None or score < best[0]:
                        best = (score, i, lighter_sorted[q], moved)
    return None if best is None else best[1:]


def balanced_kk(weights: Sequence[float], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """``karmarkar_karp`` followed by ``refine_by_swaps``: the partitioner this module uses."""
    return refine_by_swaps(weights, karmarkar_karp(weights, k, equal_size=equal_size))


def partition_sums(weights: Sequence[float], partitions: Sequence[Sequence[int]]) -> list[float]:
    return [float(sum(weights[i] for i in part)) for part in partitions]


def partition_spread(weights: Sequence[float], partitions: Sequence[Sequence[int]]) -> float:
    """max - min of the partition sums: 0 is a perfect balance."""
    sums = partition_sums(weights, partitions)
    return max(sums) - min(sums)


# --------------------------------------------------------------------------------------------
# Data-parallel balancing
# --------------------------------------------------------------------------------------------


def _group_units(group_ids: Sequence[int]) -> list[list[int]]:
    """Sample indices per group, groups in order of first appearance."""
    units: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        units.setdefault(int(g), []).append(i)
    return list(units.values())


def balanced_partitions(
    lengths: Sequence[int],
    world_size: int,
    *,
    workload: WorkloadModel = WorkloadModel(),
    equal_size: bool = True,
    group_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """Sample indices for each data-parallel rank, balanced by workload (KK).

    Args:
        lengths: valid tokens (prompt + response) per sample.
        world_size: number of ranks.
        workload: the cost model of one sequence.
        equal_size: every rank gets the same number of samples (what a worker group's even
            split and FSDP's equal micro-batch counts rely on).
        group_ids: when given, samples of one group (the n responses of a prompt) stay on one
            rank: groups are the units partitioned. With ``equal_size`` all groups must be the
            same size so equal group counts mean equal sample counts.

    Returns ``world_size`` sorted index lists; rank r takes ``partitions[r]``.
    """
    costs = workload.costs(lengths)
    if group_ids is None:
        return balanced_kk(costs, world_size, equal_size=equal_size)
    if len(group_ids) != len(lengths):
        raise ValueError(f"group_ids has {len(group_ids)} entries for {len(lengths)} samples")
    units = _group_units(group_ids)
    if equal_size and len({len(u) for u in units}) > 1:
        raise ValueError(
            "balanced_partitions(equal_size=True) with group_ids needs groups of one size, got sizes "
            f"{sorted({len(u) for u in units})}; use equal_size=False or keep groups whole upstream"
        )
    unit_costs = [sum(costs[i] for i in unit) for unit in units]
    unit_parts = balanced_kk(unit_costs, world_size, equal_size=equal_size)
    return [sorted(i for u in part for i in units[u]) for part in unit_parts]


def flatten_partitions(partitions: Sequence[Sequence[int]]) -> list[int]:
    """The permutation that puts partition r's samples in the r-th contiguous chunk, so an even
    split of the reordered batch over ranks hands each rank its partition."""
    sizes = {len(p) for p in partitions}
    if len(sizes) > 1:
        raise ValueError(f"an even split needs partitions of one size, got sizes {sorted(sizes)}")
    return [i for part in partitions for i in part]


def global_seqlen_metrics(
    lengths: Sequence[int], partitions: Sequence[Sequence[int]], prefix: str = "global_seqlen"
) -> dict[str, float]:
    """Tokens per rank before (contiguous even split) and after balancing (verl's names).

    ``min``/``max``/``minmax_diff``: token sums of the contiguous split the batch would have had;
    ``balanced_min``/``balanced_max``: token sums of ``partitions``; ``mean``: tokens per rank.
    """
    k = len(partitions)
    if k < 1 or len(lengths) % k != 0:
        raise ValueError(f"{len(lengths)} samples cannot be split evenly over {k} ranks")
    size = len(lengths) // k
    naive = [float(sum(lengths[start : start + size])) for start in range(0, len(lengths), size)]
    balanced = partition_sums([float(n) for n in lengths], partitions)
    return {
        f"{prefix}/min": min(naive),
        f"{prefix}/max": max(naive),
        f"{prefix}/minmax_diff": max(naive) - min(naive),
        f"{prefix}/balanced_min": min(balanced),
        f"{prefix}/balanced_max": max(balanced),
        f"{prefix}/mean": sum(naive) / k,
    }


# --------------------------------------------------------------------------------------------
# Token-budget micro-batches
# --------------------------------------------------------------------------------------------


def _check_budget(lengths: Sequence[int], max_token_len: int) -> None:
    if not lengths:
        raise ValueError("no samples to split into micro-batches")
    if max_token_len < 1:
        raise ValueError(f"max_token_len must be >= 1, got {max_token_len}")
    longest = max(lengths)
    if longest > max_token_len:
        raise ValueError(
            f"a sample has {longest} tokens, more than the micro-batch budget max_token_len={max_token_len}; "
            "raise actor.ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu to at least "
            "prompt + response length"
        )



def _micro_batch_count(needed: int, num_micro_batches: int | None, samples: int, max_token_len: int) -> int:
    """How many micro-batches to cut: this rank's own need (``needed`` fit ``max_token_len``), or the
    count agreed over ranks, which must be at least that and at most one per sample."""
    count = needed if num_micro_batches is None else num_micro_batches
    if count < needed:
        raise ValueError(
            f"num_micro_batches={count} is fewer than the {needed} this rank needs to fit "
            f"max_token_len={max_token_len}; agree on the count with agree_num_micro_batches"
        )
    if count > samples:
        raise ValueError(f"cannot form {count} non-empty micro-batches from {samples} samples")
    return count


def _fits(lengths: Sequence[int], partitions: list[list[int]], max_token_len: int) -> bool:
    return max(partition_sums(lengths, partitions)) <= max_token_len


def _feasible_partitions(lengths: Sequence[int], max_token_len: int) -> list[list[int]]:
    """KK into the fewest micro-batches that all fit the budget (at worst one sample each)."""
    k = math.ceil(sum(lengths) / max_token_len)
    while True:
        parts = balanced_kk(lengths, k)
        if _fits(lengths, parts, max_token_len):
            return parts
        k += 1


def num_micro_batches_for_budget(lengths: Sequence[int], max_token_len: int) -> int:
    """How many token-budget micro-batches this rank needs on its own (before agreement)."""
    _check_budget(lengths, max_token_len)
    return len(_feasible_partitions(lengths, max_token_len))


def agree_num_micro_batches(per_rank_counts: Sequence[int]) -> int:
    """The count every rank uses: the largest any rank needs (more micro-batches always fit)."""
    if not per_rank_counts or min(per_rank_counts) < 1:
        raise ValueError(f"every rank needs at least one micro-batch, got {list(per_rank_counts)}")
    return max(int(c) for c in per_rank_counts)


def _split_to_count(lengths: Sequence[int], parts: list[list[int]], count: int) -> list[list[int]]:
    """Split the heaviest multi-sample parts in two until there are ``count`` parts: every new
    part is a subset of a fitting one, so the budget still holds."""
    parts = [list(p) for p in parts]
    while len(parts) < count:
        splittable = [p for p in parts if len(p) > 1]
        heaviest = max(splittable, key=lambda p: (sum(lengths[i] for i in p), p))
        parts.remove(heaviest)
        halves = karmarkar_karp([lengths[i] for i in heaviest], 2)
        parts.extend([heaviest[j] for j in half] for half in halves)
    return parts


def token_budget_partitions(
    lengths: Sequence[int],
    max_token_len: int,
    *,
    num_micro_batches: int | None = None,
    workload: WorkloadModel = WorkloadModel(),
) -> list[list[int]]:
    """Micro-batches (index lists) of at most ``max_token_len`` tokens each.

    Uses the fewest micro-batches that fit, or exactly ``num_micro_batches`` (the count agreed
    over ranks; it must be at least this rank's own need), balanced by token count with KK.
    Micro-batches come heaviest workload first, so on every rank the i-th micro-batch has a
    similar cost and no rank waits long for another at each micro-batch's collectives.
    """
    _check_budget(lengths, max_token_len)
    feasible = _feasible_partitions(lengths, max_token_len)
    count = _micro_batch_count(len(feasible), num_micro_batches, len(lengths), max_token_len)
    parts = feasible
    if count > len(feasible):
        parts = balanced_kk(lengths, count)
        if not _fits(lengths, parts, max_token_len):
            parts = _split_to_count(lengths, feasible, count)
    costs = workload.costs(lengths)
    return sorted((sorted(p) for p in parts), key=lambda p: (-sum(costs[i] for i in p), p))


# --------------------------------------------------------------------------------------------
# Token-budget micro-batches for the padded path
# --------------------------------------------------------------------------------------------


def padded_cost(prompt_lengths: Sequence[int], response_lengths: Sequence[int], part: Sequence[int]) -> int:
    """Token slots of a padded micro-batch trimmed to its own width: rows x (longest prompt +
    longest response), the prompts being left-padded and the responses right-padded."""
    if not part:
        return 0
    return len(part) * (max(prompt_lengths[i] for i in part) + max(response_lengths[i] for i in part))


def padded_budget_partitions(
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    max_token_len: int,
    *,
    num_micro_batches: int | None = None,
) -> list[list[int]]:
    """Micro-batches (index lists) whose *padded* size, ``padded_cost``, is at most ``max_token_len``.

    A padded forward pays for every slot of its rectangle, so samples of similar length belong
    together (the packed path's KK balancing would mix long and short ones and pad the short
    ones to the long). Samples are taken longest response first (then longest prompt) and a
    micro-batch is closed when the next sample would push its rectangle over the budget. With
    ``num_micro_batches`` (the count agreed over ranks, at least this rank's own need) the
    micro-batch of most rows is halved, in length order, until there are that many: a subset of
    a fitting rectangle fits. Micro-batches come heaviest first, like ``token_budget_partitions``.
    """
    if len(prompt_lengths) != len(response_lengths):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(response_lengths)} responses")
    _check_budget([p + r for p, r in zip(prompt_lengths, response_lengths)], max_token_len)
    order = sorted(range(len(prompt_lengths)), key=lambda i: (-response_lengths[i], -prompt_lengths[i], i))
    parts: list[list[int]] = []
    for i in order:
        if parts and padded_cost(prompt_lengths, response_lengths, parts[-1] + [i]) <= max_token_len:
            parts[-1].append(i)
        else:
            parts.append([i])
    count = _micro_batch_count(len(parts), num_micro_batches, len(order), max_token_len)
    while len(parts) < count:
        widest = max(range(len(parts)), key=lambda k: (len(parts[k]), -k))
        part = parts.pop(widest)
        half = len(part) // 2
        parts[widest:widest] = [part[:half], part[half:]]
    cost = {id(p): padded_cost(prompt_lengths, response_lengths, p) for p in parts}
    return [sorted(p) for p in sorted(parts, key=lambda p: (-cost[id(p)], sorted(p)))]

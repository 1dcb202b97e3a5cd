"""One round of training prompts, generated and scored at once: each prompt group is scored as
soon as its samples are finished (``RolloutReplicas.stream_batches``), while the replicas keep
generating the rest of the round.

The rewards are those of generating the whole round and then scoring it: every score depends on
its own sample alone, and the reward role's metrics come back per part as a ``RewardTally``
(per-sample values), merged into exactly the whole round's metrics (failure rates, overlong
shaping, the extras' means, the reward model's mean/max/min).

Timings stay disjoint parts of the step (``timing_s/<phase>``, as ``PhaseTimer`` keeps them):
``timing_s/gen`` is the wall time from the round's start until its last trajectory reached the
controller, scoring done meanwhile included; ``timing_s/reward`` (and ``timing_s/reward_model``)
the scoring left after that, which the step waits for. ``perf/reward_overlapped_s`` is the
scoring done while the round was still being generated: hidden inside ``timing_s/gen``.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING

from hybridflow.agents import answer_view
from hybridflow.data import PromptRow
from hybridflow.data.dataset import ImageInputs, row_multi_modal
from hybridflow.rewards import judge
from hybridflow.rewards.tally import RewardTally
from hybridflow.tracking import reduce_metrics
from hybridflow.types import GenerationRequest, Sample, SamplingParams, Trajectory
from hybridflow.utils.seed import derive_seed
from hybridflow.utils.timer import PhaseTimer, profiler_range
from hybridflow.utils.watchdog import activity
from hybridflow.workers.reward import RewardWorker

if TYPE_CHECKING:
    from hybridflow.controller.roles import RewardModelGroup, Roles
    from hybridflow.controller.step_plan import StepPlan

METRIC_REWARD_OVERLAPPED = "perf/reward_overlapped_s"


def round_requests(rows: list[PromptRow], params: SamplingParams, seed: int, seed_scope: tuple[int, ...],
                   vision: ImageInputs | None = None, first_group: int = 0) -> list[GenerationRequest]:
    """The requests of a round: seeds depend only on (run seed, scope, position), so a resumed run
    draws the same samples, whichever replica serves them and whenever. Each carries its row's
    fields and its prompt group (``first_group`` + its position), which its trajectories take
    from it. A row's images become its request's pixels here (``vision``: the VL model's
    processor), travelling on to the batch."""
    return [
        GenerationRequest(prompt_ids=row.prompt_ids,
                          params=SamplingParams(**{**vars(params), "seed": derive_seed(seed, *seed_scope, i)}),
                          request_id=row.source, multi_modal=row_multi_modal(row, vision), row=row.row_fields(),
                          group_id=first_group + i)
        for i, row in enumerate(rows)
    ]


def generate_and_score(
    roles: Roles, plan: StepPlan, rows: list[PromptRow], params: SamplingParams, seed_scope: tuple[int, ...],
    timer: PhaseTimer, vision: ImageInputs | None = None,
) -> tuple[list[Sample], dict[str, float]]:
    """``phases.generate`` then ``phases.score_answers`` of the round, overlapped (module docstring):
    the round's trajectories grouped by prompt (``group_id`` = row index), scored, and the reward
    metrics. With ``trainer.data_plane=refs`` each replica scores its groups and keeps their
    tokens: the round's ``SampleRecord``s, and no scoring left to wait for here."""
    requests = round_requests(rows, params, plan.seed, seed_scope, vision)
    by_reference = plan.by_reference
    groups: list[list[Sample]] = [[] for _ in rows]
    tally, model_parts = RewardTally(), []
    overlapped = reward_s = model_s = 0.0
    remaining = len(rows)
    start = time.perf_counter()
    generated_at = start
    # One profiler range for the round (its timing_s/gen and reward parts are split below).
    with activity("phase", "gen"), profiler_range("phase/gen"), \
            contextlib.closing(roles.rollout.stream_batches(requests, by_reference)) as batches:
        for batch in batches:
            remaining -= len(batch)
            if not remaining:
                generated_at = time.perf_counter()
            if by_reference:  # scored by the replicas, which keep the tokens: records and tallies
                for group_id, scored in batch:
                    groups[group_id] = scored.records
                    tally.merge(scored.tally)
                continue
            part: list[Trajectory] = []
            for group_id, samples in batch:
                groups[group_id] = samples
                part.extend(samples)
            seconds = score_part(roles, part, tally, model_parts)
            if remaining:
                overlapped += sum(seconds)
            else:
                model_s, reward_s = seconds
    # The timeline's spans: the round's generation, then the scoring left after its last trajectory.
    timer.add("gen", generated_at - start, start=start)
    if roles.reward_model is not None:
        timer.add("reward_model", model_s, start=generated_at)
    timer.add("reward", reward_s, start=generated_at + model_s)
    metrics = tally.metrics() | merge_model_metrics(model_parts) | {METRIC_REWARD_OVERLAPPED: overlapped}
    return [t for group in groups for t in group], metrics


def score_part(roles: Roles, part: list[Trajectory], tally: RewardTally,
                model_parts: list[tuple[int, dict[str, float]]]) -> tuple[float, float]:
    """Score ``part`` as ``phases.score_answers`` scores a round (final answers, the whole
    response's length for shaping, the reward model's scores combined), adding its metrics to
    ``tally`` and ``model_parts``; returns the seconds spent in the reward model and the reward role."""
    start = time.perf_counter()
    scores_of_model, model_metrics = model_scores(roles.reward_model, part)
    model_parts.append((len(part), model_metrics))
    scored = time.perf_counter()
    views = [answer_view(t) for t in part]
    lengths = [len(t.response_ids) for t in part]
    _, part_tally = roles.reward.call_one(0, RewardWorker.score_part, views, shaping=True,
                                        response_lengths=lengths, model_scores=scores_of_model)
    tally.merge(part_tally)
    for t, view in zip(part, views, strict=True):
        t.reward, t.reward_extra, t.reward_info = view.reward, view.reward_extra, view.reward_info
    return scored - start, time.perf_counter() - scored


def model_scores(
    rm: RewardModelGroup | None, trajectories: list[Trajectory], timer: PhaseTimer | None = None
) -> tuple[list[float] | None, dict[str, float]]:
    """The reward model's score of each final answer (``timing_s/reward_model``), its ranks
    taking contiguous shares; None without a reward model."""
    if rm is None:
        return None, {}
    views = [answer_view(t) for t in trajectories]
    share = -(-len(views) // rm.group.world_size)  # ceil: the last rank may get fewer
    shards = [(views[r * share : (r + 1) * share],) for r in range(rm.group.world_size)]
    with timer.phase("reward_model") if timer is not None else contextlib.nullcontext():
        results = rm.group.call_each(rm.score, shards)
    return [x for scores, _ in results for x in scores], reduce_metrics([m for _, m in results if m])


# The judge's counters: a round's count is the sum of its parts'.
_SUMMED_MODEL_METRICS = frozenset({judge.METRIC_FAILURES, judge.METRIC_TIMEOUTS, judge.METRIC_PARSE_ERRORS,
                                   judge.METRIC_RETRIES})


def merge_model_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The reward model's own metrics over the parts: the judge's counters summed, the rest (rates,
    fractions) averaged with each part weighted by its samples, so a rate is the round's."""
    summed = {key: math.fsum(m[key] for _, m in parts if key in m)
              for key in {k for _, m in parts for k in m} & _SUMMED_MODEL_METRICS}
    averaged = reduce_metrics([{k: v for k, v in m.items() if k not in summed} for size, m in parts if m
                               for _ in range(size)])
    return averaged | summed

"""End-of-run views of ``metrics.jsonl``: a PNG of the curves and a text summary.

Both read the file through ``read_metrics_jsonl`` (records merged per step), skip metrics a
run did not log, and ignore NaN/null values, so they work on a run that stopped early, never
validated, or logged a bad value.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridflow.tracking import metrics as m
from hybridflow.tracking.loggers import MetricsRecord, read_metrics_jsonl

logger = logging.getLogger(__name__)

SUMMARY_WINDOW_STEPS = 5
"""Train score first→last is the mean over this many steps at each end: one step's batch
score is noisy (a few dozen prompts), five smooth it without hiding a short run's trend."""


@dataclass(frozen=True)
class _Panel:
    title: str
    key: str
    ylabel: str
    markers: bool  # sparse series (validation) read better as points joined by lines
    band: tuple[str, str] | None = None  # (min key, max key) drawn as a shaded range


_PANELS: tuple[_Panel, ...] = (
    _Panel("training reward", m.SCORE_MEAN, "mean score", markers=False),
    _Panel("validation score", m.VAL_SCORE_MEAN, "mean score", markers=True),
    _Panel(
        "response length",
        m.RESPONSE_LENGTH_MEAN,
        "tokens",
        markers=False,
        band=(m.RESPONSE_LENGTH_MIN, m.RESPONSE_LENGTH_MAX),
    ),
)


def _series(records: Sequence[MetricsRecord], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records that hold a finite value for it."""
    steps: list[int] = []
    values: list[float] = []
    for record in records:
        value = record.metrics.get(key)
        if value is not None and math.isfinite(value):
            steps.append(record.step)
            values.append(value)
    return steps, values


def plot_run(metrics_jsonl: Path, out_png: Path) -> Path:
    """Draw training reward, validation score and response length against step; return ``out_png``.

    One panel per metric the run logged; absent ones are left out. A run with none of them
    (it died before its first step) still gets a PNG that says so, with a warning, so an
    end-of-run hook never fails on it. Drawn on an Agg canvas without pyplot, so no display
    is needed and no global matplotlib state is touched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics_jsonl, out_png = Path(metrics_jsonl), Path(out_png)
    records = read_metrics_jsonl(metrics_jsonl)
    panels = [(p, _series(records, p.key)) for p in _PANELS]
    panels = [(p, series) for p, series in panels if series[0]]

    fig = Figure(figsize=(5.0 * max(1, len(panels)), 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    if not panels:
        logger.warning("%s: no plottable metrics; writing an empty plot", metrics_jsonl)
        ax = fig.add_subplot(1, 1, 1)
        ax.set_axis_off()
        ax.text(
            0.5, 0.5, f"no plottable metrics in\n{metrics_jsonl.name}", ha="center", va="center"
        )
    for index, (panel, (steps, values)) in enumerate(panels, start=1):
        ax = fig.add_subplot(1, len(panels), index)
        if panel.band is not None:
            low_steps, low = _series(records, panel.band[0])
            high_steps, high = _series(records, panel.band[1])
            if low_steps and low_steps == high_steps:
                ax.fill_between(low_steps, low, high, alpha=0.2, label="min-max")
        ax.plot(steps, values, marker="o" if panel.markers else None, markersize=4, label="mean")
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        if panel.band is not None and len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(loc="best", fontsize="small")
    fig.suptitle(metrics_jsonl.parent.name or str(metrics_jsonl))
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def summarize_run(metrics_jsonl: Path) -> str:
    """A short end-of-run report: how long, how much it learned, where the time went.

    - steps: the number of steps logged, and the first and last step number;
    - total time: the sum of ``timing_s/step``; mean s/step over the steps that timed it;
    - train score first → last: mean ``critic/score/mean`` over the first and the last
      ``SUMMARY_WINDOW_STEPS`` training steps;
    - val score before → after: the first and the last ``val/score/mean``, with their steps;
    - time breakdown: each phase inside the step (``timing_s/<phase>``, the phases of one step
      are disjoint) summed over the run as a share of the summed ``timing_s/step`` (over the
      steps that have one), largest first, then ``other`` for the rest of the step (batching,
      metrics): the shares add up to 100%. Phases outside the step (validation, checkpoints:
      ``TIMING_OUTSIDE_STEP``) are no share of it; their seconds are listed after.
    """
    metrics_jsonl = Path(metrics_jsonl)
    records = read_metrics_jsonl(metrics_jsonl)
    lines = [f"Run summary ({metrics_jsonl})"]
    if not records:
        lines.append("  no steps logged")
        return "\n".join(lines)

    lines.append(f"  steps:        {len(records)} (step {records[0].step} to {records[-1].step})")

    _, step_times = _series(records, m.TIMING_STEP)
    total_time = math.fsum(step_times)
    if step_times:
        lines.append(
            f"  total time:   {total_time:.1f} s ({total_time / len(step_times):.2f} s/step "
            f"over {len(step_times)} timed steps)"
        )

    _, train_scores = _series(records, m.SCORE_MEAN)
    if train_scores:
        window = min(SUMMARY_WINDOW_STEPS, len(train_scores))
        first, last = _mean(train_scores[:window]), _mean(train_scores[-window:])
        lines.append(
            f"  train score:  {first:.4f} -> {last:.4f} (mean of first/last {window} steps)"
        )

    val_steps, val_scores = _series(records, m.VAL_SCORE_MEAN)
    if val_scores:
        lines.append(
            f"  val score:    {val_scores[0]:.4f} -> {val_scores[-1]:.4f} "
            f"(step {val_steps[0]} -> step {val_steps[-1]})"
        )

    if total_time > 0:
        lines += _step_time_shares(records, total_time)
    outside = _phase_totals(records, lambda key: key in m.TIMING_OUTSIDE_STEP, timed_steps_only=False)
    if outside:
        listed = ", ".join(f"{key[len(m.TIMING_PREFIX):]} {seconds:.1f} s" for key, seconds in _largest_first(outside))
        lines.append(f"  outside step time: {listed}")
    return "\n".join(lines)


OTHER_PHASE = "other"
"""The part of a step no named phase timed (collating, balancing, batch metrics)."""


def _step_time_shares(records: Sequence[MetricsRecord], total_time: float) -> list[str]:
    """The phases inside the step as shares of the summed step time, then ``other``."""
    inside = _phase_totals(
        records, lambda key: key != m.TIMING_STEP and key not in m.TIMING_OUTSIDE_STEP, timed_steps_only=True
    )
    if not inside:
        return []
    # Disjoint phases inside the step sum to at most its time; max() absorbs float rounding.
    rows = [(key[len(m.TIMING_PREFIX) :], seconds) for key, seconds in _largest_first(inside)]
    rows.append((OTHER_PHASE, max(0.0, total_time - math.fsum(inside.values()))))
    width = max(len(phase) for phase, _ in rows)
    return ["  time per phase (share of step time):"] + [
        f"    {phase:<{width}}  {100.0 * seconds / total_time:5.1f}%" for phase, seconds in rows
    ]


def _phase_totals(
    records: Sequence[MetricsRecord], wanted: Callable[[str], bool], *, timed_steps_only: bool
) -> dict[str, float]:
    """Seconds per ``timing_s/<phase>`` key that ``wanted`` accepts, summed over the records
    (with ``timed_steps_only``, over those with a finite ``timing_s/step``)."""
    totals: dict[str, float] = {}
    for record in records:
        if timed_steps_only and not math.isfinite(record.metrics.get(m.TIMING_STEP, math.nan)):
            continue  # e.g. validation before training: not part of any step's time
        for key, value in record.metrics.items():
            if key.startswith(m.TIMING_PREFIX) and wanted(key) and math.isfinite(value):
                totals[key] = totals.get(key, 0.0) + value
    return totals


def _largest_first(totals: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(totals.items(), key=lambda kv: -kv[1])

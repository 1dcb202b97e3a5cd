"""The public Python API: what the CLI calls, and what a researcher scripts in a notebook.

    from hybridflow import api
    cfg = api.make_config("grpo", overrides=["rollout.n=4", "trainer.total_training_steps=20"])
    result = api.train(cfg)          # RunResult(output_dir, metrics, ...)

Pieces are usable on their own too: ``hybridflow.data.RLDataset`` to load data,
``hybridflow.rewards.default_compute_score`` / ``RewardManager`` to score,
``hybridflow.rollout.build_rollout_engine`` to generate.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridflow.config import Config, load_config

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    output_dir: Path
    final_metrics: dict[str, float]
    metrics_path: Path
    plot_path: Path | None
    summary: str


def make_config(preset: str | None = "grpo", config_file: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """A validated-on-use config from a preset, an optional YAML file and dotted overrides."""
    return load_config(preset, config_file, overrides)


def train(cfg: Config) -> RunResult:
    """Build the run, fit, then write the plot and print the summary."""
    from hybridflow.controller.restarts import fit_with_restarts
    from hybridflow.controller.run_folder import discard_run_folder_on_failure
    from hybridflow.models.loading import hf_progress_bars_off
    from hybridflow.tracking import plot_run, summarize_run
    from hybridflow.tracking.timeline import TIMELINE_FILENAME

    # Checkpoints save through transformers (in this process with the in-process backend).
    # A run that fails before writing results (a bad model, a reward function that fails to
    # load) takes its new folder with it: runs/ holds runs, not one config.yaml per attempt.
    # A worker's death rebuilds the run and resumes it, up to trainer.max_restarts times.
    with hf_progress_bars_off(), discard_run_folder_on_failure(cfg):
        finished = fit_with_restarts(cfg)
    run, metrics = finished.run, finished.metrics
    metrics_path = run.output_dir / "metrics.jsonl"
    plot_path = summary = None
    if metrics_path.is_file():
        plot_path = plot_run(metrics_path, run.output_dir / "metrics.png")
        summary = summarize_run(metrics_path)
        print(summary)
        print(f"metrics: {metrics_path}\nplot:    {plot_path}")
        if (run.output_dir / TIMELINE_FILENAME).is_file():
            print(f"trace:   {run.output_dir / TIMELINE_FILENAME} (ui.perfetto.dev; hybridflow timeline {run.output_dir})")
    return RunResult(run.output_dir, metrics, metrics_path, plot_path, summary or "")

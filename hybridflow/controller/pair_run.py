"""The run of a method that trains on preference pairs offline: ``hybridflow dpo`` (``dpo_run``) and
``hybridflow rm`` (``rm_run``). What differs between them is what a step computes (a rank's
worker); what is the same lives here: the checks of the shared settings, the pair files (the
user's or the built-in ones) and their loading, the result record, and each rank's loop over steps: the sampler, resume from the newest
checkpoint, validation every ``trainer.test_freq`` steps and at the end, checkpoints (SFT's
format), rank 0's metrics, and the fault point the resume tests kill a run at. The ranks
themselves are the offline trainers' (``controller.ranks``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hybridflow.config import Config, ConfigError
from hybridflow.config.explain import BUILTIN_TINY
from hybridflow.controller.dpo_builtin import builtin_pairs
from hybridflow.controller.sft import rank_rows
from hybridflow.controller.sft_run import OfflineJob, check_offline_run, open_run
from hybridflow.data.preference import PairMaker, PreferenceColumns, PreferencePair, load_preference_pairs, preference_pair
from hybridflow.training import distributed
from hybridflow.utils.faults import maybe_fault
from hybridflow.utils.threads import adjust_threads
from hybridflow.workers.sft import SFTWorker

log = logging.getLogger(__name__)

R = TypeVar("R", bound="PairResult")


@dataclass
class PairResult:
    """What a pair run leaves: its folder, its metrics file, the export (None without one) and the last
    ``val/*`` record (None without validation pairs)."""

    output_dir: Path
    metrics_path: Path
    export_dir: Path | None
    final_val: dict[str, float] | None


def check_pair_run(cfg: Config, command: str, export: bool, export_key: str) -> None:
    """The settings every pair run (``hybridflow <command>``) reads that can be wrong before anything
    loads; ``export``: the value of its ``export_key``."""
    if not cfg.data.train_files and cfg.model.path != BUILTIN_TINY:
        raise ConfigError(f"hybridflow {command} needs data.train_files: parquet or JSONL files with "
                          f"prompt/chosen/rejected columns (the built-in pairs need model.path=builtin:tiny)",
                          key="data.train_files")
    if not cfg.data.train_files and cfg.data.builtin_task != "arithmetic":
        raise ConfigError(f"the built-in preference pairs are made for the arithmetic task, not "
                          f"data.builtin_task={cfg.data.builtin_task}", key="data.builtin_task")
    check_offline_run(cfg, command, "pairs", export, export_key)
    d = cfg.dpo
    for key in ("builtin_prompts", "builtin_samples", "builtin_val_prompts"):
        if getattr(d, key) < 1:
            raise ConfigError(f"dpo.{key}={getattr(d, key)}: must be at least 1", key=f"dpo.{key}")


def pair_files(cfg: Config, model_path: str, prompts: int | None = None,
               ) -> tuple[list[str], list[str], list[dict[str, Any]] | None]:
    """(train files, val files, held-out rows of the built-in task or None): the user's, or without
    ``data.train_files`` the built-in pairs (``controller.dpo_builtin``, settings ``dpo.builtin_*``; ``prompts``:
    the training prompts, None: ``dpo.builtin_prompts``). The held-out pairs do not depend on ``prompts``."""
    if cfg.data.train_files:
        return list(cfg.data.train_files), list(cfg.data.val_files), None
    d = cfg.dpo
    train_prompts = d.builtin_prompts if prompts is None else prompts
    made = builtin_pairs(cfg.warm_start.cache_dir, model_path, prompts=train_prompts,
                         val_prompts=d.builtin_val_prompts, samples=d.builtin_samples)
    return [str(made.train_file)], list(cfg.data.val_files) or [str(made.val_file)], made.val_rows


def load_pair_splits(cfg: Config, command: str, tokenizer: Any, train_files: list[str], val_files: list[str],
                     max_length: int, *, make_pair: PairMaker = preference_pair,
                     template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(training pairs, validation pairs, [] without val files): the files' rows (columns ``data.prompt_key``,
    ``dpo.chosen_key``, ``dpo.rejected_key``) tokenised by ``make_pair``, each file set's counts logged."""
    columns = PreferenceColumns(cfg.data.prompt_key, cfg.dpo.chosen_key, cfg.dpo.rejected_key)

    def load(files: list[str]) -> list[PreferencePair]:
        pairs, stats = load_preference_pairs(files, tokenizer, columns, max_length=max_length,
                                             on_bad_row=cfg.data.on_bad_row, template_kwargs=template_kwargs,
                                             make_pair=make_pair)
        log.info("%s: %s: %s", command, ", ".join(files), stats.describe())
        return pairs

    return load(train_files), load(val_files) if val_files else []


@dataclass(frozen=True)
class PairSteps:
    """What one rank's loop calls. ``step(rows)``: one optimizer step on this rank's pairs of the step
    (indices into the training pairs), returning the step's record, already reduced over ranks (a
    collective). ``validate()``: the ``val/*`` record (a collective); not called without validation pairs."""

    step: Callable[[list[int]], dict[str, float]]
    validate: Callable[[], dict[str, float]] | None


def train_pair_steps(rank: int, world: int, job: OfflineJob[PreferencePair], sft: SFTWorker,
                     steps: PairSteps) -> dict[str, float] | None:
    """Resume, then train until ``job.total_steps``; the last validation record (see the module docstring)."""
    cfg, total_steps = job.cfg, job.total_steps
    steps = PairSteps(steps.step, steps.validate if job.val else None)
    run = open_run(cfg, Path(job.output_dir), len(job.train), sft, rank)
    sampler, tracker, start_step = run.sampler, run.tracker, run.start_step
    try:
        final_val = None
        if start_step == 0 and cfg.trainer.val_before_train and steps.validate is not None:
            record = steps.validate()  # a collective: every rank evaluates
            if tracker is not None:
                tracker.log(record, step=0)
        for step in range(start_step + 1, total_steps + 1):
            adjust_threads()
            clock = time.perf_counter()
            record = steps.step(list(rank_rows(sampler.next_batch(), rank, world)))
            record.update({"train/pairs_per_s": cfg.data.train_batch_size / max(time.perf_counter() - clock, 1e-9),
                           "train/epoch": sampler.epoch})
            if steps.validate is not None and run.validate_due(step, total_steps):
                final_val = steps.validate()
                record.update(final_val)
            run.save_if_due(step, total_steps, sft)
            if tracker is not None:
                tracker.log(record, step=step)
            maybe_fault("after_step", step)  # tests kill the run here (SIGKILL) and resume it
        if start_step >= total_steps and steps.validate is not None:
            final_val = steps.validate()  # nothing left to train: the model as it stands
        return final_val
    finally:
        if tracker is not None:
            tracker.close()


def reduce_shares(metrics: dict[str, float], names: list[str], prefix: str) -> dict[str, float]:
    """The step's means of ``names`` over every rank and micro-batch, from each rank's ``<prefix><name>_share``
    (a collective); ``loss`` is reported as ``train/loss``. Adds the engine's ``train/lr``, ``train/grad_norm``."""
    means = distributed.all_reduce_sum([metrics[f"{prefix}{n}_share"] for n in names])
    record = {("train/loss" if n == "loss" else n): v for n, v in zip(names, means, strict=True)}
    record.update({"train/lr": metrics["train/lr"], "train/grad_norm": metrics["train/grad_norm"]})
    return record


def run_pair_cli(run_job: Callable[[Config], R], cfg: Config, shown: tuple[str, ...]) -> R:
    """``hybridflow dpo`` / ``rm``: ``run_job(cfg)`` without Hugging Face's progress bars, then the final
    ``val/loss`` and the ``shown`` validation metrics printed on one line (when there was validation)."""
    from hybridflow.models.loading import hf_progress_bars_off

    with hf_progress_bars_off():
        result = run_job(cfg)
    if result.final_val is not None:
        val = result.final_val
        print("  ".join([f"final val/loss {val['val/loss']:.4f}", *(f"{k} {val[k]:.3f}" for k in shown)]))
    return result


__all__ = ["PairResult", "PairSteps", "check_pair_run", "load_pair_splits", "pair_files", "reduce_shares",
           "run_pair_cli", "train_pair_steps"]

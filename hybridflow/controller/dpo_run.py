"""``hybridflow dpo``: offline direct preference optimisation on (prompt, chosen, rejected) pairs.

The run is ``hybridflow sft``'s (``controller.sft_run``) with a preference loss: the pairs
(``hybridflow.data.preference``) are read, checked and tokenised once in the launching process; each
rank (one in this process, or ``trainer.n_workers`` / GPU ranks started from a forkserver, FSDP2
sharded) is an ``SFTWorker`` engine (LoRA, packing, token budgets, checkpoints) driven through a
``DPOWorker`` (``hybridflow.workers.dpo``). The frozen reference is the starting model: its sequence
log-probabilities of every pair are computed once before training (and again, identically, when a
run resumes), so no second model is held; ``dpo.reference_free`` drops it.

Rank 0 logs TRL's metrics per step (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``; exact means over every rank and micro-batch)
with ``train/loss``, ``train/lr``, ``train/grad_norm``, and the same on the validation pairs as
``val/*`` every ``trainer.test_freq`` steps and at the end. Checkpoints, resume and the export are
SFT's. Without ``data.train_files`` and with the built-in model, the pairs are built by our own code
(``controller.dpo_builtin``) and the held-out greedy accuracy is measured before and after training.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.algorithms.preference import PREFERENCE_METRICS, check_preference_loss
from hybridflow.config import Config, ConfigError, config_to_yaml
from hybridflow.config.explain import BUILTIN_TINY
from hybridflow.config.layout import data_parallel_size
from hybridflow.controller.checkpoint import CheckpointManager
from hybridflow.controller.dpo_builtin import builtin_pairs, greedy_accuracy
from hybridflow.controller.export import export_checkpoint
from hybridflow.controller.ranks import run_ranks
from hybridflow.controller.setup import (
    config_device,
    policy_chat_template,
    resolve_builtin,
    resolve_output_dir,
)
from hybridflow.controller.sft import rank_rows
from hybridflow.controller.sft_run import EXPORT_DIR, _resume, _save
from hybridflow.data import ResumableSampler
from hybridflow.data.preference import (
    PreferenceColumns,
    PreferencePair,
    load_preference_pairs,
)
from hybridflow.models.loading import load_tokenizer
from hybridflow.tracking.loggers import Tracker
from hybridflow.training import distributed
from hybridflow.utils.faults import maybe_fault
from hybridflow.utils.threads import adjust_threads
from hybridflow.workers.dpo import DPOLossSpec, DPOWorker
from hybridflow.workers.sft import SFTWorker

log = logging.getLogger(__name__)

PRELOAD = ["torch", "transformers", "hybridflow.controller.dpo_run"]
EVAL_FILE = "dpo_eval.json"


@dataclass
class DPOResult:
    output_dir: Path
    metrics_path: Path
    export_dir: Path | None
    final_val: dict[str, float] | None
    greedy_accuracy: tuple[float, float] | None  # built-in pairs: (before, after) on held-out prompts


@dataclass(frozen=True)
class _Job:
    cfg: Config
    model_path: str
    output_dir: str
    train: list[PreferencePair]
    val: list[PreferencePair]
    total_steps: int
    pad_token_id: int
    max_length: int


def check_dpo_config(cfg: Config) -> None:
    """The settings ``hybridflow dpo`` reads that can be wrong before anything loads."""
    d = cfg.dpo
    try:
        check_preference_loss(d.loss_type, d.beta, d.label_smoothing)
    except ValueError as exc:
        key = "dpo.beta" if "beta" in str(exc).split("=")[0] else (
            "dpo.label_smoothing" if "smoothing" in str(exc).split("=")[0] else "dpo.loss_type")
        raise ConfigError(f"dpo: {exc}", key=key) from None
    if not cfg.data.train_files and cfg.model.path != BUILTIN_TINY:
        raise ConfigError("hybridflow dpo needs data.train_files: parquet or JSONL files with prompt/chosen/rejected "
                          "columns (the built-in pairs need model.path=builtin:tiny)", key="data.train_files")
    if not cfg.data.train_files and cfg.data.builtin_task != "arithmetic":
        raise ConfigError(f"the built-in preference pairs are made for the arithmetic task, not "
                          f"data.builtin_task={cfg.data.builtin_task}", key="data.builtin_task")
    if cfg.trainer.backend != "local":
        raise ConfigError("hybridflow dpo runs its ranks as local processes (there is no rollout to place on a "
                          "cluster); use trainer.backend=local", key="trainer.backend")
    if d.export and not cfg.trainer.save_final:
        raise ConfigError("dpo.export=true exports the final checkpoint, but trainer.save_final=false; set one of them",
                          key="dpo.export")
    if cfg.actor.ulysses_sequence_parallel_size != 1:
        raise ConfigError("hybridflow dpo does not use Ulysses sequence parallelism; set "
                          "actor.ulysses_sequence_parallel_size=1", key="actor.ulysses_sequence_parallel_size")
    world = data_parallel_size(cfg.trainer)
    if cfg.data.train_batch_size % world:
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} pairs per step do not split over "
                          f"{world} ranks", key="data.train_batch_size")
    if d.max_length is not None and d.max_length < 2:
        raise ConfigError(f"dpo.max_length={d.max_length}: need at least 2 tokens", key="dpo.max_length")
    if d.sft_weight < 0:
        raise ConfigError(f"dpo.sft_weight={d.sft_weight}: must be >= 0", key="dpo.sft_weight")
    for key in ("builtin_prompts", "builtin_samples", "builtin_val_prompts"):
        if getattr(d, key) < 1:
            raise ConfigError(f"dpo.{key}={getattr(d, key)}: must be at least 1", key=f"dpo.{key}")


def _pair_files(cfg: Config, model_path: str) -> tuple[list[str], list[str], list[dict[str, Any]] | None]:
    """(train files, val files, held-out rows for the greedy accuracy or None): the user's, or built-in."""
    if cfg.data.train_files:
        return list(cfg.data.train_files), list(cfg.data.val_files), None
    d = cfg.dpo
    made = builtin_pairs(cfg.warm_start.cache_dir, model_path, prompts=d.builtin_prompts,
                         val_prompts=d.builtin_val_prompts, samples=d.builtin_samples)
    return [str(made.train_file)], list(cfg.data.val_files) or [str(made.val_file)], made.val_rows


def run_dpo_job(cfg: Config) -> DPOResult:
    """Train ``model.path`` on the preference pairs of ``data.train_files``; see the module docstring."""
    check_dpo_config(cfg)
    device = config_device(cfg.trainer.device)
    model_path, _, _ = resolve_builtin(cfg, device)
    train_files, val_files, held_out = _pair_files(cfg, model_path)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code, policy_chat_template(cfg.data))
    columns = PreferenceColumns(cfg.data.prompt_key, cfg.dpo.chosen_key, cfg.dpo.rejected_key)
    length = cfg.dpo.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length
    def load(files: list[str]):
        return load_preference_pairs(files, tokenizer, columns, max_length=length, on_bad_row=cfg.data.on_bad_row,
                                     template_kwargs=cfg.data.apply_chat_template_kwargs)

    train, stats = load(train_files)
    val = load(val_files)[0] if val_files else []
    log.info("dpo: %s", stats.describe())
    if cfg.data.train_batch_size > len(train):
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} is larger than the {len(train)} training "
                          f"pairs", key="data.train_batch_size")
    total = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * (len(train) // cfg.data.train_batch_size)
    out = resolve_output_dir(cfg)
    (out / "config.yaml").write_text(config_to_yaml(cfg))
    before = greedy_accuracy(model_path, held_out) if held_out else None
    job = _Job(cfg, model_path, str(out), train, val, total, int(tokenizer.pad_token_id), length)
    final_val = run_ranks(data_parallel_size(cfg.trainer), _train, job, PRELOAD)
    export_dir = None
    if cfg.dpo.export:
        export_dir = export_checkpoint(out, out / EXPORT_DIR, overwrite=True)
        print(f"exported: {export_dir} (hybridflow train model.path={export_dir})")
    accuracy = None
    if held_out and before is not None and export_dir is not None:
        accuracy = (before, greedy_accuracy(export_dir, held_out))
        (out / EVAL_FILE).write_text(json.dumps({"held_out_prompts": len(held_out), "greedy_accuracy_before":
                                                 accuracy[0], "greedy_accuracy_after": accuracy[1]}, indent=1) + "\n")
    return DPOResult(out, out / "metrics.jsonl", export_dir, final_val, accuracy)


def _train(rank: int, world: int, job: _Job, device) -> dict[str, float] | None:
    cfg, d = job.cfg, job.cfg.dpo
    out = Path(job.output_dir)
    sft = SFTWorker(rank, world, cfg, job.model_path, device, total_steps=job.total_steps, max_length=job.max_length,
                    chat_template=policy_chat_template(cfg.data))
    worker = DPOWorker(sft, DPOLossSpec(d.loss_type, d.beta, d.label_smoothing, d.reference_free, d.sft_weight), job.pad_token_id)
    # Before any step and before a resume loads its checkpoint: the starting weights are the reference.
    ref_train, ref_val = worker.reference_logps(job.train), worker.reference_logps(job.val) if job.val else None
    seed = cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed
    sampler = ResumableSampler(len(job.train), cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=seed)
    manager = CheckpointManager(out / "checkpoints", cfg.trainer.max_ckpt_to_keep)
    start_step = _resume(manager, sft, sampler, cfg, rank)
    tracker = None
    if rank == 0:
        tracker = Tracker(cfg.trainer.logger, output_dir=out, project=cfg.trainer.project_name,
                          experiment=cfg.trainer.experiment_name, config={})

    def validate() -> dict[str, float]:
        assert ref_val is not None
        return {f"val/{k}": v for k, v in worker.evaluate(job.val, ref_val).items()}

    try:
        final_val = None
        if start_step == 0 and cfg.trainer.val_before_train and job.val:
            record = validate()  # a collective: every rank evaluates
            if tracker is not None:
                tracker.log(record, step=0)
        for step in range(start_step + 1, job.total_steps + 1):
            adjust_threads()
            clock = time.perf_counter()
            rows = list(rank_rows(sampler.next_batch(), rank, world))
            metrics = worker.train_step([job.train[i] for i in rows], ref_train[rows], cfg.data.train_batch_size)
            names = ["loss", *PREFERENCE_METRICS]
            means = distributed.all_reduce_sum([metrics[f"dpo/{n}_share"] for n in names])
            record = {("train/loss" if n == "loss" else n): v for n, v in zip(names, means, strict=True)}
            record.update({"train/lr": metrics["train/lr"], "train/grad_norm": metrics["train/grad_norm"],
                           "train/pairs_per_s": cfg.data.train_batch_size / max(time.perf_counter() - clock, 1e-9),
                           "train/epoch": sampler.epoch})
            last = step == job.total_steps
            if job.val and (last or (cfg.trainer.test_freq > 0 and step % cfg.trainer.test_freq == 0)):
                val = validate()
                record.update(val)
                final_val = val
            if (last and cfg.trainer.save_final) or (cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0):
                _save(manager, sft, step, sampler, cfg, rank)
            if tracker is not None:
                tracker.log(record, step=step)
            maybe_fault("after_step", step)  # tests kill the run here (SIGKILL) and resume it
        if start_step >= job.total_steps and job.val:
            final_val = validate()
        return final_val
    finally:
        if tracker is not None:
            tracker.close()


def dpo_cli(cfg: Config) -> DPOResult:
    """``hybridflow dpo``: run, then say where the results are."""
    from hybridflow.models.loading import hf_progress_bars_off

    with hf_progress_bars_off():
        result = run_dpo_job(cfg)
    if result.final_val is not None:
        print(f"final val/loss {result.final_val['val/loss']:.4f}  val/rewards/accuracies "
              f"{result.final_val['val/rewards/accuracies']:.3f}")
    if result.greedy_accuracy is not None:
        before, after = result.greedy_accuracy
        print(f"held-out greedy accuracy {before:.3f} -> {after:.3f}")
    print(f"metrics: {result.metrics_path}")
    return result


__all__ = ["DPOResult", "check_dpo_config", "dpo_cli", "run_dpo_job"]

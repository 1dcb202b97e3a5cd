"""``hybridflow dpo``: offline direct preference optimisation on (prompt, chosen, rejected) pairs.

The run is ``hybridflow sft``'s (``controller.sft_run``) with a preference loss: the pairs
(``hybridflow.data.preference``) are read, checked and tokenised once in the launching process; each
rank (one in this process, or ``trainer.n_workers`` / GPU ranks started from a forkserver or, with
``trainer.backend=ray``, as Ray actors: ``controller.ranks``; FSDP2 sharded) is an ``SFTWorker`` engine
(LoRA, packing, token budgets, checkpoints) driven through a ``DPOWorker`` (``hybridflow.workers.dpo``). The frozen reference is the starting model: its sequence
log-probabilities of every pair are computed once before training (and again, identically, when a
run resumes), so no second model is held; ``dpo.reference_free`` drops it.

Rank 0 logs TRL's metrics per step (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``; exact means over every rank and micro-batch)
with ``train/loss``, ``train/lr``, ``train/grad_norm``, and the same on the validation pairs as
``val/*`` every ``trainer.test_freq`` steps and at the end. Checkpoints, resume and the export are
SFT's; the ranks and the loop over steps are the pair runs' (``controller.pair_run``). Without ``data.train_files`` and with the built-in model, the pairs are built by our own code
(``controller.dpo_builtin``) and the held-out greedy accuracy is measured before and after training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from hybridflow.algorithms.preference import PREFERENCE_METRICS, check_preference_loss
from hybridflow.config import Config, ConfigError
from hybridflow.config.layout import data_parallel_size
from hybridflow.controller.dpo_builtin import greedy_accuracy
from hybridflow.controller.pair_run import (  # the run's checks, pair files and loop, shared with hybridflow rm
    PairResult,
    PairSteps,
    check_pair_run,
    load_pair_splits,
    pair_files,
    reduce_shares,
    run_pair_cli,
    train_pair_steps,
)
from hybridflow.controller.ranks import run_ranks
from hybridflow.controller.builtin import resolve_builtin
from hybridflow.controller.preflight import config_device, policy_chat_template
from hybridflow.controller.sft_run import OfflineJob, export_final, open_output_dir, total_steps
from hybridflow.data.preference import PreferencePair
from hybridflow.models.loading import load_tokenizer
from hybridflow.workers.dpo import DPOLossSpec, DPOWorker
from hybridflow.workers.sft import SFTWorker

PRELOAD = ["torch", "transformers", "hybridflow.controller.dpo_run"]
EVAL_FILE = "dpo_eval.json"


@dataclass
class DPOResult(PairResult):
    greedy_accuracy: tuple[float, float] | None = None  # built-in pairs: (before, after) on held-out prompts


def check_dpo_config(cfg: Config) -> None:
    """The settings ``hybridflow dpo`` reads that can be wrong before anything loads."""
    d = cfg.dpo
    try:
        check_preference_loss(d.loss_type, d.beta, d.label_smoothing)
    except ValueError as exc:
        key = "dpo.beta" if "beta" in str(exc).split("=")[0] else (
            "dpo.label_smoothing" if "smoothing" in str(exc).split("=")[0] else "dpo.loss_type")
        raise ConfigError(f"dpo: {exc}", key=key) from None
    check_pair_run(cfg, "dpo", d.export, "dpo.export")
    if d.max_length is not None and d.max_length < 2:
        raise ConfigError(f"dpo.max_length={d.max_length}: need at least 2 tokens", key="dpo.max_length")
    if d.sft_weight < 0:
        raise ConfigError(f"dpo.sft_weight={d.sft_weight}: must be >= 0", key="dpo.sft_weight")


def run_dpo_job(cfg: Config) -> DPOResult:
    """Train ``model.path`` on the preference pairs of ``data.train_files``; see the module docstring."""
    check_dpo_config(cfg)
    device = config_device(cfg.trainer.device)
    model_path, _, _ = resolve_builtin(cfg, device)
    train_files, val_files, held_out = pair_files(cfg, model_path)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code, policy_chat_template(cfg.data))
    length = cfg.dpo.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length
    train, val = load_pair_splits(cfg, "dpo", tokenizer, train_files, val_files, length,
                                  template_kwargs=cfg.data.apply_chat_template_kwargs)
    total = total_steps(cfg, len(train), "pairs")
    out = open_output_dir(cfg)
    before = greedy_accuracy(model_path, held_out) if held_out else None
    job = OfflineJob(cfg, model_path, str(out), train, val, total, int(tokenizer.pad_token_id), length)
    final_val = run_ranks("dpo", data_parallel_size(cfg.trainer), _train_rank, job, PRELOAD)
    export_dir = export_final(out) if cfg.dpo.export else None
    accuracy = None
    if held_out and before is not None and export_dir is not None:
        accuracy = (before, greedy_accuracy(export_dir, held_out))
        (out / EVAL_FILE).write_text(json.dumps({"held_out_prompts": len(held_out), "greedy_accuracy_before":
                                                 accuracy[0], "greedy_accuracy_after": accuracy[1]}, indent=1) + "\n")
    return DPOResult(out, out / "metrics.jsonl", export_dir, final_val, accuracy)


def _train_rank(rank: int, world: int, job: OfflineJob[PreferencePair], device: torch.device) -> dict[str, float] | None:
    cfg, d = job.cfg, job.cfg.dpo
    sft = SFTWorker(rank, world, cfg, job.model_path, device, total_steps=job.total_steps, max_length=job.max_length,
                    chat_template=policy_chat_template(cfg.data))
    worker = DPOWorker(sft, DPOLossSpec(d.loss_type, d.beta, d.label_smoothing, d.reference_free, d.sft_weight), job.pad_token_id)
    # Before any step and before a resume loads its checkpoint: the starting weights are the reference.
    ref_train, ref_val = worker.reference_logps(job.train), worker.reference_logps(job.val) if job.val else None
    names = ["loss", *PREFERENCE_METRICS]

    def step(rows: list[int]) -> dict[str, float]:
        metrics = worker.train_step([job.train[i] for i in rows], ref_train[rows], cfg.data.train_batch_size)
        return reduce_shares(metrics, names, "dpo/")

    def validate() -> dict[str, float]:
        assert ref_val is not None
        return {f"val/{k}": v for k, v in worker.evaluate(job.val, ref_val).items()}

    return train_pair_steps(rank, world, job, sft, PairSteps(step, validate))


def dpo_cli(cfg: Config) -> DPOResult:
    """``hybridflow dpo``: run, then say where the results are."""
    result = run_pair_cli(run_dpo_job, cfg, ("val/rewards/accuracies",))
    if result.greedy_accuracy is not None:
        before, after = result.greedy_accuracy
        print(f"held-out greedy accuracy {before:.3f} -> {after:.3f}")
    print(f"metrics: {result.metrics_path}")
    return result


__all__ = ["DPOResult", "check_dpo_config", "dpo_cli", "run_dpo_job"]

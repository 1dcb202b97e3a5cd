"""``hybridflow rm``: train a reward model (a one-label sequence classifier) on preference pairs with
the Bradley-Terry loss, and export it as the folder ``reward_model.model.path`` loads.

The pairs are ``hybridflow dpo``'s (``hybridflow.data.preference``: TRL's prompt/chosen/rejected rows,
parquet or JSONL; without ``data.train_files`` and with the built-in model, the built-in arithmetic
pairs of ``controller.dpo_builtin``, the right answer against the warm-started model's own wrong one),
rendered as the reward-model role renders an answer (``workers.reward_trainer.reward_model_pair``).
The model starts from ``model.path`` (with the built-in pairs, from the built-in teacher:
``rm_start_path``): a causal LM gets a new, zero one-label head; a reward model keeps its own. The
ranks are the offline trainers' (``controller.ranks``); checkpoints, resume and the loop are the pair
runs' (``controller.pair_run``).

Rank 0 logs ``train/loss`` (the Bradley-Terry loss), ``rm/accuracy`` (the share of pairs scored
chosen above rejected), ``rm/margin`` (the mean score difference), ``rm/chosen``, ``rm/rejected``,
``train/lr``, ``train/grad_norm``, and the same on the validation pairs as ``val/*`` every
``trainer.test_freq`` steps and at the end. The export is checked by loading it as the role does.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch

from hybridflow.algorithms.preference import REWARD_MODEL_METRICS
from hybridflow.config import Config, ConfigError
from hybridflow.config.explain import BUILTIN_TINY
from hybridflow.config.layout import data_parallel_size
from hybridflow.controller.builtin import builtin_teacher, resolve_builtin
from hybridflow.controller.export import export_checkpoint
from hybridflow.controller.pair_run import (
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
from hybridflow.controller.preflight import config_device, policy_chat_template
from hybridflow.controller.sft_run import EXPORT_DIR, OfflineJob, open_output_dir, total_steps
from hybridflow.data.preference import PreferencePair
from hybridflow.data.tasks.arithmetic import ARITHMETIC_TRAIN_QUESTIONS
from hybridflow.models.loading import (
    load_model_config,
    load_reward_model_to_train,
    load_sequence_classifier,
    load_tokenizer,
)
from hybridflow.workers.reward_trainer import RewardTrainerWorker, reward_model_pair
from hybridflow.workers.sft import SFTWorker

PRELOAD = ["torch", "transformers", "hybridflow.controller.rm_run"]
EVAL_FILE = "rm_eval.json"


RMResult = PairResult  # hybridflow rm reports what every pair run does


def check_rm_config(cfg: Config) -> None:
    """The settings ``hybridflow rm`` reads that can be wrong before anything loads."""
    r = cfg.rm
    check_pair_run(cfg, "rm", r.export, "rm.export")
    if cfg.actor.lora.rank > 0:
        # An adapter would leave the new head untrained, and the export merges adapters into a causal LM.
        raise ConfigError("hybridflow rm trains the whole classifier; LoRA is not built for it (set actor.lora.rank=0)",
                          key="actor.lora.rank")
    if r.max_length is not None and r.max_length < 2:
        raise ConfigError(f"rm.max_length={r.max_length}: need at least 2 tokens", key="rm.max_length")
    if r.center_rewards_coefficient < 0:
        raise ConfigError(f"rm.center_rewards_coefficient={r.center_rewards_coefficient}: must be >= 0",
                          key="rm.center_rewards_coefficient")
    if r.builtin_teacher_steps < 0:
        raise ConfigError(f"rm.builtin_teacher_steps={r.builtin_teacher_steps}: must be >= 0 (0: start from the "
                          "warm start)", key="rm.builtin_teacher_steps")
    if r.head_lr is not None and not r.head_lr > 0:
        raise ConfigError(f"rm.head_lr={r.head_lr}: must be > 0 (null: actor.optim.lr)", key="rm.head_lr")
    if not 1 <= r.builtin_prompts <= ARITHMETIC_TRAIN_QUESTIONS:
        raise ConfigError(f"rm.builtin_prompts={r.builtin_prompts}: must be 1 to {ARITHMETIC_TRAIN_QUESTIONS} (the "
                          "arithmetic task's training questions)", key="rm.builtin_prompts")
    if r.extra_layers < 0:
        raise ConfigError(f"rm.extra_layers={r.extra_layers}: must be >= 0", key="rm.extra_layers")


def rm_max_length(cfg: Config, model_path: str) -> int:
    """``rm.max_length``, or what the reward-model role cuts at by default: the model's max_position_embeddings."""
    if cfg.rm.max_length is not None:
        return cfg.rm.max_length
    return int(load_model_config(model_path, trust_remote_code=cfg.model.trust_remote_code).max_position_embeddings)


def rm_start_path(cfg: Config, model_path: str, device: torch.device) -> str:
    """The folder the reward model starts from: ``model_path`` (``model.path`` resolved), or with the
    built-in pairs the built-in teacher of ``rm.builtin_teacher_steps`` (see ``RMConfig``): the pairs'
    answers differ in one digit, so the score must check the sum, which the teacher already computes."""
    if cfg.data.train_files or cfg.model.path != BUILTIN_TINY or cfg.rm.builtin_teacher_steps == 0:
        return model_path
    return builtin_teacher(cfg, device, cfg.rm.builtin_teacher_steps)


def run_rm_job(cfg: Config) -> RMResult:
    """Train a reward model from ``model.path`` on preference pairs; see the module docstring."""
    check_rm_config(cfg)
    device = config_device(cfg.trainer.device)
    pairs_model, _, _ = resolve_builtin(cfg, device)
    # The built-in pairs: the warm start's own answers, on rm.builtin_prompts of the task's training questions.
    train_files, val_files, _ = pair_files(cfg, pairs_model, prompts=cfg.rm.builtin_prompts)
    model_path = rm_start_path(cfg, pairs_model, device)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code, policy_chat_template(cfg.data))
    train, val = load_pair_splits(cfg, "rm", tokenizer, train_files, val_files, rm_max_length(cfg, model_path),
                                  make_pair=reward_model_pair)
    total = total_steps(cfg, len(train), "pairs")
    out = open_output_dir(cfg)
    # The micro-batch plan cuts at the longest rendered side, not at rm.max_length.
    longest = max(max(len(p.chosen.prompt_ids), len(p.rejected.prompt_ids)) for p in train + val)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    job = OfflineJob(cfg, model_path, str(out), train, val, total, int(pad), longest)
    final_val = run_ranks("rm", data_parallel_size(cfg.trainer), _train_rank, job, PRELOAD)
    export_dir = None
    if cfg.rm.export:
        export_dir = Path(export_checkpoint(out, out / EXPORT_DIR, overwrite=True))
        load_sequence_classifier(export_dir)  # what reward_model.model.path does with it
        print(f"exported: {export_dir} (hybridflow train reward_model.enable=true reward_model.model.path={export_dir})")
    if final_val is not None:
        (out / EVAL_FILE).write_text(json.dumps({"val_pairs": len(val), **final_val}, indent=1) + "\n")
    return RMResult(out, out / "metrics.jsonl", export_dir, final_val)


def _train_rank(rank: int, world: int, job: OfflineJob[PreferencePair], device: torch.device) -> dict[str, float] | None:
    cfg = job.cfg
    sft = SFTWorker(rank, world, cfg, job.model_path, device, total_steps=job.total_steps, max_length=job.max_length,
                    chat_template=policy_chat_template(cfg.data),
                    load_model=partial(load_reward_model_to_train, pad_token_id=job.pad_token_id,
                                       extra_layers=cfg.rm.extra_layers),
                    head_lr=cfg.rm.head_lr)
    worker = RewardTrainerWorker(sft, cfg.rm.center_rewards_coefficient, job.pad_token_id)
    names = ["loss", *REWARD_MODEL_METRICS]

    def step(rows: list[int]) -> dict[str, float]:
        metrics = worker.train_step([job.train[i] for i in rows], cfg.data.train_batch_size)
        return reduce_shares(metrics, names, "")

    def validate() -> dict[str, float]:
        return {f"val/{k}": v for k, v in worker.evaluate(job.val).items()}

    return train_pair_steps(rank, world, job, sft, PairSteps(step, validate))


def rm_cli(cfg: Config) -> RMResult:
    """``hybridflow rm``: run, then say where the results are."""
    result = run_pair_cli(run_rm_job, cfg, ("val/rm/accuracy", "val/rm/margin"))
    print(f"metrics: {result.metrics_path}")
    return result


__all__ = ["RMResult", "check_rm_config", "rm_cli", "rm_max_length", "rm_start_path", "run_rm_job"]

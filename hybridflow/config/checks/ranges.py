"""One key at a time: integers within their bounds, finite floats, optimizer and sampling values, names
from a fixed list (loss aggregation, KL estimators, loggers)."""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

from hybridflow.config.checks.report import Report, key_help, key_value
from hybridflow.config.schema import Config, OptimConfig
from hybridflow.config.sections.trainer import FOLLOW_FREE_CORES


LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""verl's loss aggregation modes (see algorithms/); the only values ``actor.loss_agg_mode`` takes."""


KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""verl's KL estimators; a trailing ``+`` selects the straight-through variant (value of the
estimator, gradient of k2)."""


LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
"""Backends ``trainer.logger`` may list."""


_POSITIVE_INTS: tuple[tuple[str, int], ...] = (
    ("data.train_batch_size", 1),
    ("data.val_batch_size", 1),
    ("data.max_prompt_length", 1),
    ("data.max_response_length", 1),
    ("data.builtin_train_size", 1),
    ("data.builtin_val_size", 1),
    ("warm_start.steps", 0),
    ("warm_start.batch_size", 1),
    ("actor.ppo_mini_batch_size", 1),
    ("actor.ppo_micro_batch_size_per_gpu", 1),
    ("actor.log_prob_micro_batch_size_per_gpu", 1),
    ("actor.ppo_epochs", 1),
    ("critic.ppo_micro_batch_size_per_gpu", 1),
    ("critic.forward_micro_batch_size_per_gpu", 1),
    ("ref.log_prob_micro_batch_size_per_gpu", 1),
    ("rollout.n", 1),
    ("rollout.max_batch_size", 1),
    ("rollout.tensor_model_parallel_size", 1),
    ("rollout.sleep_level", 1),
    ("rollout.max_num_batched_tokens", 1),
    ("rollout.min_replicas", 1),
    ("async_training.staleness_threshold", 0),
    ("rollout.val_kwargs.n", 1),
    ("rollout.multi_turn.max_assistant_turns", 1),
    ("rollout.multi_turn.max_parallel_calls", 1),
    # Room for a short reply and the truncation marker ("...(truncated)", 14 characters).
    ("rollout.multi_turn.max_tool_response_length", 16),
    ("reward.num_workers", 1),
    ("algorithm.kl_ctrl.horizon", 1),
    ("trainer.total_epochs", 1),
    ("trainer.n_gpus_per_node", 1),
    ("trainer.nnodes", 1),
    ("trainer.max_restarts", 0),
    ("trainer.dump_max_samples", 1),
    ("trainer.log_val_generations", 0),
    ("trainer.dump_max_chars", 1),
)
"""Integer keys and their minimum (checked with the field's help text in the message)."""


_OPTIONAL_POSITIVE_INTS: tuple[tuple[str, int], ...] = (
    ("rollout.max_replicas", 1),
    ("rollout.max_replica_restarts", 0),
    ("trainer.n_workers", 1),
    ("trainer.total_training_steps", 1),
    ("trainer.max_ckpt_to_keep", 1),
    ("critic.ppo_epochs", 1),
    ("critic.ppo_mini_batch_size", 1),
    ("rollout.multi_turn.max_user_turns", 0),  # verl's 0 is no bound, as null
    ("rollout.kv_cache_memory_bytes", 1),
)
"""Like ``_POSITIVE_INTS`` but None is allowed (it means "no limit" / "default")."""


_MAXIMA: tuple[tuple[str, int, str], ...] = (
    # Each cap is far above any real use and far below what silently hangs or exhausts memory: a
    # value past it is a typo (an extra zero, 1e8 for 8), and the run would otherwise sit silent.
    ("rollout.n", 4096, "samples per prompt"),
    ("rollout.val_kwargs.n", 4096, "samples per validation prompt"),
    ("data.train_batch_size", 1 << 20, "prompts per step"),
    ("data.val_batch_size", 1 << 20, "validation prompts per generation call"),
    ("data.max_prompt_length", 1 << 20, "tokens"),
    ("data.max_response_length", 1 << 20, "tokens"),
    ("rollout.max_batch_size", 1 << 16, "sequences decoded together"),
    ("rollout.tensor_model_parallel_size", 1024, "ranks per rollout replica"),
    ("rollout.sleep_level", 2, "(1: KV cache, 2: KV cache and weights)"),
    ("rollout.multi_turn.max_assistant_turns", 1024, "turns per episode"),
    ("rollout.multi_turn.max_parallel_calls", 1024, "tool calls per turn"),
    ("rollout.multi_turn.max_tool_response_length", 1 << 20, "characters"),
    ("reward.num_workers", 256, "scoring processes"),
    ("actor.ppo_epochs", 1000, "passes over each rollout batch"),
    ("warm_start.steps", 10_000_000, "SFT steps"),
)
"""Integer keys and their largest accepted value, with the unit for the message."""


MAX_SAMPLES_PER_STEP = 1 << 20
"""``data.train_batch_size x rollout.n``: one step's trajectories all live in memory at once."""


MAX_DEVICE_MEMORY_GB = 1 << 20
"""``trainer.device_memory_gb`` above this (1 PiB) is a typo, not a device (NaN fails the same check)."""


MIN_TRAIN_TEMPERATURE = 1e-2
"""The trainer recomputes logprobs of logits / temperature. At 0 they are undefined (greedy has
no distribution) and far below 1e-2 they overflow float32 (1e-45 turns logits into inf), so the
loss is NaN at every step. Real RL sampling uses 0.6-1.2; validation may still decode greedily."""


def _check_finite(node: Any, prefix: str, report: Report) -> None:
    """Every float in the config is finite: YAML's .inf and .nan parse as floats, and no key means
    anything by them."""
    for fld in dataclasses.fields(node):
        value = getattr(node, fld.name)
        path = f"{prefix}{fld.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, f"{path}.", report)
        elif isinstance(value, float) and not math.isfinite(value):
            report.error(f"{path}={value} must be a finite number")


def _check_maxima(cfg: Config, report: Report) -> None:
    for path, maximum, unit in _MAXIMA:
        value = key_value(cfg, path)
        if value is not None and value > maximum:
            report.error(f"{path}={value} is over the limit of {maximum} {unit}; is it a typo?")
    samples = cfg.data.train_batch_size * cfg.rollout.n
    if samples > MAX_SAMPLES_PER_STEP:
        report.error(
            f"data.train_batch_size={cfg.data.train_batch_size} x rollout.n={cfg.rollout.n} = {samples} samples per "
            f"step is over the limit of {MAX_SAMPLES_PER_STEP} (they are all held in memory at once)"
        )


MAX_THREADS = 4096
"""``trainer.num_threads`` above this is a typo (an extra zero), not a machine."""


def _check_threads(cfg: Config, report: Report) -> None:
    """``trainer.num_threads``: null, ``follow`` or a whole number from 1 to ``MAX_THREADS``."""
    value = cfg.trainer.num_threads
    if isinstance(value, str) and value != FOLLOW_FREE_CORES:
        report.error(f"trainer.num_threads={value!r} must be null, '{FOLLOW_FREE_CORES}' or a whole number of "
                     f"threads such as 2 ({key_help(cfg, 'trainer.num_threads')})")
    elif isinstance(value, int) and not 1 <= value <= MAX_THREADS:
        report.error(f"trainer.num_threads={value} must be from 1 to {MAX_THREADS} torch threads, null or "
                     f"'{FOLLOW_FREE_CORES}'")


def check_ranges(cfg: Config, report: Report) -> None:
    _check_finite(cfg, "", report)
    _check_maxima(cfg, report)
    _check_threads(cfg, report)
    for path, minimum in _POSITIVE_INTS:
        value = key_value(cfg, path)
        if value < minimum:
            report.error(f"{path}={value} must be >= {minimum} ({key_help(cfg, path)})")
    for path, minimum in _OPTIONAL_POSITIVE_INTS:
        value = key_value(cfg, path)
        if value is not None and value < minimum:
            report.error(f"{path}={value} must be >= {minimum} or null ({key_help(cfg, path)})")

    actor = cfg.actor
    if actor.clip_ratio <= 0:
        report.error(f"actor.clip_ratio={actor.clip_ratio} must be > 0 (the PPO clip range, e.g. 0.2)")
    for name in ("clip_ratio_low", "clip_ratio_high"):
        value = getattr(actor, name)
        if value is not None and value <= 0:
            report.error(f"actor.{name}={value} must be > 0 or null (null: actor.clip_ratio)")
    low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    # CISPO bounds its importance weight from above only: a lower range of 1 (bound 0) is its norm.
    if low > 1 or (low == 1 and actor.policy_loss.loss_mode != "cispo"):
        report.error(
            f"the lower clip range is {low} (actor.clip_ratio_low, or actor.clip_ratio when null), "
            f"so the ratio's lower bound 1 - {low} <= 0 clips nothing; use a value below 1, e.g. 0.2 "
            f"(1 is allowed for actor.policy_loss.loss_mode=cispo)"
        )
    if actor.clip_ratio_c <= 1:
        report.error(
            f"actor.clip_ratio_c={actor.clip_ratio_c} must be > 1: it is the dual-clip bound on the ratio of "
            f"negative-advantage tokens, and a bound <= 1 would cut below the unchanged policy's ratio of 1 "
            f"(verl's default is 3.0)"
        )
    if actor.loss_scale_factor is not None and actor.loss_scale_factor <= 0:
        report.error(f"actor.loss_scale_factor={actor.loss_scale_factor} must be > 0 or null")
    if actor.kl_loss_coef < 0:
        report.error(f"actor.kl_loss_coef={actor.kl_loss_coef} must be >= 0")

    check_optim("actor.optim", actor.optim, report)

    if cfg.warm_start.lr <= 0:
        report.error(f"warm_start.lr={cfg.warm_start.lr} must be > 0")
    if cfg.reward.startup_timeout_s <= 0:
        report.error(f"reward.startup_timeout_s={cfg.reward.startup_timeout_s} must be > 0 seconds")
    if cfg.reward.timeout_s <= 0:
        report.error(f"reward.timeout_s={cfg.reward.timeout_s} must be > 0 seconds")
    memory = cfg.trainer.device_memory_gb
    if memory is not None and not 0 < memory <= MAX_DEVICE_MEMORY_GB:
        report.error(f"trainer.device_memory_gb={memory} must be a size in GiB in (0, {MAX_DEVICE_MEMORY_GB}] "
                     f"(e.g. 80 for an 80 GB GPU) or null")

    algorithm = cfg.algorithm
    for name in ("gamma", "lam"):
        value = getattr(algorithm, name)
        if not 0 <= value <= 1:
            report.error(f"algorithm.{name}={value} must be in [0, 1]")
    if algorithm.kl_ctrl.kl_coef < 0:
        report.error(f"algorithm.kl_ctrl.kl_coef={algorithm.kl_ctrl.kl_coef} must be >= 0")
    if algorithm.kl_ctrl.target_kl <= 0:
        report.error(f"algorithm.kl_ctrl.target_kl={algorithm.kl_ctrl.target_kl} must be > 0")


def check_optim(prefix: str, optim: OptimConfig, report: Report) -> None:
    """One optimizer section (``actor.optim``, ``critic.optim``)."""
    if optim.lr <= 0:
        report.error(f"{prefix}.lr={optim.lr} must be > 0 (e.g. 1e-6)")
    if optim.weight_decay < 0:
        report.error(f"{prefix}.weight_decay={optim.weight_decay} must be >= 0")
    if optim.lr_warmup_steps is not None and optim.lr_warmup_steps < -1:
        report.error(f"{prefix}.lr_warmup_steps={optim.lr_warmup_steps} must be >= 0, or -1/null for "
                     f"{prefix}.lr_warmup_steps_ratio x the run's optimizer steps")
    if not 0 <= optim.lr_warmup_steps_ratio < 1:
        report.error(f"{prefix}.lr_warmup_steps_ratio={optim.lr_warmup_steps_ratio} must be in [0, 1) (a fraction of "
                     f"the run's optimizer steps)")
    if not 0 <= optim.min_lr_ratio <= 1:
        report.error(f"{prefix}.min_lr_ratio={optim.min_lr_ratio} must be in [0, 1] (a fraction of lr)")
    if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
        report.error(f"{prefix}.betas={optim.betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]")


def _check_sampling(
    prefix: str, temperature: float, top_p: float, top_k: int, report: Report, training: bool = False
) -> None:
    if training and temperature < MIN_TRAIN_TEMPERATURE:
        report.error(
            f"{prefix}.temperature={temperature} must be >= {MIN_TRAIN_TEMPERATURE} for training: the trainer's "
            f"logprobs of logits / temperature are undefined at 0 (greedy) and overflow below that, so every "
            f"loss would be NaN; sample with a temperature such as 1.0 (greedy validation is "
            f"rollout.val_kwargs.temperature=0)"
        )
    elif not training and (temperature < 0 or 0 < temperature < MIN_TRAIN_TEMPERATURE):
        report.error(
            f"{prefix}.temperature={temperature} must be 0 (greedy) or >= {MIN_TRAIN_TEMPERATURE} (below that the "
            f"tempered logits overflow)"
        )
    if not 0 < top_p <= 1:
        report.error(f"{prefix}.top_p={top_p} must be in (0, 1] (1: no nucleus filtering)")
    if top_k != -1 and top_k < 1:
        report.error(f"{prefix}.top_k={top_k} must be -1 (off) or >= 1")


def check_all_sampling(cfg: Config, report: Report) -> None:
    rollout, val = cfg.rollout, cfg.rollout.val_kwargs
    _check_sampling("rollout", rollout.temperature, rollout.top_p, rollout.top_k, report, training=True)
    _check_sampling("rollout.val_kwargs", val.temperature, val.top_p, val.top_k, report)
    if not val.do_sample and (val.temperature > 0 or val.top_p < 1 or val.top_k != -1):
        report.warn(
            "rollout.val_kwargs.temperature/top_p/top_k have no effect while rollout.val_kwargs.do_sample is false "
            "(validation decodes greedily); set rollout.val_kwargs.do_sample=true to sample"
        )


def check_names(cfg: Config, report: Report) -> None:
    """String keys whose allowed values are not expressible as schema ``choices``."""

    def one_of(path: str, value: str, allowed: tuple[str, ...]) -> None:
        if value in allowed:
            return
        close = difflib.get_close_matches(value, list(allowed), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        report.error(f"{path}={value!r} is not one of: {', '.join(allowed)}{hint}")

    one_of("actor.loss_agg_mode", cfg.actor.loss_agg_mode, LOSS_AGG_MODES)
    one_of("critic.loss_agg_mode", cfg.critic.loss_agg_mode, LOSS_AGG_MODES)
    kl_names = KL_ESTIMATORS + tuple(f"{name}+" for name in KL_ESTIMATORS)
    one_of("actor.kl_loss_type", cfg.actor.kl_loss_type, kl_names)
    one_of("algorithm.kl_penalty", cfg.algorithm.kl_penalty, kl_names)
    for i, name in enumerate(cfg.trainer.logger):
        one_of(f"trainer.logger[{i}]", name, LOGGERS)

"""Semantic checks of a resolved ``Config``, run at start-up before any model is loaded.

The loader guarantees types; this module checks what needs several keys at once, above all the
batch arithmetic. A bad batch split is the classic silent failure: a micro-batch larger than a
rank's share of the mini-batch gives zero gradient-accumulation steps and a NaN loss with no
clear error (verl #2505). Every message states the numbers involved and a value that would work.

All errors are collected and raised together, so one run shows every problem. What this machine
lacks (a GPU, a package) is not the config's problem and is not checked here: see
``machine_problems`` in controller/setup.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.config.budget import VISUAL_BUILTIN_TASKS, read_model_shape
from hybridflow.config.errors import ConfigError, raise_all
from hybridflow.config.schema import Config, OptimConfig, TrainerConfig
from hybridflow.utils.files import special_file_kind
from hybridflow.utils.storage import is_remote

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

GROUP_ESTIMATORS_NEEDING_N2 = {"rloo": "error", "grpo": "warning", "gdpo": "warning"}
"""Group-baseline estimators and what ``rollout.n=1`` means for them. RLOO's leave-one-out
baseline is undefined for a single sample (an error). GRPO with a single sample takes the group
mean as 0 and std as 1, so the advantage is reward / (1 + 1e-6): it runs, but learns with no
baseline at all (a warning)."""

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
    ("trainer.dump_max_samples", 1),
    ("trainer.log_val_generations", 0),
    ("trainer.dump_max_chars", 1),
)
"""Integer keys and their minimum (checked with the field's help text in the message)."""

_OPTIONAL_POSITIVE_INTS: tuple[tuple[str, int], ...] = (
    ("trainer.n_workers", 1),
    ("trainer.total_training_steps", 1),
    ("trainer.max_ckpt_to_keep", 1),
    ("trainer.num_threads", 1),
    ("critic.ppo_epochs", 1),
    ("critic.ppo_mini_batch_size", 1),
    ("rollout.multi_turn.max_user_turns", 0),  # verl's 0 is no bound, as null
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
    ("trainer.num_threads", 4096, "torch threads"),
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


@dataclass(frozen=True)
class BatchPlan:
    """How one training step's prompts split into optimizer steps and micro-batches.

    Meaningful only for a config that passed ``validate_config`` (the divisions are exact then).
    """

    dp: int  # data-parallel ranks
    prompts_per_step: int  # data.train_batch_size
    samples_per_step: int  # prompts x rollout.n
    samples_per_rank_per_step: int
    mini_batches_per_epoch: int  # optimizer steps per pass over the rollout batch
    optimizer_steps_per_step: int  # x ppo_epochs
    samples_per_mini_batch: int  # ppo_mini_batch_size x rollout.n, over all ranks
    samples_per_rank_per_mini_batch: int
    grad_accum_steps: int  # micro-batches per optimizer step on one rank


def compute_batch_plan(
    *,
    train_batch_size: int,
    ppo_mini_batch_size: int,
    rollout_n: int,
    ppo_epochs: int,
    ppo_micro_batch_size_per_gpu: int,
    dp: int,
) -> BatchPlan:
    """The batch split for these sizes (prompts for the first two, samples for the micro)."""
    samples_per_mini = ppo_mini_batch_size * rollout_n
    per_rank_mini = samples_per_mini // dp
    mini_batches = train_batch_size // ppo_mini_batch_size
    return BatchPlan(
        dp=dp,
        prompts_per_step=train_batch_size,
        samples_per_step=train_batch_size * rollout_n,
        samples_per_rank_per_step=train_batch_size * rollout_n // dp,
        mini_batches_per_epoch=mini_batches,
        optimizer_steps_per_step=mini_batches * ppo_epochs,
        samples_per_mini_batch=samples_per_mini,
        samples_per_rank_per_mini_batch=per_rank_mini,
        grad_accum_steps=per_rank_mini // ppo_micro_batch_size_per_gpu,
    )


def data_parallel_size(trainer: TrainerConfig) -> int:
    """Data-parallel ranks of the actor (and reference): ``n_workers`` CPU ranks when set, else
    ``n_gpus_per_node x nnodes``."""
    if trainer.n_workers is not None:
        return trainer.n_workers
    return trainer.n_gpus_per_node * trainer.nnodes


def rollout_replicas(cfg: Config) -> int:
    """Rollout replicas: the data-parallel ranks in groups of ``rollout.tensor_model_parallel_size``
    (each replica one engine over its ranks' placements)."""
    return max(1, data_parallel_size(cfg.trainer) // cfg.rollout.tensor_model_parallel_size)


def dp_source(trainer: TrainerConfig) -> str:
    """Where ``data_parallel_size`` came from, for messages."""
    if trainer.n_workers is not None:
        return f"trainer.n_workers={trainer.n_workers}"
    return f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} x trainer.nnodes={trainer.nnodes}"


def batch_plan(cfg: Config) -> BatchPlan:
    """``compute_batch_plan`` for a config."""
    return compute_batch_plan(
        train_batch_size=cfg.data.train_batch_size,
        ppo_mini_batch_size=cfg.actor.ppo_mini_batch_size,
        rollout_n=cfg.rollout.n,
        ppo_epochs=cfg.actor.ppo_epochs,
        ppo_micro_batch_size_per_gpu=cfg.actor.ppo_micro_batch_size_per_gpu,
        dp=data_parallel_size(cfg.trainer),
    )


def _check_refs_data_plane(cfg: Config, report: _Report) -> None:
    """trainer.data_plane=refs keeps the tokens off the controller: what reads them there is refused."""
    refuse = []
    if cfg.reward_model.enable:
        refuse.append("reward_model.enable=true (the reward model scores tokens the controller sends it)")
    for reason in refuse:
        report.error(f"trainer.data_plane=refs is not built with {reason}; use trainer.data_plane=controller")


def _check_prefill_budget(cfg: Config, report: _Report) -> None:
    """With chunked prefill off a prompt is prefilled whole in one step. A budget below the longest
    sequence is what verl's SGLang examples set (verl gives SGLang neither key): every engine still
    prefills such a prompt whole, in a step of its own (SGLang bounds a prefill batch by the larger of
    the budget and the context; the native engine does the same; vLLM, which refuses to start below
    its context with chunking off, gets the budget raised to it), so this is a note, not an error."""
    r, d = cfg.rollout, cfg.data
    longest = d.max_prompt_length + d.max_response_length
    if not r.enable_chunked_prefill and r.max_num_batched_tokens < longest:
        report.warn(f"rollout.enable_chunked_prefill=false with rollout.max_num_batched_tokens="
                    f"{r.max_num_batched_tokens} below a whole sequence (data.max_prompt_length + "
                    f"data.max_response_length = {longest} tokens): a longer prompt is prefilled whole in a step of "
                    f"its own (vLLM gets the budget raised to the model's context)")


def _check_raw_chat_and_images(cfg: Config, report: _Report) -> None:
    """data.return_raw_chat=false leaves samples without their chat messages, which two readers need; the
    built-in image task writes its images under verl's column name."""
    d, mt = cfg.data, cfg.rollout.multi_turn
    if not d.return_raw_chat:
        if cfg.reward_model.enable:
            report.error("reward_model.enable=true renders each prompt from its chat messages, which "
                         "data.return_raw_chat=false drops; set data.return_raw_chat=true")
        if mt.enable and mt.default_agent_loop == OPENAI_LOOP:
            report.error("rollout.multi_turn.default_agent_loop=openai hands each prompt's chat messages to the agent, "
                         "which data.return_raw_chat=false drops; set data.return_raw_chat=true")
    if not d.train_files and d.builtin_task in VISUAL_BUILTIN_TASKS and d.image_key != "images":
        report.error(f"data.image_key={d.image_key!r} names a column of data.train_files, but the built-in "
                     f"{d.builtin_task} task writes its images under 'images'; leave data.image_key at images")


def _check_reward_manager(cfg: Config, report: _Report) -> None:
    """reward.reward_manager and reward.reward_kwargs: what the built-in scorers cannot take."""
    reward = cfg.reward
    if reward.custom_reward_function.path is None:
        if reward.reward_manager == "batch":
            report.error("reward.reward_manager=batch calls a reward function with lists of samples, which the "
                         "built-in scorers are not; set reward.custom_reward_function.path, or use naive")
        if reward.reward_kwargs:
            report.error(f"reward.reward_kwargs={reward.reward_kwargs} are keyword arguments of "
                         f"reward.custom_reward_function, which is not set (the built-in scorers take none)")


def _check_sandbox_fusion(cfg: Config, report: _Report) -> None:
    """reward.sandbox_fusion: a usable endpoint, limits in range, and a sample budget that fits a run."""
    sf, reward = cfg.reward.sandbox_fusion, cfg.reward
    if sf.max_concurrent < 1:
        report.error(f"reward.sandbox_fusion.max_concurrent={sf.max_concurrent} must be >= 1")
    if sf.memory_limit_mb < 1:
        report.error(f"reward.sandbox_fusion.memory_limit_mb={sf.memory_limit_mb} must be >= 1")
    if not sf.run_timeout_s > 0:
        report.error(f"reward.sandbox_fusion.run_timeout_s={sf.run_timeout_s} must be > 0")
    if sf.url is None:
        return
    if not sf.url.startswith(("http://", "https://")):
        report.error(f"reward.sandbox_fusion.url={sf.url!r} must be an http:// or https:// URL (the service's "
                     "run_code endpoint)")
    if reward.custom_reward_function.path is not None:
        report.warn("reward.sandbox_fusion.url is used by the built-in scorers only, and "
                    "reward.custom_reward_function.path replaces them (as in verl): the service is not called")
    elif reward.timeout_s <= sf.run_timeout_s:
        report.warn(f"reward.timeout_s={reward.timeout_s} <= reward.sandbox_fusion.run_timeout_s={sf.run_timeout_s}: "
                    "a test case that runs to the service's limit makes its sample an error (score 0) instead of a "
                    "failed case; raise reward.timeout_s")


def _check_vllm(cfg: Config, report: _Report) -> None:
    """What rollout.name=vllm cannot do (hybridflow/rollout/vllm_engine.py says why)."""
    replicas = rollout_replicas(cfg)
    if replicas > 1 and cfg.trainer.backend == "local":
        # vLLM keeps its distributed state per process: a second engine in one process fails to start.
        report.error(f"rollout.name=vllm runs one vLLM engine per process, but trainer.backend=local would start "
                     f"{replicas} rollout replicas ({dp_source(cfg.trainer)}) in this one; use trainer.backend=ray, "
                     f"or one data-parallel rank")
    r = cfg.rollout
    if r.top_p < 1.0 or r.top_k not in (-1, 0):
        report.error(f"rollout.name=vllm reports logprobs after top-p/top-k filtering (renormalised over the kept "
                     f"tokens), not the full-vocabulary logprobs the trainer computes; with rollout.top_p={r.top_p} "
                     f"and rollout.top_k={r.top_k} the importance ratios would be biased: use rollout.top_p=1 and "
                     f"rollout.top_k=-1, or rollout.name=native")


# ----------------------------------------------------------------------------------------------
# Helpers


def _get(cfg: Config, path: str) -> Any:
    value: Any = cfg
    for name in path.split("."):
        value = getattr(value, name)
    return value


def _help(cfg: Config, path: str) -> str:
    section_path, _, name = path.rpartition(".")
    section = _get(cfg, section_path) if section_path else cfg
    fld = {f.name: f for f in dataclasses.fields(section)}[name]
    return str(fld.metadata.get("help", ""))


def _divisors_near(n: int, target: int, count: int = 3) -> list[int]:
    """Up to ``count`` divisors of ``n`` closest to ``target``, ascending."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return sorted(sorted(divisors, key=lambda d: (abs(d - target), -d))[:count])


def _multiples_near(step: int, target: int) -> list[int]:
    """The multiples of ``step`` just below and above ``target`` (positive ones only)."""
    below = (target // step) * step
    return [m for m in (below, below + step) if m > 0]


def _or_list(values: list[int]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


class _Report:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, message: str) -> None:
        self.errors.append(message)

    def warn(self, message: str) -> None:
        self.warnings.append(message)


# ----------------------------------------------------------------------------------------------
# Checks


def _check_finite(node: Any, prefix: str, report: _Report) -> None:
    """Every float in the config is finite: YAML's .inf and .nan parse as floats, and no key means
    anything by them."""
    for fld in dataclasses.fields(node):
        value = getattr(node, fld.name)
        path = f"{prefix}{fld.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, f"{path}.", report)
        elif isinstance(value, float) and not math.isfinite(value):
            report.error(f"{path}={value} must be a finite number")


def _check_maxima(cfg: Config, report: _Report) -> None:
    for path, maximum, unit in _MAXIMA:
        value = _get(cfg, path)
        if value is not None and value > maximum:
            report.error(f"{path}={value} is over the limit of {maximum} {unit}; is it a typo?")
    samples = cfg.data.train_batch_size * cfg.rollout.n
    if samples > MAX_SAMPLES_PER_STEP:
        report.error(
            f"data.train_batch_size={cfg.data.train_batch_size} x rollout.n={cfg.rollout.n} = {samples} samples per "
            f"step is over the limit of {MAX_SAMPLES_PER_STEP} (they are all held in memory at once)"
        )


def _check_ranges(cfg: Config, report: _Report) -> None:
    _check_finite(cfg, "", report)
    _check_maxima(cfg, report)
    for path, minimum in _POSITIVE_INTS:
        value = _get(cfg, path)
        if value < minimum:
            report.error(f"{path}={value} must be >= {minimum} ({_help(cfg, path)})")
    for path, minimum in _OPTIONAL_POSITIVE_INTS:
        value = _get(cfg, path)
        if value is not None and value < minimum:
            report.error(f"{path}={value} must be >= {minimum} or null ({_help(cfg, path)})")

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

    _check_optim("actor.optim", actor.optim, report)

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


def _check_optim(prefix: str, optim: OptimConfig, report: _Report) -> None:
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


def _check_lora(cfg: Config, report: _Report) -> None:
    """``actor.lora``: checked whatever the rank, so a wrong value fails before LoRA is switched on."""
    lora = cfg.actor.lora
    if lora.rank < 0:
        report.error(f"actor.lora.rank={lora.rank} must be >= 0 (0: LoRA off; e.g. 8 or 16)")
    if not lora.alpha > 0:
        report.error(f"actor.lora.alpha={lora.alpha} must be > 0 (the update is scaled by alpha / rank; e.g. 16)")
    if not 0 <= lora.dropout < 1:
        report.error(f"actor.lora.dropout={lora.dropout} must be in [0, 1) (e.g. 0.05)")
    if lora.base_dtype != "float32" and lora.rank == 0:
        report.error(f"actor.lora.base_dtype={lora.base_dtype} stores LoRA's frozen base, but actor.lora.rank=0 "
                     f"trains every weight (kept in float32 master weights); set actor.lora.rank > 0, or "
                     f"model.dtype=bfloat16 for bf16 compute without LoRA")
    if lora.sync == "adapter":
        if cfg.rollout.name != "native":
            report.error(f"actor.lora.sync=adapter: the rollout merges the adapter itself, which only the native "
                         f"engine's worker does; rollout.name={cfg.rollout.name} takes actor.lora.sync=merged")
        if cfg.trainer.mode == "fully_async":
            report.error("actor.lora.sync=adapter: trainer.mode=fully_async stages whole weight snapshots; use "
                         "actor.lora.sync=merged")
    modules = lora.target_modules
    if not modules or not all(isinstance(m, str) and m for m in modules):
        report.error(f"actor.lora.target_modules={modules} must name at least one module, e.g. [all-linear] or "
                     f"[q_proj, v_proj]")
    elif "all-linear" in modules and len(modules) > 1:
        report.error(f"actor.lora.target_modules={modules}: all-linear already means every linear layer; give it "
                     f"alone, or list module names without it")


def _check_critic(cfg: Config, report: _Report) -> None:
    """The ``critic`` section. Checked whatever the estimator: its defaults always pass, and a
    value set wrong is wrong before a run switches to gae."""
    critic = cfg.critic
    _check_optim("critic.optim", critic.optim, report)
    if not critic.cliprange_value >= 0:
        report.error(
            f"critic.cliprange_value={critic.cliprange_value} must be >= 0: a new value may move at most this far "
            f"from the rollout's value before its error stops counting (verl's default is 0.5)"
        )
    if cfg.trainer.critic_warmup < 0:
        report.error(f"trainer.critic_warmup={cfg.trainer.critic_warmup} must be >= 0 steps")
    train, n, dp = cfg.data.train_batch_size, cfg.rollout.n, data_parallel_size(cfg.trainer)
    own = critic.ppo_mini_batch_size
    # null: the actor's mini-batch, whose split _check_batches reports.
    mini = own if own is not None else cfg.actor.ppo_mini_batch_size
    if min(train, n, dp, mini, critic.ppo_micro_batch_size_per_gpu) < 1:
        return  # reported by _check_ranges or below
    if own is not None and (mini > train or train % mini):
        report.error(
            f"critic.ppo_mini_batch_size={mini} prompts must divide data.train_batch_size={train} prompts (e.g. "
            f"{_or_list(_divisors_near(train, mini))}), or be null for actor.ppo_mini_batch_size"
        )
    elif mini * n % dp:
        if own is not None:
            report.error(
                f"a critic mini-batch of critic.ppo_mini_batch_size={mini} prompts x rollout.n={n} samples cannot be "
                f"split evenly over {dp} data-parallel ranks; make it a multiple of {dp}"
            )
    elif not critic.use_dynamic_bsz and (mini * n // dp) % critic.ppo_micro_batch_size_per_gpu:
        per_rank = mini * n // dp
        report.error(
            f"each rank gets {per_rank} samples per critic optimizer step, which is not a multiple of "
            f"critic.ppo_micro_batch_size_per_gpu={critic.ppo_micro_batch_size_per_gpu}; use one that divides "
            f"{per_rank}, e.g. {_or_list(_divisors_near(per_rank, critic.ppo_micro_batch_size_per_gpu))}"
        )


def _check_sampling(
    prefix: str, temperature: float, top_p: float, top_k: int, report: _Report, training: bool = False
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


def _check_all_sampling(cfg: Config, report: _Report) -> None:
    rollout, val = cfg.rollout, cfg.rollout.val_kwargs
    _check_sampling("rollout", rollout.temperature, rollout.top_p, rollout.top_k, report, training=True)
    _check_sampling("rollout.val_kwargs", val.temperature, val.top_p, val.top_k, report)
    if not val.do_sample and (val.temperature > 0 or val.top_p < 1 or val.top_k != -1):
        report.warn(
            "rollout.val_kwargs.temperature/top_p/top_k have no effect while rollout.val_kwargs.do_sample is false "
            "(validation decodes greedily); set rollout.val_kwargs.do_sample=true to sample"
        )


def _check_names(cfg: Config, report: _Report) -> None:
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


def _check_batches(cfg: Config, report: _Report) -> None:
    """The batch arithmetic, each message with its numbers. Skipped when a size is not positive
    (already reported by ``_check_ranges``) to avoid dividing by zero."""
    train = cfg.data.train_batch_size
    mini = cfg.actor.ppo_mini_batch_size
    micro = cfg.actor.ppo_micro_batch_size_per_gpu
    n = cfg.rollout.n
    dp = data_parallel_size(cfg.trainer)
    if min(train, mini, micro, n, dp) < 1:
        return
    dp_text = f"dp={dp} data-parallel ranks ({dp_source(cfg.trainer)})"

    if mini > train:
        report.error(
            f"actor.ppo_mini_batch_size={mini} prompts is larger than data.train_batch_size={train} prompts: "
            f"a step would never fill one mini-batch; use ppo_mini_batch_size <= {train}, e.g. "
            f"{_or_list(_divisors_near(train, mini))}"
        )
    elif train % mini:
        report.error(
            f"data.train_batch_size={train} prompts is not a multiple of actor.ppo_mini_batch_size={mini} "
            f"prompts: each step would leave {train % mini} prompts untrained; use a ppo_mini_batch_size "
            f"that divides {train} (e.g. {_or_list(_divisors_near(train, mini))}) or a train_batch_size "
            f"that is a multiple of {mini} (e.g. {_or_list(_multiples_near(mini, train))})"
        )

    mini_samples = mini * n
    if mini_samples % dp:
        report.error(
            f"a mini-batch of actor.ppo_mini_batch_size={mini} prompts x rollout.n={n} = {mini_samples} "
            f"samples cannot be split evenly over {dp_text}; make ppo_mini_batch_size x rollout.n a "
            f"multiple of {dp}"
        )
    else:
        step_samples = train * n
        if step_samples % dp:
            report.error(
                f"a step of data.train_batch_size={train} prompts x rollout.n={n} = {step_samples} samples "
                f"cannot be split evenly over {dp_text}; make train_batch_size x rollout.n a multiple of {dp}"
            )
        per_rank = mini_samples // dp
        share = f"ppo_mini_batch_size={mini} prompts x rollout.n={n} / dp={dp}"
        # With actor.use_dynamic_bsz the token budget forms the micro-batches; the sample count is unused.
        fixed_micro = not cfg.actor.use_dynamic_bsz
        if fixed_micro and micro > per_rank:
            report.error(
                f"actor.ppo_micro_batch_size_per_gpu={micro} samples is larger than the {per_rank} samples "
                f"each rank gets per optimizer step ({share}): there would be no full micro-batch "
                f"(0 gradient-accumulation steps); use ppo_micro_batch_size_per_gpu <= {per_rank} that divides "
                f"it, e.g. {_or_list(_divisors_near(per_rank, micro))}"
            )
        elif fixed_micro and per_rank % micro:
            report.error(
                f"each rank gets {per_rank} samples per optimizer step ({share}), which is not a multiple of "
                f"actor.ppo_micro_batch_size_per_gpu={micro}: the last micro-batch would hold "
                f"{per_rank % micro} samples; use a micro-batch size that divides {per_rank}, e.g. "
                f"{_or_list(_divisors_near(per_rank, micro))}"
            )

    if not cfg.data.train_files and cfg.data.builtin_train_size < train:
        report.error(
            f"data.builtin_train_size={cfg.data.builtin_train_size} prompts is smaller than "
            f"data.train_batch_size={train}: an epoch of the built-in task would not fill one step"
        )


def _check_algorithm(cfg: Config, report: _Report) -> None:
    estimator, n = cfg.algorithm.adv_estimator, cfg.rollout.n
    severity = GROUP_ESTIMATORS_NEEDING_N2.get(estimator)
    if severity is not None and n == 1:
        if severity == "error":
            report.error(
                f"rollout.n=1 with algorithm.adv_estimator={estimator}: the leave-one-out baseline needs at "
                f"least 2 samples per prompt; use rollout.n >= 2 (e.g. 4 or 8)"
            )
        else:
            report.warn(
                f"rollout.n=1 with algorithm.adv_estimator={estimator}: each group holds one sample, so the "
                f"group mean is taken as 0 and the std as 1 and the advantage is just reward / (1 + 1e-6), "
                f"with no baseline; use rollout.n >= 2 (GRPO usually uses 4 to 16)"
            )
    if cfg.actor.use_kl_loss and cfg.algorithm.use_kl_in_reward:
        report.warn(
            "both actor.use_kl_loss and algorithm.use_kl_in_reward are true: the KL to the reference "
            "model is penalised twice (in the loss and in the reward); usually only one is wanted"
        )
    if cfg.algorithm.kl_ctrl.type == "adaptive" and not cfg.algorithm.use_kl_in_reward:
        report.warn("algorithm.kl_ctrl.type=adaptive has no effect while algorithm.use_kl_in_reward is false")
    if not cfg.algorithm.norm_adv_by_std_in_grpo and estimator not in ("grpo", "gdpo", "grpo_passk"):
        report.warn(
            f"algorithm.norm_adv_by_std_in_grpo=false has no effect with algorithm.adv_estimator={estimator} "
            f"(it only changes grpo, gdpo and grpo_passk)"
        )
    _check_gdpo(cfg, report)
    _check_policy_loss_modes(cfg, report)
    _check_dapo_and_correction(cfg, report)
    if cfg.actor.loss_scale_factor is not None and cfg.actor.loss_agg_mode != "seq-mean-token-sum-norm":
        report.warn(
            f"actor.loss_scale_factor={cfg.actor.loss_scale_factor} has no effect with "
            f"actor.loss_agg_mode={cfg.actor.loss_agg_mode} (only seq-mean-token-sum-norm uses it)"
        )


def _check_gdpo(cfg: Config, report: _Report) -> None:
    alg = cfg.algorithm
    if alg.adv_estimator == "gdpo" and not alg.gdpo_reward_keys:
        report.error(
            "algorithm.adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the numbers your reward function "
            "returns beside 'score' to normalise one by one (e.g. [acc,format_reward])"
        )
    weights = alg.gdpo_reward_weights
    if weights is not None and len(weights) != len(alg.gdpo_reward_keys):
        report.error(
            f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(alg.gdpo_reward_keys)} "
            f"algorithm.gdpo_reward_keys; give one weight per key (or null: all 1)"
        )


def _check_policy_loss_modes(cfg: Config, report: _Report) -> None:
    pl, rc = cfg.actor.policy_loss, cfg.algorithm.rollout_correction
    if pl.loss_mode == "dro" and (pl.dro_beta is None or pl.dro_beta <= 0):
        report.error(f"actor.policy_loss.loss_mode=dro needs actor.policy_loss.dro_beta > 0, got {pl.dro_beta}")
    if pl.loss_mode == "bypass_mode" and not rc.bypass_mode:
        report.error(
            "actor.policy_loss.loss_mode=bypass_mode is chosen by algorithm.rollout_correction.bypass_mode=true "
            "(which also makes the rollout's logprobs pi_old); set that instead"
        )
    if rc.bypass_mode and pl.loss_mode not in ("vanilla", "bypass_mode"):
        # verl silently replaces the loss; a config that names another one wants something else.
        report.error(
            f"algorithm.rollout_correction.bypass_mode=true replaces the policy loss by bypass_mode "
            f"(algorithm.rollout_correction.loss_type=ppo_clip|reinforce), but actor.policy_loss.loss_mode="
            f"{pl.loss_mode}; leave loss_mode at vanilla or turn bypass mode off"
        )


def _check_dapo_and_correction(cfg: Config, report: _Report) -> None:
    fg, ob, d = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer, cfg.data
    if fg.enable:
        if fg.max_num_gen_batches < 0:
            report.error(f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} must be >= 0 (0: unlimited)")
        if cfg.rollout.n == 1:
            report.warn("algorithm.filter_groups.enable=true with rollout.n=1: a group of one is always kept, "
                        "so nothing is filtered")
        if d.gen_batch_size is not None and d.gen_batch_size < 1:
            report.error(f"data.gen_batch_size={d.gen_batch_size} must be >= 1 (or null: data.train_batch_size)")
    elif d.gen_batch_size is not None and d.gen_batch_size != d.train_batch_size:
        report.warn(f"data.gen_batch_size={d.gen_batch_size} has no effect while algorithm.filter_groups.enable=false")
    if ob.enable:
        # The buffer ends at verl's max_resp_len when given, else at the response budget.
        end, end_key = ((ob.max_response_length, "reward.overlong_buffer.max_response_length")
                        if ob.max_response_length is not None else (d.max_response_length, "data.max_response_length"))
        if end < 1:
            report.error(f"{end_key}={end} must be >= 1")
        elif ob.len is not None and not 0 < ob.len <= end:
            report.error(f"reward.overlong_buffer.len={ob.len} must be in [1, {end_key}={end}]")
        if ob.penalty_factor < 0:
            report.error(f"reward.overlong_buffer.penalty_factor={ob.penalty_factor} must be >= 0")
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is_threshold <= 0:
        report.error(f"algorithm.rollout_correction.rollout_is_threshold={rc.rollout_is_threshold} must be > 0")
    # A threshold text ('0.6_1.6,2.5') is checked against the criteria by set-up (parse_rollout_rs).
    upper = rc.rollout_rs_threshold
    if rc.rollout_rs is not None and isinstance(upper, float):
        lower = rc.rollout_rs_threshold_lower if rc.rollout_rs_threshold_lower is not None else 1 / max(upper, 1e-12)
        if not 0 < lower <= upper:
            report.error(
                f"algorithm.rollout_correction: need 0 < rollout_rs_threshold_lower ({lower:g}) <= "
                f"rollout_rs_threshold ({upper:g})"
            )
    if rc.rollout_is_batch_normalize and rc.rollout_is is None:
        report.warn("algorithm.rollout_correction.rollout_is_batch_normalize=true has no effect without "
                    "algorithm.rollout_correction.rollout_is (no importance weights to normalise)")


BUILTIN_TOOLS_PREFIX = "builtin:"
"""``rollout.multi_turn.tool_config_path`` values naming built-in tools: ``builtin:calculator,python``.
The names are checked against the tool registry at start-up (``controller/setup.py``); the
config layer does not import the agent layer."""

OPENAI_LOOP = "openai"
"""The agent loop (``hybridflow.agents.AGENT_LOOPS``) that runs ``rollout.multi_turn.openai_agent``."""

TOOL_TASKS = {"calculator": "calculator"}
"""Built-in tasks (``data.builtin_task``) that are solved with a tool, and the tool they need."""


def _check_multi_turn(cfg: Config, report: _Report) -> None:
    """rollout.multi_turn: what the agent loop needs, and keys that do nothing while it is off."""
    mt, d = cfg.rollout.multi_turn, cfg.data
    if mt.tool_timeout_s is not None and mt.tool_timeout_s <= 0:
        report.error(f"rollout.multi_turn.tool_timeout_s={mt.tool_timeout_s} must be > 0 seconds or null")
    source = mt.tool_config_path
    if source is not None and source.startswith(BUILTIN_TOOLS_PREFIX):
        if not [name for name in source[len(BUILTIN_TOOLS_PREFIX):].split(",") if name.strip()]:
            report.error(
                f"rollout.multi_turn.tool_config_path={source!r} names no tool; use e.g. builtin:calculator"
            )
    elif source is not None and not Path(source).expanduser().is_file():
        report.error(
            f"rollout.multi_turn.tool_config_path={source!r} is not an existing file; give a tool YAML file, "
            f"builtin:<name>[,<name>] (calculator, python), or null"
        )
    if mt.default_agent_loop is not None and not mt.default_agent_loop.strip():
        report.error("rollout.multi_turn.default_agent_loop must name an agent loop (e.g. tool_agent) or be null")
    if mt.default_agent_loop == OPENAI_LOOP and not mt.openai_agent:
        report.error(
            "rollout.multi_turn.default_agent_loop=openai needs rollout.multi_turn.openai_agent: the agent function "
            "to run, as package.module:function or path/to/file.py:function"
        )
    if mt.openai_timeout_s <= 0:
        report.error(f"rollout.multi_turn.openai_timeout_s={mt.openai_timeout_s} must be > 0 seconds")
    tool = TOOL_TASKS.get(d.builtin_task)
    if tool is not None and not d.train_files:
        if not mt.enable:
            report.error(
                f"data.builtin_task={d.builtin_task} is solved by calling the {tool} tool: set "
                f"rollout.multi_turn.enable=true and rollout.multi_turn.tool_config_path={BUILTIN_TOOLS_PREFIX}{tool} "
                f"(or start from --preset tool_agent)"
            )
        elif source is None:
            report.error(
                f"data.builtin_task={d.builtin_task} needs the {tool} tool, but rollout.multi_turn.tool_config_path "
                f"is null; set it to {BUILTIN_TOOLS_PREFIX}{tool}"
            )
    if not mt.enable:
        changed = [
            f"rollout.multi_turn.{fld.name}"
            for fld in dataclasses.fields(mt)
            if fld.name != "enable" and getattr(mt, fld.name) != fld.default
        ]
        if changed:
            report.warn(f"{', '.join(changed)} has no effect while rollout.multi_turn.enable=false")


def _check_trainer(cfg: Config, report: _Report) -> None:
    trainer = cfg.trainer
    if trainer.resume_mode == "path":
        if not trainer.resume_from_path:
            report.error(
                "trainer.resume_mode=path needs trainer.resume_from_path (the checkpoint folder to resume from)"
            )
        elif not Path(trainer.resume_from_path).expanduser().is_dir():
            report.error(f"trainer.resume_from_path={trainer.resume_from_path!r} is not an existing directory")
    elif trainer.resume_from_path is not None:
        report.warn(
            f"trainer.resume_from_path is set but trainer.resume_mode={trainer.resume_mode}: the path is "
            f"ignored; set trainer.resume_mode=path to resume from it"
        )
    if cfg.model.path != "builtin:tiny" and cfg.actor.optim.lr > 1e-4:
        report.warn(
            f"actor.optim.lr={cfg.actor.optim.lr:g} is tuned for the built-in tiny model; RL on 0.5B-7B "
            "models usually uses 1e-6 to 1e-5 (set actor.optim.lr)"
        )
    if cfg.warm_start.enable == "true" and cfg.model.path != "builtin:tiny":
        report.error(
            f"warm_start.enable=true applies to model.path=builtin:tiny only; model.path={cfg.model.path} "
            "is used as loaded (use warm_start.enable=auto)"
        )
    for entry in trainer.phase_timeouts:
        name, sep, value = entry.partition("=")
        try:
            ok = bool(sep and name.strip()) and float(value) > 0
        except ValueError:
            ok = False
        if not ok:
            report.error(f"trainer.phase_timeouts entry {entry!r} must look like <phase>=<seconds>, e.g. gen=3600")
    a, longest = cfg.actor, cfg.data.max_prompt_length + cfg.data.max_response_length
    if a.use_dynamic_bsz:
        for key, value in (("actor.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu),
                           ("actor.log_prob_max_token_len_per_gpu", a.log_prob_max_token_len_per_gpu),
                           ("ref.log_prob_max_token_len_per_gpu", cfg.ref.log_prob_max_token_len_per_gpu)):
            if value is not None and value < longest:
                report.error(
                    f"{key}={value} tokens is below the longest possible sample (data.max_prompt_length + "
                    f"data.max_response_length = {longest}): such a sample fits no micro-batch; use >= {longest}"
                )
    elif a.ppo_max_token_len_per_gpu is not None or a.log_prob_max_token_len_per_gpu is not None:
        report.warn("actor.*_max_token_len_per_gpu has no effect while actor.use_dynamic_bsz=false")
    if trainer.max_consecutive_skips < 1:
        report.error(f"trainer.max_consecutive_skips={trainer.max_consecutive_skips} must be >= 1")
    if trainer.save_freq <= 0 and not trainer.save_final:
        report.warn("trainer.save_freq <= 0 and trainer.save_final=false: this run writes no checkpoint")


def _check_files(cfg: Config, report: _Report) -> None:
    """Paths the run will open, checked now rather than minutes later."""
    # URLs (s3://, gs://) are checked by set-up, which reaches the server (check_storage in controller/setup.py).
    path = cfg.model.path
    if not path.startswith("builtin:") and not is_remote(path) and not Path(path).expanduser().is_dir():
        report.error(
            f"model.path={path!r} is not an existing directory: use a local Hugging Face model folder "
            f"(config.json + weights) or builtin:tiny"
        )
    for key in ("train_files", "val_files"):
        for i, file in enumerate(getattr(cfg.data, key)):
            if not is_remote(file) and (problem := _file_problem(file)) is not None:
                report.error(f"data.{key}[{i}]={file!r} {problem}")
    reward_path = cfg.reward.custom_reward_function.path
    if reward_path is not None and (problem := _file_problem(reward_path)) is not None:
        report.error(f"reward.custom_reward_function.path={reward_path!r} {problem}")
    template_path = cfg.data.chat_template_path
    if template_path is not None and cfg.data.chat_template is not None:
        report.error("data.chat_template and data.chat_template_path are both set: give the template one way")
    if template_path is not None and (problem := _file_problem(template_path)) is not None:
        report.error(f"data.chat_template_path={template_path!r} {problem}")


def _file_problem(path: str) -> str | None:
    """Why a local path the run will read is not a readable file ("does not exist", "is a FIFO
    (named pipe), not a regular file"), or None."""
    local = Path(path).expanduser()
    if (kind := special_file_kind(local)) is not None:
        return f"is {kind}, not a regular file"
    return None if local.is_file() else "does not exist"


def _check_backend(cfg: Config, report: _Report) -> None:
    """trainer.backend and the keys that only mean something for one backend."""
    t = cfg.trainer
    dp = data_parallel_size(t)
    if t.backend == "local" and dp > 1:
        report.error(
            f"trainer.backend=local runs every role in this process with one rank, but {dp_source(t)} asks for "
            f"{dp} data-parallel ranks; use trainer.backend=ray (each rank its own process), or one rank"
        )
    if t.n_workers is not None and t.device == "cuda":
        report.error(
            f"trainer.n_workers={t.n_workers} counts CPU ranks, but trainer.device=cuda: GPU ranks are "
            f"trainer.n_gpus_per_node x trainer.nnodes; set n_workers to null"
        )
    if cfg.rollout.placement == "split" and t.backend == "local":
        report.error("rollout.placement=split gives the rollout a resource pool of its own, but trainer.backend=local "
                     "runs every role in this process; use trainer.backend=ray, or rollout.placement=colocated")
    tp = cfg.rollout.tensor_model_parallel_size
    if tp > 1 and t.backend == "local":
        report.error(
            f"rollout.tensor_model_parallel_size={tp} spreads one engine over {tp} processes, but trainer.backend=local "
            f"runs in this one; use trainer.backend=ray with {dp_source(t)} a multiple of {tp}, or 1"
        )
    elif tp > 1 and dp % tp:
        report.error(
            f"rollout.tensor_model_parallel_size={tp} must divide the {dp} data-parallel ranks ({dp_source(t)}): "
            f"each rollout replica spans {tp} of them"
        )
    if tp > 1 and cfg.rollout.sleep_level == 2 and cfg.rollout.free_cache_engine:
        report.error(f"rollout.sleep_level=2 (drop the weights between steps) is not built for tensor-parallel replicas "
                     f"(rollout.tensor_model_parallel_size={tp}); use rollout.sleep_level=1")
    if cfg.rollout.mode == "server" and (cfg.rollout.name != "native" or tp > 1):
        report.error(f"rollout.mode=server serves the native engine of one-rank replicas over HTTP, not rollout.name="
                     f"{cfg.rollout.name} with rollout.tensor_model_parallel_size={tp}; use rollout.mode=engine")
    if tp > 1 and cfg.rollout.name not in ("native", "vllm", "sglang"):
        # vLLM and SGLang split a replica's model over its tp devices themselves (tensor_parallel_size, --tp-size).
        report.error(f"rollout.tensor_model_parallel_size={tp} is built for rollout.name=native, vllm or sglang, not "
                     f"{cfg.rollout.name!r}")
    if cfg.rollout.name == "vllm":
        _check_vllm(cfg, report)
    if t.mode == "fully_async" and cfg.async_training.partial_rollout and cfg.rollout.name != "native":
        report.error(f"async_training.partial_rollout=true (new weights pushed into the generation in flight) is built "
                     f"for rollout.name=native, not {cfg.rollout.name}; set async_training.partial_rollout=false")
    if t.data_plane == "refs":
        _check_refs_data_plane(cfg, report)
    if t.backend == "local" and cfg.rollout.weight_sync == "broadcast":
        report.error(
            "rollout.weight_sync=broadcast streams weights from actor rank 0 to the rollout process, but "
            "trainer.backend=local runs both in this process, where weights are copied directly; use "
            "rollout.weight_sync=auto, or trainer.backend=ray"
        )
    if t.backend == "local":
        for key, value in (("ray_address", t.ray_address), ("ray_dashboard", t.ray_dashboard)):
            if value:
                report.warn(f"trainer.{key}={value} has no effect with trainer.backend=local (set trainer.backend=ray)")
    elif t.ray_address is not None and t.ray_dashboard:
        report.warn("trainer.ray_dashboard=true has no effect with trainer.ray_address: the joined cluster keeps its "
                    "own dashboard settings")
    fsdp = cfg.actor.fsdp_config
    # verl's create_device_mesh shards over every rank when fsdp_size >= the ranks (its 64-GPU
    # example's fsdp_size=32 on fewer GPUs): the same here.
    if fsdp.fsdp_size != -1 and fsdp.fsdp_size < dp and (fsdp.fsdp_size < 1 or dp % fsdp.fsdp_size):
        report.error(f"actor.fsdp_config.fsdp_size={fsdp.fsdp_size} must divide the {dp} data-parallel ranks "
                     f"({dp_source(t)}), or be -1 or at least {dp} (shard over all of them)")
    _check_fsdp_precision_and_offload(cfg, dp, report)
    if cfg.actor.freeze_vision_tower and cfg.actor.lora.rank > 0:
        # LoRA already freezes every base weight; frozen adapters inside the tower would leave checkpoints
        # and exports disagreeing on which adapters exist.
        report.error("actor.freeze_vision_tower=true with actor.lora.rank > 0: LoRA trains only adapters; keep "
                     "the vision tower out of them with actor.lora.exclude_modules (e.g. '.*visual.*') instead")
    _check_sequence_parallel(cfg, dp, report)


def _check_fsdp_precision_and_offload(cfg: Config, dp: int, report: _Report) -> None:
    """The actor's and critic's ``fsdp_config`` offload and dtypes. param_offload on one GPU rank is
    honoured by sharding over a one-rank group (the workers do it), so only a CPU run refuses it."""
    for role in ("actor", "critic"):
        fsdp = getattr(cfg, role).fsdp_config
        key = f"{role}.fsdp_config"
        if fsdp.param_offload and cfg.trainer.device == "cpu":
            report.error(f"{key}.param_offload=true moves parameters from the GPU to the CPU, but "
                         f"trainer.device={cfg.trainer.device}: on a CPU run they are in host memory already")
        if fsdp.model_dtype == "bfloat16" and cfg.model.dtype != "bfloat16":
            report.error(f"{key}.model_dtype=bfloat16 stores the trained weights in bf16, so they compute in bf16: "
                         f"set model.dtype=bfloat16 too (model.dtype={cfg.model.dtype} over float32 weights is "
                         f"{key}.model_dtype=float32)")
        if fsdp.reduce_dtype != "float32" and dp == 1 and not fsdp.param_offload:
            report.warn(f"{key}.reduce_dtype={fsdp.reduce_dtype} has no effect: one unsharded rank reduces no "
                        "gradients")
    if cfg.actor.fsdp_config.model_dtype == "bfloat16" and cfg.actor.lora.rank > 0:
        report.error("actor.fsdp_config.model_dtype=bfloat16 with actor.lora.rank > 0: LoRA's adapters stay float32 "
                     "(they are small) and its frozen base is stored as actor.lora.base_dtype says; set "
                     "actor.lora.base_dtype=bfloat16 instead")


def sequence_parallel_sizes(cfg: Config) -> dict[str, int]:
    """Each training role's Ulysses group size by its config key (the reference's None: the actor's)."""
    actor = cfg.actor.ulysses_sequence_parallel_size
    ref = cfg.ref.ulysses_sequence_parallel_size
    return {"actor.ulysses_sequence_parallel_size": actor,
            "ref.ulysses_sequence_parallel_size": actor if ref is None else ref,
            "critic.ulysses_sequence_parallel_size": cfg.critic.ulysses_sequence_parallel_size}


def _check_sequence_parallel(cfg: Config, dp: int, report: _Report) -> None:
    """Ulysses groups: blocks of sp ranks, over packed micro-batches, splitting the model's heads
    (read from its config.json where it is readable now; the engine checks again when it loads)."""
    packed = {"actor": cfg.actor.use_remove_padding, "ref": cfg.actor.use_remove_padding,
              "critic": cfg.critic.use_remove_padding}
    paths = {"actor": cfg.model.path, "ref": cfg.model.path, "critic": cfg.critic.model.path or cfg.model.path}
    for key, sp in sequence_parallel_sizes(cfg).items():
        role = key.split(".")[0]
        shape = read_model_shape(paths[role]) if sp > 1 else None
        heads, kv_heads = (shape.num_attention_heads, shape.num_key_value_heads) if shape else (sp, sp)
        if sp < 1:
            report.error(f"{key}={sp} must be >= 1 (1: no sequence parallelism)")
        elif dp % sp:
            report.error(f"{key}={sp} must divide the {dp} ranks ({dp_source(cfg.trainer)}): each block of {sp} "
                         f"ranks splits the same micro-batches; use a divisor of {dp}, e.g. "
                         f"{_or_list(_divisors_near(dp, sp))}")
        elif sp > 1 and not packed[role]:
            remove_padding = "critic.use_remove_padding" if role == "critic" else "actor.use_remove_padding"
            report.error(f"{key}={sp} splits packed sequences; it needs {remove_padding}=true")
        elif heads % sp or (kv_heads % sp and sp % kv_heads):
            report.error(f"{key}={sp} must divide the {heads} attention heads of {paths[role]} (and divide or be a "
                         f"multiple of its {kv_heads} key-value heads): each rank attends with heads/{sp} of them")


JUDGE_PLACEHOLDERS = {"prompt": "", "response": "", "ground_truth": ""}


def _check_reward_model(cfg: Config, report: _Report) -> None:
    """The ``reward_model`` section: what its style needs, and ranges. The model directory itself
    is checked in set-up's ``resolve_plugins`` (it reads config.json)."""
    rm, judge = cfg.reward_model, cfg.reward_model.judge
    if rm.micro_batch_size_per_gpu < 1:
        report.error(f"reward_model.micro_batch_size_per_gpu={rm.micro_batch_size_per_gpu} must be >= 1")
    if rm.max_length is not None and rm.max_length < 2:
        report.error(f"reward_model.max_length={rm.max_length} must be >= 2 tokens or null")
    if judge.max_concurrency < 1:
        report.error(f"reward_model.judge.max_concurrency={judge.max_concurrency} must be >= 1")
    if judge.timeout_s <= 0:
        report.error(f"reward_model.judge.timeout_s={judge.timeout_s} must be > 0 seconds")
    if judge.max_retries < 0 or judge.backoff_s < 0:
        report.error(f"reward_model.judge.max_retries={judge.max_retries} and backoff_s={judge.backoff_s} must be >= 0")
    if judge.max_tokens < 1:
        report.error(f"reward_model.judge.max_tokens={judge.max_tokens} must be >= 1")
    _check_judge_text(cfg, report)
    if not rm.enable:
        if rm.model.path is not None or judge.base_url is not None:
            report.warn("reward_model.model.path / reward_model.judge.base_url are set but reward_model.enable=false: "
                        "no reward model scores this run")
        return
    if rm.style == "discriminative" and rm.model.path is None:
        report.error("reward_model.model.path is null: reward_model.enable=true with style=discriminative needs a "
                     "local sequence-classification model directory (or set reward_model.style=generative)")
    if rm.style == "generative" and judge.base_url is None:
        report.error("reward_model.judge.base_url is null: reward_model.style=generative needs the judge's "
                     "OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    if rm.combine == "replace" and cfg.reward.custom_reward_function.path is not None:
        report.warn("reward.custom_reward_function is set but reward_model.combine=replace: the model's score "
                    "replaces it, so it is never called")


def _check_judge_text(cfg: Config, report: _Report) -> None:
    """The judge's template fills in exactly {prompt}, {response}, {ground_truth}; its score regex
    compiles and has a group to read."""
    judge = cfg.reward_model.judge
    try:
        judge.prompt_template.format(**JUDGE_PLACEHOLDERS)
    except (KeyError, IndexError, ValueError) as error:
        report.error(f"reward_model.judge.prompt_template: {error!r} while filling in {{prompt}}, {{response}}, "
                     f"{{ground_truth}}; write a literal brace as {{{{ or }}}}")
    if judge.score_pattern is not None:
        try:
            groups = re.compile(judge.score_pattern).groups
        except re.error as error:
            report.error(f"reward_model.judge.score_pattern={judge.score_pattern!r} is not a regex: {error}")
        else:
            if groups < 1:
                report.error(f"reward_model.judge.score_pattern={judge.score_pattern!r} needs a group around the "
                             "score, e.g. 'Rating: ([0-9.]+)'")


_CHECKS = (
    _check_ranges,
    _check_all_sampling,
    _check_names,
    _check_batches,
    _check_algorithm,
    _check_critic,
    _check_lora,
    _check_reward_model,
    _check_multi_turn,
    _check_prefill_budget,
    _check_reward_manager,
    _check_sandbox_fusion,
    _check_raw_chat_and_images,
    _check_trainer,
    _check_backend,
    _check_files,
)


def validate_config(cfg: Config) -> list[str]:
    """Check a resolved config; return its warnings, raise ``ConfigError`` listing every error.

    Cheap (no model or data is touched beyond checking that named files exist), so it runs at
    start-up and in ``hybridflow config explain``.
    """
    report = _Report()
    for check in _CHECKS:
        check(cfg, report)
    raise_all([ConfigError(message) for message in report.errors])
    return report.warnings

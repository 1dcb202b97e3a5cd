"""Token budgets decided once per run, recorded in the run folder and kept for its resumes.

With ``use_dynamic_bsz`` and no ``*_max_token_len_per_gpu`` set, each training role cuts its batches
by a token budget it derives from the model's shape and the memory free on its device when it
starts (``hybridflow.config.budget.auto_token_budget``). Free memory is not a fact of the run: other
processes hold some of it, and a resumed run may start beside a different load, or on another
machine. The budget decides which samples share a micro-batch, and so the order in which gradients
are summed: a different budget gives a resumed run different float rounding from the run it
continues. So the first start records every budget it derived (``TOKEN_BUDGETS_FILE``, with the
config keys that reproduce it), and a later start in the same folder sets those keys from the record
before any role starts: a resume cuts its batches as the run it continues did. A budget the user
sets is kept, and never recorded.

The native rollout engine's KV cache budget (``rollout.kv_cache_memory_bytes``) is the same kind of
value: unset, each engine takes a share of the memory free when it starts, and the budget bounds
how many sequences decode together (so which rows share a forward, and what the prefix cache keeps).
It is recorded with the token budgets (the smallest any replica derived) and read back the same way.

So is the CPU thread count (``trainer.num_threads``): unset, it is a rule of the machine
(``rule_threads``: the cores this process may use, split over the Ray ranks that share them), and the
count decides how each op splits its reductions, so float rounding: a resume on a machine with another
core count would not continue the same run. ``trainer.num_threads=follow`` (threads that follow the
free cores) and a number the user sets are never recorded.

So is the training compute dtype of ``model.dtype=auto`` (``utils.device.rule_train_dtype``: bf16 on
a CUDA device or a CPU with bf16 hardware): a resume on a CPU without bf16 hardware keeps computing
in the precision the run started in. An explicit ``model.dtype`` is never recorded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hybridflow.cluster.worker_group import WorkerGroup
from hybridflow.config import Config
from hybridflow.config.apply import apply_override
from hybridflow.config.layout import data_parallel_size
from hybridflow.config.schema import key_value
from hybridflow.controller.rollout_dtype import write_record
from hybridflow.utils.device import AUTO_DTYPE, rule_train_dtype
from hybridflow.utils.threads import rule_threads

log = logging.getLogger(__name__)

TOKEN_BUDGETS_FILE = "token_budgets.json"

ROLE_KEYS: dict[str, tuple[str | None, str]] = {
    "actor": ("actor.ppo_max_token_len_per_gpu", "actor.log_prob_max_token_len_per_gpu"),
    "critic": ("critic.ppo_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu"),
    "reference": (None, "ref.log_prob_max_token_len_per_gpu"),
}
"""Each training role's budget keys: (its update's, its forward passes'); the reference only runs forwards."""

KV_CACHE_KEY = "rollout.kv_cache_memory_bytes"
"""The rollout engines' KV cache budget in bytes (derived by the engines when unset)."""

THREADS_KEY = "trainer.num_threads"
"""torch's CPU threads per computing process (``rule_threads`` when unset)."""

DTYPE_KEY = "model.dtype"
"""The training compute dtype (``rule_train_dtype`` for ``auto``); recorded as its name, not a number."""
RECORDED_DTYPES = ("float32", "bfloat16")

_WHY = ("decided at the run's first start from the machine (free memory, cores); a resume reads them back, "
        "since each changes which numbers are summed together")


def _recordable(key: str, value: Any) -> bool:
    if key == DTYPE_KEY:
        return value in RECORDED_DTYPES
    return isinstance(value, int) and value > 0


def read_budgets(output_dir: Path) -> dict[str, int | str]:
    """The recorded budgets by config key (empty when the folder has no record). A record that
    cannot be read is an error naming the file: guessing would break the resume it exists for."""
    record = output_dir / TOKEN_BUDGETS_FILE
    if not record.is_file():
        return {}
    try:
        budgets = json.loads(record.read_text(encoding="utf-8"))["budgets"]
        if not all(isinstance(k, str) and _recordable(k, v) for k, v in budgets.items()):
            raise ValueError(f"budgets must map config keys to positive integers ({DTYPE_KEY} to a dtype name)")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{record} is damaged ({error}): it records the token budgets this run started with; "
                         "delete it to derive them again, or set the *_max_token_len_per_gpu keys, "
                         f"{KV_CACHE_KEY}, {THREADS_KEY} and {DTYPE_KEY}") from None
    return budgets


def apply_recorded_budgets(cfg: Config, output_dir: Path) -> list[str]:
    """Set each budget key the config leaves automatic (None; ``auto`` for the dtype) to the value
    this folder's record holds; returns the keys set. Call before any role starts."""
    applied = []
    for key, value in read_budgets(output_dir).items():
        if key_value(cfg, key) in (None, AUTO_DTYPE):
            apply_override(cfg, f"{key}={value}")
            applied.append(f"{key}={value}")
    if applied:
        log.info("token budgets and threads as this run folder recorded when the run started (%s): %s",
                 output_dir / TOKEN_BUDGETS_FILE, " ".join(applied))
    return applied


def automatic_budget_keys(cfg: Config) -> set[str]:
    """The budget keys each role will derive itself at start-up (dynamic micro-batches, key unset)."""
    dynamic = {"actor": cfg.actor.use_dynamic_bsz, "critic": cfg.critic.use_dynamic_bsz,
               "reference": cfg.actor.use_dynamic_bsz}
    keys = {key for role, keys in ROLE_KEYS.items() if dynamic[role] for key in keys
            if key is not None and key_value(cfg, key) is None}
    return keys | ({KV_CACHE_KEY} if cfg.rollout.kv_cache_memory_bytes is None else set())


def record_budgets(output_dir: Path, automatic: set[str], groups: dict[str, tuple[WorkerGroup[Any], Any]],
                   kv_cache_bytes: int | None = None) -> None:
    """Record the budgets the roles derived for the keys in ``automatic``. ``groups``: role ->
    (its group, its worker class's ``token_budgets`` method), each returning one rank's
    (update budget, forward budget); every rank holds the same (the smallest rank's).
    ``kv_cache_bytes``: the rollout engines' KV cache budget (None: an engine that sizes its own)."""
    derived: dict[str, int] = {}
    if KV_CACHE_KEY in automatic and kv_cache_bytes is not None:
        derived[KV_CACHE_KEY] = int(kv_cache_bytes)
    for role, (group, token_budgets) in groups.items():
        budgets = group.call_all(token_budgets)[0]
        for key, value in zip(ROLE_KEYS[role], budgets, strict=True):
            if key in automatic and value is not None:
                derived[key] = int(value)
    _record(output_dir, derived)


def decide_threads(cfg: Config, output_dir: Path) -> None:
    """A first start without ``trainer.num_threads``: set it by the rule and record it (a resume has
    read it back already, and a number or ``follow`` the user wrote is kept as written)."""
    if cfg.trainer.num_threads is not None:
        return
    t = cfg.trainer
    # In-process ranks take turns on one thread pool; Ray ranks (and a split rollout's) run at once.
    sharing = 1 if t.backend == "local" else data_parallel_size(t) * (2 if cfg.rollout.placement == "split" else 1)
    threads = rule_threads(sharing)
    apply_override(cfg, f"{THREADS_KEY}={threads}")
    _record(output_dir, {THREADS_KEY: threads})


def decide_train_dtype(cfg: Config, device_type: str, output_dir: Path) -> None:
    """A first start with ``model.dtype=auto``: set it by the rule and record it (a resume has read
    it back already; an explicit dtype is kept as written)."""
    if cfg.model.dtype != AUTO_DTYPE:
        return
    dtype, why = rule_train_dtype(device_type)
    log.info("model.dtype=auto: %s (%s)", dtype, why)
    apply_override(cfg, f"{DTYPE_KEY}={dtype}")
    _record(output_dir, {DTYPE_KEY: dtype})


def _record(output_dir: Path, derived: dict[str, int | str]) -> None:
    """Add ``derived`` to the folder's record (atomically)."""
    if not derived:
        return
    budgets = {**read_budgets(output_dir), **derived}
    record = output_dir / TOKEN_BUDGETS_FILE
    fields = {"budgets": budgets, "reuse": " ".join(f"{k}={v}" for k, v in sorted(budgets.items())), "why": _WHY}
    write_record(record, fields)
    log.info("recorded in %s: %s", record, " ".join(f"{k}={v}" for k, v in sorted(derived.items())))

"""Semantic checks of a resolved ``Config``, run at start-up before any model is loaded.

The loader guarantees types; this module checks what needs several keys at once, above all the
batch arithmetic. A bad batch split is the classic silent failure: a micro-batch larger than a
rank's share of the mini-batch gives zero gradient-accumulation steps and a NaN loss with no
clear error (verl #2505). Every message states the numbers involved and a value that would work.

The checks live in ``hybridflow/config/checks/``, one module per concern (single-key ranges, batch
arithmetic, the algorithm, placement, reward, what the run reads); the batch and rank layout they
check is ``hybridflow/config/layout.py``. ``_CHECKS`` below fixes the order in which messages appear.

All errors are collected and raised together, so one run shows every problem. What this machine
lacks (a GPU, a package) is not the config's problem and is not checked here: see
``machine_problems`` in controller/setup.py.
"""

from __future__ import annotations

from hybridflow.config.checks.algorithm import check_algorithm
from hybridflow.config.checks.batches import check_batches, check_critic
from hybridflow.config.checks.distillation import check_distillation
from hybridflow.config.checks.prime import check_prime
from hybridflow.config.checks.placement import check_backend, check_lora, check_prefill_budget
from hybridflow.config.checks.ranges import check_all_sampling, check_names, check_ranges
from hybridflow.config.checks.report import Report
from hybridflow.config.checks.reward import check_reward_manager, check_reward_model, check_sandbox_fusion
from hybridflow.config.checks.run import check_files, check_multi_turn, check_raw_chat_and_images, check_trainer
from hybridflow.config.errors import ConfigError, raise_all
from hybridflow.config.schema import Config

_CHECKS = (
    check_ranges,
    check_all_sampling,
    check_names,
    check_batches,
    check_algorithm,
    check_distillation,
    check_prime,
    check_critic,
    check_lora,
    check_reward_model,
    check_multi_turn,
    check_prefill_budget,
    check_reward_manager,
    check_sandbox_fusion,
    check_raw_chat_and_images,
    check_trainer,
    check_backend,
    check_files,
)


def validate_config(cfg: Config) -> list[str]:
    """Check a resolved config; return its warnings, raise ``ConfigError`` listing every error.

    Cheap (no model or data is touched beyond checking that named files exist), so it runs at
    start-up and in ``hybridflow config explain``.
    """
    report = Report()
    for check in _CHECKS:
        check(cfg, report)
    raise_all([ConfigError(message) for message in report.errors])
    return report.warnings

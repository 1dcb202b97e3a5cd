"""Typed configuration: schema, presets, YAML + dotted CLI overrides, validation, explain.

Typical start-up::

    cfg = load_config(preset, config_file, overrides)   # type errors name the dotted key
    warnings = validate_config(cfg)                     # batch arithmetic, before any model loads
"""

from __future__ import annotations

from typing import Any

from hybridflow.config.apply import apply_override, config_from_dict
from hybridflow.config.coerce import schema_keys
from hybridflow.config.errors import ConfigError
from hybridflow.config.explain import (
    BUILTIN_TINY,
    explain_config,
    needs_reference_model,
    planned_total_steps,
    steps_per_epoch,
    warm_start_decision,
)
from hybridflow.config.layout import BatchPlan, batch_plan, compute_batch_plan
from hybridflow.config.loader import list_presets, load_config, preset_path
from hybridflow.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    CustomRewardConfig,
    DataConfig,
    KLControlConfig,
    ModelConfig,
    OptimConfig,
    PolicyLossConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    ValKwargsConfig,
    WarmStartConfig,
)
from hybridflow.config.validate import validate_config
from hybridflow.config.yaml_io import config_to_dict, config_to_yaml

__all__ = [
    "BUILTIN_TINY",
    "ActorConfig",
    "AlgorithmConfig",
    "BatchPlan",
    "Config",
    "ConfigError",
    "CustomRewardConfig",
    "DataConfig",
    "KLControlConfig",
    "ModelConfig",
    "OptimConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "ValKwargsConfig",
    "WarmStartConfig",
    "apply_override",
    "batch_plan",
    "compute_batch_plan",
    "config_from_dict",
    "config_reference_markdown",
    "config_to_dict",
    "config_to_yaml",
    "explain_config",
    "list_presets",
    "load_config",
    "needs_reference_model",
    "planned_total_steps",
    "preset_path",
    "schema_keys",
    "steps_per_epoch",
    "validate_config",
    "warm_start_decision",
]


def __getattr__(name: str) -> Any:
    # Imported lazily: ``python -m hybridflow.config.reference`` would otherwise find the module
    # already imported by this package and warn about running it twice.
    if name == "config_reference_markdown":
        from hybridflow.config.reference import config_reference_markdown

        return config_reference_markdown
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

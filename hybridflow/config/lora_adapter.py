"""``actor.lora.adapter_path``: a saved PEFT adapter folder that LoRA training starts from.

verl's ``actor_rollout_ref.model.lora_adapter_path`` loads the folder with PEFT's
``PeftModel.from_pretrained`` and trains the adapter it holds; the folder's own adapter_config.json
decides the adapter's shape and verl's ``lora_rank``/``lora_alpha``/``target_modules`` are not read.
hybridflow does the same: ``apply_adapter_config`` fills ``actor.lora`` from the folder when the
config is loaded, so everything that reads ``actor.lora`` (the reference as the actor with its
adapter off, weight syncs, checkpoints, exports) sees the adapter that is trained. A value given
here that differs is replaced, with one note naming it (verl replaces it silently).

Only what ``actor.lora`` can state is accepted: a plain LoRA adapter (no DoRA, no rank-stabilised
scaling, no per-module ranks, no extra trained modules, no bias). The adapter's weights are loaded
by the actor (``hybridflow.models.lora.load_adapter``).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from hybridflow.config.errors import ConfigError

log = logging.getLogger(__name__)

KEY = "actor.lora.adapter_path"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"

# adapter_config.json entries that actor.lora cannot state, with the value that means "not used".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "use_rslora": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "modules_to_save": ([], None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "layers_to_transform": (None, []),
    "layer_replication": (None, []),
    "lora_bias": (False, None),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, {}, []),
}


def read_adapter_config(path: str) -> dict[str, Any]:
    """``actor.lora``'s values (rank, alpha, target_modules, dropout, exclude_modules) from the
    adapter folder at ``path``. Raises ``ConfigError`` (one line naming the path) for a missing
    folder, a missing or unreadable adapter_config.json, a missing weights file, or an adapter that
    is not plain LoRA."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise _error(path, "is not a directory: give a saved PEFT adapter folder (adapter_config.json + "
                           "adapter_model.safetensors)")
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file():
        raise _error(path, f"has no {ADAPTER_CONFIG}: is it a PEFT adapter folder (save_pretrained of a PeftModel)?")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise _error(path, f"has no {ADAPTER_WEIGHTS} (the adapter's weights, safetensors only)")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise _error(path, f"has an unreadable {ADAPTER_CONFIG}: {exc}") from exc
    if not isinstance(raw, dict):
        raise _error(path, f"has an {ADAPTER_CONFIG} that is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise _error(path, f"holds a {raw.get('peft_type')} adapter; actor.lora trains LoRA adapters")
    for name, unused in _UNSUPPORTED.items():
        if name in raw and raw[name] not in unused:
            raise _error(path, f"sets {name}={raw[name]!r} in {ADAPTER_CONFIG}, which actor.lora cannot train "
                               f"(plain LoRA only: {name} must be {unused[0]!r})")
    try:
        return {"rank": int(raw["r"]), "alpha": float(raw["lora_alpha"]),
                "target_modules": _target_modules(raw.get("target_modules")),
                "dropout": float(raw.get("lora_dropout") or 0.0),
                "exclude_modules": _exclude_regex(raw.get("exclude_modules"))}
    except (KeyError, TypeError, ValueError) as exc:
        raise _error(path, f"has an {ADAPTER_CONFIG} without a usable {exc}") from exc


def apply_adapter_config(cfg: Any) -> None:
    """With ``actor.lora.adapter_path`` set, ``actor.lora`` takes the adapter's values (verl: the
    adapter's config wins); a differing value the config gave with LoRA on is named in one note."""
    lora = cfg.actor.lora
    if lora.adapter_path is None:
        return
    values = read_adapter_config(lora.adapter_path)
    if lora.rank > 0:
        changed = [f"{name} {getattr(lora, name)!r} -> {value!r}" for name, value in values.items()
                   if getattr(lora, name) != value]
        if changed:
            log.warning("%s: the adapter's own config wins, as in verl: actor.lora %s", KEY, ", ".join(changed))
    for name, value in values.items():
        setattr(lora, name, value)


def _target_modules(value: Any) -> list[str]:
    """PEFT saves the target modules as a list of names (all-linear expanded), or as one string:
    all-linear, or a regular expression, which actor.lora's name list cannot state."""
    if isinstance(value, str):
        if value == ALL_LINEAR:
            return [ALL_LINEAR]
        raise ValueError(f"target_modules (a regular expression, {value!r}; actor.lora.target_modules lists names)")
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError("target_modules (a list of module names)")
    return sorted(value)


def _exclude_regex(value: Any) -> str | None:
    """PEFT's exclude_modules as actor.lora.exclude_modules (one regular expression matched whole):
    a list of names excludes a module whose name is one of them or ends in '.<name>', as PEFT does."""
    if value is None or value == []:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return r"(.*\.)?(" + "|".join(re.escape(v) for v in sorted(value)) + ")"
    raise ValueError("exclude_modules (a regular expression or a list of names)")


def _error(path: str, problem: str) -> ConfigError:
    return ConfigError(f"{KEY}={path!r} {problem}", key=KEY)

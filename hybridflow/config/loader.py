"""Build a typed ``Config`` from layers: schema defaults, a preset, files, CLI overrides.

Precedence, lowest to highest::

    schema defaults  <  preset YAML  <  --config-path/--config-name (Hydra)  <  --config FILE  <  overrides

Every value is checked against the dataclass annotation of its field as it is applied, so a
typo or a wrong type fails here, naming the dotted key and the layer it came from, long before
a model is loaded. Semantic checks that need several keys at once (batch arithmetic) live in
``validate.py``; this module only guarantees that the result is structurally a ``Config``.
``load_config_collecting`` goes on past a bad key and returns every error with the config.
Files are read by ``yaml_io.py``, applied key by key by ``apply.py`` and each value checked against the
schema by ``coerce.py``; this module orders the layers and reports what they did.

The schema is plain dataclasses, applied here by hand: strict booleans, ``1e-5`` read as a float,
a suggestion on every unknown key, verl's spellings through the alias table. What verl's users
type is read by the libraries they already use: overrides by Hydra's override parser
(``overrides.py``: ``+key``, ``++key``, ``~key``, lists, quoting), ``--config-name`` files by
Hydra's composition and OmegaConf's interpolation (``compose.py``). ``+`` is no escape hatch here:
every key, with or without it, must be one of the schema's or verl's known spellings.

A verl command line gets verl's defaults where they differ in meaning (``verl_defaults``): no
``algorithm.adv_estimator`` means verl's gae (PPO with a critic), and several GPUs or nodes mean
the Ray backend unless ``trainer.backend`` is set.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridflow.config.aliases import translate_key
from hybridflow.config.apply import apply_mapping, apply_override
from hybridflow.config.coerce import PRESET_KEY, SUGGESTION_CUTOFF, schema_paths, value_text
# ConfigError and MachineProblem live in errors.py; importing them from here keeps working.
from hybridflow.config.errors import ConfigError, ConfigErrors, MachineProblem, raise_all  # noqa: F401
from hybridflow.config.lora_adapter import apply_adapter_config
from hybridflow.config.overrides import DELETE, ParsedOverride, parse_override
from hybridflow.config.schema import Config
from hybridflow.config.verl_keys import GLOBAL_MICRO_BATCH, normalise, per_rank_micro_batch
from hybridflow.config.yaml_io import read_yaml_mapping


PRESETS_DIR = Path(__file__).resolve().parent / "presets"
"""Folder of the shipped presets; ``<name>.yaml`` is the preset ``name``."""


log = logging.getLogger(__name__)


def _presets_dir(command: str | None) -> Path:
    # A command other than train keeps its presets in a folder of its own: a train preset means nothing
    # to it, and its presets (which set shared keys such as trainer.total_training_steps) must not reach train.
    return PRESETS_DIR if command is None else PRESETS_DIR / command


def list_presets(command: str | None = None) -> list[str]:
    """Names of the shipped presets, sorted: ``hybridflow train``'s (``hybridflow/config/presets/<name>.yaml``),
    or with ``command`` that command's own (``presets/<command>/<name>.yaml``, e.g. ``hybridflow rm``'s)."""
    return sorted(p.stem for p in _presets_dir(command).glob("*.yaml"))


def preset_path(name: str, command: str | None = None) -> Path:
    """The file of preset ``name`` (of ``command``, see ``list_presets``); ``ConfigError`` with the closest
    name if there is none."""
    available = list_presets(command)
    if name not in available:
        close = difflib.get_close_matches(name, available, n=1, cutoff=SUGGESTION_CUTOFF)
        hint = f"did you mean '{close[0]}'? " if close else ""
        whose = f"hybridflow {command}'s presets" if command else "available presets"
        raise ConfigError(f"unknown preset {name!r}; {hint}{whose}: {', '.join(available) or 'none'}", key=PRESET_KEY)
    return _presets_dir(command) / f"{name}.yaml"


def _apply_preset(cfg: Config, name: str, assigned: set[str] | None = None, command: str | None = None) -> None:
    path = preset_path(name, command)
    mapping = read_yaml_mapping(path, what=f"preset '{name}'")
    apply_mapping(cfg, mapping, "", f"preset '{name}' ({path})")
    if assigned is not None:
        assigned |= {key for key, _ in _flat(mapping)}


def load_config(
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    config_path: str | None = None,
    config_name: str | None = None,
    command: str | None = None,
) -> Config:
    """Resolve a ``Config``: schema defaults, then ``preset``, then the Hydra composition of
    ``config_name`` in ``config_path`` (``--config-path/--config-name``), then ``config_file``, then
    ``overrides`` (Hydra's grammar: ``a.b.c=value``, ``+a.b=value``, ``~a.b``), each later layer winning.

    A config file may name ``preset: NAME`` at its top level; that preset then replaces the
    ``preset`` argument (the file is the more specific choice), and is applied before the
    file's own keys. ``preset=None`` means the plain schema defaults (the grpo preset's values),
    with verl's defaults where verl's keys are used (``verl_defaults``).

    A run left unnamed (``trainer.experiment_name`` at the schema default) is named after the
    preset and the data (``default_experiment_name``): ``--preset dapo`` writes ``runs/dapo-...``.

    ``command``: the command whose presets ``preset`` names (``list_presets``); None: ``hybridflow train``'s.

    The result is type-checked but not semantically validated: call ``validate_config``. Raises
    the first problem, or ``ConfigErrors`` listing all of them (``load_config_collecting``).
    """
    cfg, errors = load_config_collecting(preset, config_file, overrides, config_path=config_path,
                                         config_name=config_name, command=command)
    raise_all(errors)
    return cfg


def load_config_collecting(
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    config_path: str | None = None,
    config_name: str | None = None,
    command: str | None = None,
) -> tuple[Config, list[ConfigError]]:
    """``load_config`` that goes on past a bad key: the config with every good key applied, and
    every error found (a key that failed keeps its earlier layer's value)."""
    if isinstance(overrides, str):
        # A bare string would be iterated character by character into nonsense overrides.
        raise TypeError("overrides must be a sequence of 'key=value' strings, not a single string")
    errors: list[ConfigError] = []
    layers = _Layers(errors)
    parsed = [p for p in (layers.attempt(parse_override, text) for text in overrides) if p is not None]
    file_mapping: dict[str, Any] = {}
    if config_file is not None:
        file_mapping = layers.attempt(lambda: dict(read_yaml_mapping(config_file))) or {}
        if PRESET_KEY in file_mapping:
            named = file_mapping.pop(PRESET_KEY)
            if named is not None and not isinstance(named, str):
                errors.append(ConfigError(
                    f"config file '{config_file}': '{PRESET_KEY}' must be a preset name, got "
                    f"{value_text(named)}; available presets: {', '.join(list_presets(command))}",
                    key=PRESET_KEY,
                ))
            else:
                preset = named
    composed = None
    if config_path is not None or config_name is not None:
        composed = layers.attempt(_compose, config_path, config_name, parsed)
    cfg = Config()
    if preset is not None:
        layers.attempt(_apply_preset, cfg, preset, layers.assigned, command)
    critic_defaults = _apply_composed(cfg, composed, layers) if composed is not None else []
    if config_file is not None:
        source = f"config file '{config_file}'"
        for dotted, value in _flat(file_mapping):
            layers.apply(cfg, dotted, value, source)
    for override in parsed:
        if composed is not None and override.is_group_choice:
            continue  # Hydra chose that file in the composition
        if layers.defer_global_micro(override.key, override.value if override.kind != DELETE else None,
                                     f"override {override.text!r}"):
            continue
        key = layers.attempt(apply_override, cfg, override)
        if key is not None:
            layers.assigned.add(key)
            layers.given.add(key)
    verl = (composed is not None and composed.uses_verl) or any(
        key.startswith(VERL_ONLY_SECTION) for key in [p.key for p in parsed] + [k for k, _ in _flat(file_mapping)])
    layers.apply_global_micro(cfg)
    named_after = verl_defaults(cfg, layers.assigned, verl=verl and preset is None) or (
        f"{command}-{preset}" if command and preset else preset)
    _apply_critic_defaults(cfg, critic_defaults, layers)
    if cfg.trainer.experiment_name == _UNNAMED_RUN:
        cfg.trainer.experiment_name = default_experiment_name(named_after, cfg)
    # Last: a saved LoRA adapter's own shape wins over every layer's actor.lora values (as in verl).
    layers.attempt(apply_adapter_config, cfg)
    return cfg, errors


class _Layers:
    """What the layers did: the errors found (each attempt goes on past one) and the hybridflow
    keys some layer set (``verl_defaults`` fills in only what nobody set)."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        self.assigned: set[str] = set()
        self.given: set[str] = set()  # keys a user's layer (file, composition, command line) set
        self.global_micro: dict[str, tuple[Any, str]] = {}  # verl's global micro-batches: (value, source)

    def defer_global_micro(self, key: str, value: Any, source: str) -> bool:
        """verl's deprecated global micro-batch (verl_keys.GLOBAL_MICRO_BATCH) is kept until every
        layer is applied: its per-rank value needs the final trainer.n_gpus_per_node and nnodes."""
        if key not in GLOBAL_MICRO_BATCH or normalise(value) is None:
            return False
        self.global_micro[key] = (value, source)
        return True

    def apply_global_micro(self, cfg: Config) -> None:
        for key, (value, source) in self.global_micro.items():
            per_gpu = GLOBAL_MICRO_BATCH[key].per_gpu
            if per_gpu in self.given:
                # verl's config refuses both ("Please remove ... the former is deprecated").
                self.errors.append(ConfigError(f"{source}: verl's {key} and {per_gpu} both set the micro-batch; "
                                               f"keep one ({per_gpu}: samples per rank)", key=key))
                continue
            per_rank = self.attempt(per_rank_micro_batch, cfg, key, value)
            if per_rank is None:
                continue
            section, name = per_gpu.rsplit(".", 1)
            apply_mapping(cfg, _nest(section, {name: per_rank}), "", source)
            self.assigned.add(per_gpu)
            log.info("config: %s=%s over %d ranks is hybridflow's %s=%d", key, value,
                     cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes, per_gpu, per_rank)

    def attempt(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ConfigError as error:
            self.errors.append(error)
            return None

    def apply(self, cfg: Config, dotted: Any, value: Any, source: str) -> None:
        """One leaf of a file, through the alias table (verl's spelling) onto the schema."""
        if not isinstance(dotted, str):
            self.attempt(apply_mapping, cfg, {dotted: value}, "", source)  # names the bad key
            return
        if self.defer_global_micro(dotted, value, source):
            return
        try:
            ours = translate_key(dotted, value)
            if ours is not None:
                apply_mapping(cfg, _nest(ours, value), "", source)
                self.assigned.add(ours)
                self.given.add(ours)
        except ConfigError as error:
            self.errors.append(error)


def _flat(mapping: Mapping[Any, Any], prefix: str = "") -> list[tuple[Any, Any]]:
    """A nested mapping's leaves as (dotted key, value); a section left empty or null is a leaf."""
    out: list[tuple[Any, Any]] = []
    for key, value in mapping.items():
        if not isinstance(key, str):
            out.append((key, value) if not prefix else (prefix, {key: value}))
            continue
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value):
            out += _flat(value, dotted)
        else:
            out.append((dotted, value))
    return out


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


def _compose(config_path: str | None, config_name: str | None, parsed: Sequence[ParsedOverride]) -> Any:
    from hybridflow.config.compose import compose

    if config_path is None or config_name is None:
        given, missing = ("--config-path", "--config-name") if config_name is None else ("--config-name", "--config-path")
        raise ConfigError(f"{given} needs {missing} too: Hydra composes --config-name NAME from the folder "
                          f"--config-path DIR (e.g. --config-path verl/trainer/config --config-name ppo_trainer)",
                          key=missing)
    return compose(config_path, config_name, parsed)


def _apply_composed(cfg: Config, composed: Any, layers: _Layers) -> list[tuple[str, Any]]:
    """A Hydra composition's leaves (``compose.py``): what a user's file chose is checked like an
    override; verl's defaults are applied where hybridflow has the key and dropped elsewhere.
    Returns verl's critic defaults, kept for ``_apply_critic_defaults``."""
    from hybridflow.config.compose import MISSING

    schema = set(schema_paths()[0]) | set(schema_paths()[1])
    critic_defaults: list[tuple[str, Any]] = []
    refused: list[ConfigError] = []  # a verl config's choice of trainer that hybridflow refuses (Megatron)
    for leaf in composed.leaves:
        if leaf.key.rsplit(".", 1)[-1] == "_target_":
            continue  # the Python class verl builds the section as, not a setting
        if leaf.value is MISSING:
            if leaf.chosen and leaf.problem:
                layers.errors.append(ConfigError(f"{composed.source}: '{leaf.key}' {leaf.problem}", key=leaf.key))
            continue  # '???': the command line fills it in, or verl itself would stop
        if leaf.chosen:
            layers.apply(cfg, leaf.key, leaf.value, composed.source)
            continue
        try:
            ours = translate_key(leaf.key, leaf.value)
            if ours is None or ours not in schema or leaf.value is None:
                continue  # verl's default of something hybridflow does its own way, or leaves unset
            if ours.startswith(CRITIC_SECTION):
                critic_defaults.append((ours, leaf.value))
                continue
            apply_mapping(cfg, _nest(ours, leaf.value), "", f"verl's default in {composed.source}")
            layers.assigned.add(ours)
        except ConfigError as error:
            if leaf.key.rsplit(".", 1)[-1] == STRATEGY_KEY:
                # Not a default of a feature hybridflow lacks but the config's choice of trainer
                # (ppo_megatron_trainer.yaml: strategy=megatron): what it trains would not be verl's.
                refused.append(error)
            log.debug("verl's default %s=%r is not applied: %s", leaf.key, leaf.value, error)
    if refused:  # one line for one choice (the actor's, critic's, reference's ... strategy)
        more = f" (and the same for {len(refused) - 1} more roles)" if len(refused) > 1 else ""
        layers.errors.append(ConfigError(f"{composed.source}: {refused[0]}{more}", key=refused[0].key))
    return critic_defaults


CRITIC_SECTION = "critic."


STRATEGY_KEY = "strategy"
"""verl's per-role choice of training backend (fsdp, fsdp2, megatron): the one default of a verl
config folder that is checked, since a Megatron config trains something else than hybridflow's FSDP2."""


def _apply_critic_defaults(cfg: Config, defaults: list[tuple[str, Any]], layers: _Layers) -> None:
    """verl's critic defaults, where nobody set the key, for a run that trains a critic. verl builds
    one for gae only, and its critic defaults follow the actor's batch (``${oc.select:...}``), so in
    a GRPO run they would be judged against hybridflow's critic micro-batch for nothing."""
    if cfg.algorithm.adv_estimator != VERL_DEFAULT_ESTIMATOR:
        return
    for key, value in defaults:
        if key in layers.assigned:
            continue
        try:
            apply_mapping(cfg, _nest(key, value), "", "verl's critic default")
        except ConfigError as error:
            log.debug("verl's default %s=%r is not applied: %s", key, value, error)


VERL_ONLY_SECTION = "actor_rollout_ref."
"""A key under this section is verl's spelling: the command line is a verl one."""


VERL_DEFAULT_ESTIMATOR = "gae"
"""verl's ``algorithm.adv_estimator`` default (its ppo_trainer.yaml): PPO with a critic."""


def verl_defaults(cfg: Config, assigned: set[str], verl: bool) -> str | None:
    """Fill in what a command line means where nobody set the key; return the run's algorithm
    name when verl's estimator was filled in (for the run's name).

    - ``verl``: verl's keys were used (``actor_rollout_ref.*``, or a composition of verl's config)
      and no preset was chosen: no ``algorithm.adv_estimator`` means verl's ``gae``, so verl's PPO
      quickstart trains PPO with a critic, not the schema's GRPO.
    - ``trainer.n_gpus_per_node > 1`` or ``trainer.nnodes > 1`` means ranks in processes of their
      own: the Ray backend, unless ``trainer.backend`` was set (verl always runs on Ray).
    - ``actor.fsdp_config.model_dtype=bfloat16`` (pure bf16 weights) computes in bf16: model.dtype
      follows it unless it was set (verl's compute dtype is bf16 by default too).
    """
    named = None
    if verl and "algorithm.adv_estimator" not in assigned:
        cfg.algorithm.adv_estimator = VERL_DEFAULT_ESTIMATOR
        log.info("config: no algorithm.adv_estimator on a verl command line: verl's default, %s (PPO with a critic)",
                 VERL_DEFAULT_ESTIMATOR)
        named = "ppo"
    t = cfg.trainer
    if "trainer.backend" not in assigned and t.backend == "local" and (t.n_gpus_per_node > 1 or t.nnodes > 1):
        t.backend = "ray"
        log.info("config: trainer.n_gpus_per_node=%d x trainer.nnodes=%d ranks run on trainer.backend=ray (each "
                 "rank a process; set trainer.backend to choose)", t.n_gpus_per_node, t.nnodes)
    if cfg.actor.fsdp_config.model_dtype == "bfloat16" and "model.dtype" not in assigned:
        cfg.model.dtype = "bfloat16"
        log.info("config: actor.fsdp_config.model_dtype=bfloat16 stores the weights in bf16, so model.dtype (not "
                 "set) is bfloat16: the model computes in bf16")
    return named


_UNNAMED_RUN = Config().trainer.experiment_name
"""The schema's ``trainer.experiment_name``: a run nobody named, whose name follows what it runs."""


_NAME_UNSAFE_RE = re.compile(r"[^A-Za-z0-9._-]+")


def default_experiment_name(preset: str | None, cfg: Config) -> str:
    """``<preset>-<data>`` for a run left unnamed: ``dapo-arithmetic``, ``grpo-gsm8k``.

    The preset, not the schema default, says which algorithm runs (``preset=None`` is the schema
    defaults: GRPO). The data part is the built-in task, or the folder of the first training file
    (``~/data/gsm8k/train.parquet`` -> ``gsm8k``), so a run folder is recognisable in ``runs/``.
    """
    if cfg.data.train_files:
        first = Path(cfg.data.train_files[0]).expanduser()
        data = first.parent.name or first.stem
    else:
        data = cfg.data.builtin_task
    name = f"{preset or 'grpo'}-{data}"
    return _NAME_UNSAFE_RE.sub("_", name).strip("_") or "run"

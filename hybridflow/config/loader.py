"""Build a typed ``Config`` from layers: schema defaults, a preset, files, CLI overrides.

Precedence, lowest to highest::

    schema defaults  <  preset YAML  <  --config-path/--config-name (Hydra)  <  --config FILE  <  overrides

Every value is checked against the dataclass annotation of its field as it is applied, so a
typo or a wrong type fails here, naming the dotted key and the layer it came from, long before
a model is loaded. Semantic checks that need several keys at once (batch arithmetic) live in
``validate.py``; this module only guarantees that the result is structurally a ``Config``.
``load_config_collecting`` goes on past a bad key and returns every error with the config.

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

import copy
import dataclasses
import difflib
import functools
import logging
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hybridflow.config.aliases import translate_key
# ConfigError and MachineProblem live in errors.py; importing them from here keeps working.
from hybridflow.config.errors import ConfigError, ConfigErrors, MachineProblem, raise_all  # noqa: F401
from hybridflow.config.lora_adapter import apply_adapter_config
from hybridflow.config.overrides import DELETE, ParsedOverride, parse_override
from hybridflow.config.schema import Config
from hybridflow.config.verl_keys import GLOBAL_MICRO_BATCH, normalise, per_rank_micro_batch

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
"""Folder of the shipped presets; ``<name>.yaml`` is the preset ``name``."""

PRESET_KEY = "preset"
"""Top-level key of a config file that names the preset to start from."""

_NUMBER_RE = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
"""A decimal float literal. YAML 1.1 (PyYAML) reads ``1e-5`` as a *string* because it lacks a
dot; we accept such strings for float fields, and nothing looser (no ``nan``, ``inf``, ``1,5``)."""

_SUGGESTION_CUTOFF = 0.6
"""difflib similarity below which a guess is more confusing than helpful."""

log = logging.getLogger(__name__)

_NAME_SIMILARITY = 0.8
"""difflib similarity a mistyped key name keeps with the name meant (``lrr``/``lr`` 0.8,
``rolout``/``rollout`` 0.92); unrelated names that share a word score lower (``return_raw_chat``/
``truncation`` 0.48)."""


# ----------------------------------------------------------------------------------------------
# Schema introspection


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a schema dataclass.

    The schema uses ``from __future__ import annotations``, so ``dataclasses.fields`` only has
    strings like ``"int | None"``; ``get_type_hints`` evaluates them in the schema's module.
    """
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {fld.name: fld for fld in dataclasses.fields(cls)}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@functools.cache
def _all_paths() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """All dotted (leaf keys, section keys) of the schema, in declaration order."""
    leaves: list[str] = []
    sections: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = _field_types(cls)
        for name in _fields(cls):
            path = _join(prefix, name)
            if _is_section(hints[name]):
                sections.append(path)
                walk(hints[name], path)
            else:
                leaves.append(path)

    walk(Config, "")
    return tuple(leaves), tuple(sections)


def schema_keys() -> list[str]:
    """Every dotted leaf key of the schema (``data.train_batch_size``, ``actor.optim.lr``, ...)."""
    return list(_all_paths()[0])


# ----------------------------------------------------------------------------------------------
# Unknown keys


def _first_leaf_suffix(value: Any) -> str:
    """``{'n': 4}`` -> ``'.n'``: the rest of the path a misspelt section was meant to reach."""
    suffix = ""
    while isinstance(value, Mapping) and value:
        key, value = next(iter(value.items()))
        suffix += f".{key}"
    return suffix


def _suggest(section_cls: type, prefix: str, name: str, value: Any) -> str | None:
    """The valid dotted key the user most likely meant, or None when nothing is close.

    Tried in order: a leaf of exactly that name inside this section (``actor.lr`` ->
    ``actor.optim.lr``, not the similar sibling ``actor.lora``); a sibling with a similar name
    (``lrr`` -> ``lr``, ``rolout`` -> ``rollout``, keeping the rest of the path when it exists
    there); a leaf of exactly that name elsewhere; the closest full dotted path.
    """
    leaves, sections = _all_paths()
    all_paths = leaves + sections
    suffix = _first_leaf_suffix(value)
    attempted = _join(prefix, name)
    nested = [path for path in leaves if path.startswith(f"{prefix}.") and path.rsplit(".", 1)[-1] == name]
    if prefix and nested:
        return max(nested, key=lambda p: difflib.SequenceMatcher(None, attempted, p).ratio())
    sibling = _closest_name(name, list(_fields(section_cls)))
    if sibling:
        guess = _join(prefix, sibling)
        return guess + suffix if guess + suffix in all_paths else guess
    same_name = [path for path in leaves if path.rsplit(".", 1)[-1] == name]
    if same_name:
        # Prefer the one that shares the most of the path the user wrote.
        return max(same_name, key=lambda p: difflib.SequenceMatcher(None, attempted, p).ratio())
    # The closest full path, among those whose last part is a typo of the last part written: paths
    # share so much (section names, _size, _per_gpu) that their similarity alone suggests unrelated
    # keys (data.return_raw_chat -> data.truncation).
    last = (_join(prefix, name) + suffix).rsplit(".", 1)[-1]
    related = [path for path in all_paths if _similar_name(last, path.rsplit(".", 1)[-1])]
    close = difflib.get_close_matches(_join(prefix, name) + suffix, related, n=1, cutoff=_SUGGESTION_CUTOFF)
    return close[0] if close else None


def _closest_name(typed: str, names: Sequence[str]) -> str | None:
    """The name in ``names`` that ``typed`` is most likely a typo of, or None."""
    similar = [n for n in names if _similar_name(typed, n)]
    return max(similar, key=lambda n: difflib.SequenceMatcher(None, typed, n).ratio()) if similar else None


def _similar_name(typed: str, name: str) -> bool:
    """Whether ``typed`` reads as a typo of the key name ``name``: one edit away, or most of it the
    same (``_NAME_SIMILARITY``) and either a few edits away (``_edit_distance``: at most 2, or one
    per 8 characters of a long name) or cut short (``train_batch`` for ``train_batch_size``). Names
    that only share a long common part are not (``pipeline_model_parallel_size`` is not a typo of
    ``tensor_model_parallel_size``)."""
    distance = _edit_distance(typed, name)
    if distance <= 1:  # one slip, however short the name (rollout.nn for rollout.n)
        return True
    if difflib.SequenceMatcher(None, typed, name).ratio() < _NAME_SIMILARITY:
        return False
    return name.startswith(typed) or typed.startswith(name) or distance <= max(2, len(name) // 8)


def _edit_distance(a: str, b: str) -> int:
    """Damerau-Levenshtein distance (insertions, deletions, substitutions, adjacent swaps)."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[len(b)]


def _unknown_key_error(section_cls: type, prefix: str, name: str, value: Any, source: str) -> ConfigError:
    path = _join(prefix, name) + _first_leaf_suffix(value)
    if name == PRESET_KEY and not prefix:
        return ConfigError(
            f"'{PRESET_KEY}' is not a config key here ({source}); choose a preset by name "
            f"(hybridflow --preset NAME) or with a top-level 'preset: NAME' line in a config file",
            key=PRESET_KEY,
        )
    guess = _suggest(section_cls, prefix, name, value)
    if guess is not None:
        hint = f"did you mean '{guess}'?"
    else:
        where = f"in section '{prefix}'" if prefix else "at the top level"
        hint = f"valid keys {where}: {', '.join(_fields(section_cls))}"
    return ConfigError(f"unknown config key '{path}'; {hint} ({source})", key=path)


# ----------------------------------------------------------------------------------------------
# Type checking


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _value_text(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    """The members of ``X | Y`` (either spelling), or None if ``tp`` is not a union."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _type_error(key: str, value: Any, expected: Any, source: str, hint: str = "") -> ConfigError:
    extra = f"; {hint}" if hint else ""
    return ConfigError(
        f"config key '{key}' expects {_type_name(expected)}, got {_value_text(value)}{extra} ({source})",
        key=key,
    )


def _coerce_scalar(value: Any, tp: type, key: str, source: str, choices: Sequence[str] | None) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        # 0/1 are refused on purpose: a silent int->bool cast hides a value meant for another key.
        raise _type_error(key, value, bool, source, "write true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(key, value, int, source, "write a whole number such as 8")
    if tp is float:
        if isinstance(value, bool):
            raise _type_error(key, value, float, source)
        if isinstance(value, int):
            return float(value)
        if isinstance(value, float):
            number = value
        elif isinstance(value, str) and _NUMBER_RE.fullmatch(value.strip()):
            number = float(value)
        else:
            raise _type_error(key, value, float, source, "write a number such as 1e-6 or 0.2")
        if not math.isfinite(number):
            raise _type_error(key, value, float, source, "the number must be finite")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        # YAML reads an unquoted true/false as a boolean; for a string field whose allowed
        # values are 'true'/'false' (warm_start.enable) that is what the user meant.
        if isinstance(value, bool) and choices is not None and str(value).lower() in choices:
            return str(value).lower()
        hint = f"quote it: '{value}'" if isinstance(value, (int, float)) else ""
        raise _type_error(key, value, str, source, hint)
    raise ConfigError(f"config key '{key}' has an unsupported schema type {_type_name(tp)}", key=key)


def coerce_value(
    value: Any,
    tp: Any,
    key: str,
    *,
    source: str = "the config",
    choices: Sequence[str] | None = None,
    single_as_list: bool = False,
) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it in canonical form.

    Supported: ``int``, ``float`` (ints and decimal strings like ``"1e-5"`` accepted), ``bool``
    (real booleans or the strings true/false only), ``str``, ``X | None``, ``list[X]``, and unions
    of scalars such as ``float | str`` (the first member that takes the value).
    ``choices`` (from the field's metadata) restricts the allowed values; ``single_as_list``
    (likewise) reads a lone string as a one-element list (verl's ``data.train_files=a.parquet``).
    Raises ``ConfigError`` naming ``key``, the value and the expected type.
    """
    members = _union_args(tp)
    if members is not None:
        if value is None and type(None) in members:
            return None
        others = [m for m in members if m is not type(None)]
        if value is None:
            raise _type_error(key, value, tp, source)
        if len(others) > 1:
            # ``float | str`` (a number or a spec text, verl's rollout_rs_threshold): the first scalar
            # type that takes the value, in the order written.
            if not all(m in (int, float, bool, str) for m in others):
                raise ConfigError(f"config key '{key}' has an unsupported schema type {_type_name(tp)}", key=key)
            for member in others:
                try:
                    return coerce_value(value, member, key, source=source, choices=choices)
                except ConfigError:
                    continue
            raise _type_error(key, value, tp, source)
        return coerce_value(value, others[0], key, source=source, choices=choices)
    if value is None:
        raise _type_error(key, value, tp, source)
    if tp is dict or typing.get_origin(tp) is dict:
        # A free-form mapping (reward.reward_kwargs): any keys, values as written.
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _type_error(key, value, tp, source, "write a mapping such as {name: value}")
        return copy.deepcopy(dict(value))
    if typing.get_origin(tp) is list:
        (item_type,) = typing.get_args(tp)
        if single_as_list and isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            hint = f"write a list such as [{value}]" if isinstance(value, (str, int, float)) else ""
            raise _type_error(key, value, tp, source, hint)
        return [coerce_value(item, item_type, f"{key}[{i}]", source=source) for i, item in enumerate(value)]
    result = _coerce_scalar(value, tp, key, source, choices)
    if choices is not None and result not in choices:
        close = difflib.get_close_matches(str(result), list(choices), n=1, cutoff=_SUGGESTION_CUTOFF)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"config key '{key}' is {result!r}; allowed values: {', '.join(choices)}{hint} ({source})",
            key=key,
        )
    return result


def canonical_spelling(meta: Mapping[str, Any], value: Any) -> Any:
    """``value`` in the field's own spelling where its metadata names others (``spellings``: verl
    writes dtypes as bf16/fp32, the schema as bfloat16/float32), so either reads the same."""
    spellings = meta.get("spellings")
    return spellings.get(value, value) if spellings and isinstance(value, str) else value


# ----------------------------------------------------------------------------------------------
# Applying layers


def _apply_mapping(target: Any, mapping: Mapping[Any, Any], prefix: str, source: str) -> None:
    """Set the keys of a (partial, nested) mapping on the section dataclass ``target``."""
    section_cls = type(target)
    fields = _fields(section_cls)
    hints = _field_types(section_cls)
    for name, value in mapping.items():
        if not isinstance(name, str):
            where = f"under '{prefix}'" if prefix else "at the top level"
            raise ConfigError(f"config keys must be strings, got {name!r} {where} ({source})", key=prefix or None)
        if name not in fields:
            raise _unknown_key_error(section_cls, prefix, name, value, source)
        path = _join(prefix, name)
        tp = hints[name]
        if _is_section(tp):
            if value is None:  # "actor:" with every child commented out
                continue
            if not isinstance(value, Mapping):
                example = next(iter(_fields(tp)))
                raise ConfigError(
                    f"config key '{path}' is a section and expects a mapping of its keys "
                    f"(e.g. {path}.{example}), got {_value_text(value)} ({source})",
                    key=path,
                )
            _apply_mapping(getattr(target, name), value, path, source)
        else:
            meta = fields[name].metadata
            coerced = coerce_value(canonical_spelling(meta, value), tp, path, source=source,
                                   choices=meta.get("choices"), single_as_list=meta.get("single_as_list", False))
            if isinstance(coerced, dict):  # a mapping leaf: key=value overrides add to it, as Hydra merges
                coerced = {**getattr(target, name), **coerced}
            setattr(target, name, coerced)


def apply_override(cfg: Config, override: str | ParsedOverride) -> str | None:
    """Apply one override to ``cfg`` in place; return the hybridflow key it set (None: dropped).

    Hydra's grammar (``hybridflow.config.overrides``): ``key=value``, ``+key=value``,
    ``++key=value`` set a key, ``~key`` puts it back to its schema default; the value is Hydra's
    reading (``true``, ``null``, ``[a, b]``, ``{lr: 1e-5}`` for a section), except that a text key
    keeps the text as written, so ``trainer.experiment_name=2024`` or ``model.path=./ckpt/1.10``
    stay text instead of becoming numbers. ``${...}`` in a value is resolved against the config.
    """
    parsed = override if isinstance(override, ParsedOverride) else parse_override(override)
    source = f"override {parsed.text!r}"
    if parsed.is_group_choice:
        raise ConfigError(f"override {parsed.text!r} chooses a file of a config group, which only a Hydra composition "
                          f"has: give --config-path DIR --config-name NAME", key=parsed.key)
    # verl's spelling of a key (hybridflow.config.aliases); it sees the value as verl would read it.
    translated = translate_key(parsed.key, parsed.raw if parsed.problem else parsed.value)
    if translated is None:
        return None
    key = translated
    parts = key.split(".")
    target: Any = cfg
    for depth, name in enumerate(parts):
        prefix = ".".join(parts[:depth])
        section_cls = type(target)
        fields = _fields(section_cls)
        if name not in fields:
            rest: Any = parsed.raw
            for later in reversed(parts[depth + 1 :]):
                rest = {later: rest}
            raise _unknown_key_error(section_cls, prefix, name, rest, source)
        tp = _field_types(section_cls)[name]
        path = _join(prefix, name)
        last = depth == len(parts) - 1
        if _is_section(tp):
            if not last:
                target = getattr(target, name)
                continue
            if parsed.kind == DELETE:
                setattr(target, name, tp())
                return key
            _apply_mapping(target, {name: _override_value(cfg, parsed, key, tp, source)}, prefix, source)
            return key
        if not last and (tp is dict or typing.get_origin(tp) is dict):
            # reward.reward_kwargs.alpha=2: one key inside a mapping leaf (nested keys make nested mappings).
            mapping = node = copy.deepcopy(getattr(target, name))
            for part in parts[depth + 1 : -1]:
                node = node[part] if isinstance(node.get(part), dict) else node.setdefault(part, {})
            if parsed.kind == DELETE:
                node.pop(parts[-1], None)
            else:
                node[parts[-1]] = _override_value(cfg, parsed, key, Any, source)
            setattr(target, name, mapping)
            return key
        if not last:
            raise ConfigError(
                f"config key '{path}' is a {_type_name(tp)} value, not a section, so '{key}' "
                f"does not exist ({source})",
                key=key,
            )
        meta = fields[name].metadata

        def coerce(value: Any) -> Any:
            return coerce_value(canonical_spelling(meta, value), tp, path, source=source, choices=meta.get("choices"),
                                single_as_list=meta.get("single_as_list", False))

        if parsed.kind == DELETE:
            if parsed.has_value and getattr(target, name) != coerce(_override_value(cfg, parsed, key, tp, source)):
                raise ConfigError(f"override {parsed.text!r}: '{path}' is {getattr(target, name)!r}, not the value "
                                  f"given, so it is not reset (Hydra's ~key=value resets only a matching key)", key=path)
            setattr(target, name, getattr(_default_section(cfg, prefix), name))
            return key
        setattr(target, name, coerce(_override_value(cfg, parsed, key, tp, source)))
        return key
    return key


def _default_section(cfg: Config, prefix: str) -> Any:
    """The schema's default of the section at ``prefix`` (``~key`` restores its fields from it)."""
    section: Any = Config()
    for name in filter(None, prefix.split(".")):
        section = getattr(section, name)
    return section


def _override_value(cfg: Config, parsed: ParsedOverride, key: str, tp: Any, source: str) -> Any:
    """The value an override gives ``key`` (annotated ``tp``): Hydra's reading, text keys keeping
    the text as written, interpolations resolved.

    A value outside Hydra's grammar that YAML reads (``~/data/x.parquet``, ``~`` for null, ``.inf``)
    is read as YAML, as hybridflow read every value before it spoke Hydra's grammar."""
    scalar = [m for m in (_union_args(tp) or (tp,)) if m is not type(None)]
    text_key = scalar == [str]
    value = parsed.value
    if parsed.problem is not None:
        if text_key:
            return parsed.raw
        value = None if parsed.is_sweep else _yaml_value(parsed.raw)
        if value is _UNREADABLE or parsed.is_sweep:
            raise ConfigError(f"config key '{key}': value {parsed.raw!r} cannot be read: {parsed.problem} ({source})",
                              key=key)
    if isinstance(value, str) and "${" in value:
        value = _interpolate(cfg, key, value, source)
    if text_key and value is not None and not isinstance(value, (str, list, dict)):
        value = parsed.raw.strip()  # Hydra made a number or boolean of it; keep the text
    return value


_UNREADABLE = object()


def _yaml_value(raw: str) -> Any:
    try:
        return yaml.load(raw, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return _UNREADABLE


def _interpolate(cfg: Config, key: str, value: str, source: str) -> Any:
    """``${...}`` in an override's value, resolved by OmegaConf against the config as it stands
    (``${data.max_prompt_length}``, ``${oc.env:HOME}``, ``${oc.select:a.b,default}``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    tree = OmegaConf.create(config_to_dict(cfg))
    try:
        OmegaConf.update(tree, key, value, merge=False, force_add=True)
        resolved = OmegaConf.select(tree, key, throw_on_resolution_failure=True)
        return OmegaConf.to_container(resolved, resolve=True) if OmegaConf.is_config(resolved) else resolved
    except OmegaConfBaseException as error:
        raise ConfigError(f"config key '{key}': cannot resolve {value!r}: {str(error).splitlines()[0]} ({source})",
                          key=key) from error


# ----------------------------------------------------------------------------------------------
# YAML files


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with three YAML 1.2 habits that PyYAML's YAML 1.1 lacks:

    - duplicate mapping keys are an error (PyYAML silently keeps the last one, which turns a
      copy-paste slip into a setting nobody meant);
    - only true/false are booleans (YAML 1.1 also reads yes/no/on/off, so ``data.shuffle=no``
      or a country code ``NO`` would change type behind the user's back);
    - ``1e-5`` is a float (YAML 1.1 needs a dot: ``1.0e-5``), the way everyone writes an lr.
    """


_BOOL_TAG = "tag:yaml.org,2002:bool"
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _construct_mapping_no_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            seen = key in first_line
        except TypeError:  # unhashable key: let the base constructor report it
            continue
        if seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first set on line {first_line[key] + 1})",
                key_node.start_mark,
            )
        first_line[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping_no_duplicates)


def read_yaml_mapping(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """Read a YAML file that must hold a mapping (an empty file is an empty mapping).

    Errors name the file: missing, a directory, unreadable, invalid YAML (with line and column),
    duplicate keys, or a top level that is not a mapping.
    """
    file = Path(path).expanduser()
    if not file.exists():
        raise ConfigError(f"{what} '{path}' does not exist")
    if file.is_dir():
        raise ConfigError(f"{what} '{path}' is a directory; expected a YAML file")
    try:
        with file.open(encoding="utf-8") as stream:
            data = yaml.load(stream, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"{what} '{path}' cannot be read: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} '{path}' is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{what} '{path}' must hold a mapping of sections (e.g. 'actor:' with keys under it), "
            f"got a {type(data).__name__}"
        )
    return data


# ----------------------------------------------------------------------------------------------
# Presets


def list_presets() -> list[str]:
    """Names of the shipped presets (``hybridflow/config/presets/<name>.yaml``), sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """The file of preset ``name``; ``ConfigError`` with the closest name if there is none."""
    available = list_presets()
    if name not in available:
        close = difflib.get_close_matches(name, available, n=1, cutoff=_SUGGESTION_CUTOFF)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"unknown preset {name!r}; {hint}available presets: {', '.join(available)}", key=PRESET_KEY)
    return PRESETS_DIR / f"{name}.yaml"


def _apply_preset(cfg: Config, name: str, assigned: set[str] | None = None) -> None:
    path = preset_path(name)
    mapping = read_yaml_mapping(path, what=f"preset '{name}'")
    _apply_mapping(cfg, mapping, "", f"preset '{name}' ({path})")
    if assigned is not None:
        assigned |= {key for key, _ in _flat(mapping)}


# ----------------------------------------------------------------------------------------------
# Public entry points


def load_config(
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    config_path: str | None = None,
    config_name: str | None = None,
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

    The result is type-checked but not semantically validated: call ``validate_config``. Raises
    the first problem, or ``ConfigErrors`` listing all of them (``load_config_collecting``).
    """
    cfg, errors = load_config_collecting(preset, config_file, overrides, config_path=config_path,
                                         config_name=config_name)
    raise_all(errors)
    return cfg


def load_config_collecting(
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    config_path: str | None = None,
    config_name: str | None = None,
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
                    f"{_value_text(named)}; available presets: {', '.join(list_presets())}",
                    key=PRESET_KEY,
                ))
            else:
                preset = named
    composed = None
    if config_path is not None or config_name is not None:
        composed = layers.attempt(_compose, config_path, config_name, parsed)
    cfg = Config()
    if preset is not None:
        layers.attempt(_apply_preset, cfg, preset, layers.assigned)
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
    named_after = verl_defaults(cfg, layers.assigned, verl=verl and preset is None) or preset
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
            _apply_mapping(cfg, _nest(section, {name: per_rank}), "", source)
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
            self.attempt(_apply_mapping, cfg, {dotted: value}, "", source)  # names the bad key
            return
        if self.defer_global_micro(dotted, value, source):
            return
        try:
            ours = translate_key(dotted, value)
            if ours is not None:
                _apply_mapping(cfg, _nest(ours, value), "", source)
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

    schema = set(_all_paths()[0]) | set(_all_paths()[1])
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
            _apply_mapping(cfg, _nest(ours, leaf.value), "", f"verl's default in {composed.source}")
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
            _apply_mapping(cfg, _nest(key, value), "", "verl's critic default")
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


def config_from_dict(data: Mapping[str, Any], source: str = "the config mapping") -> Config:
    """A ``Config`` from a partial nested mapping over the schema defaults (type-checked).

    ``config_from_dict(config_to_dict(cfg)) == cfg`` for every valid ``cfg``.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source} must be a mapping of sections, got {_value_text(data)}")
    cfg = Config()
    _apply_mapping(cfg, data, "", source)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain nested dicts/lists (a deep copy)."""
    return dataclasses.asdict(cfg)


class _ConfigDumper(yaml.SafeDumper):
    """Block-style sections, but a list of scalars on one line (``logger: [console, jsonl]``),
    the way people write them in a config file."""


def _represent_list(dumper: _ConfigDumper, items: list[Any]) -> yaml.SequenceNode:
    inline = all(not isinstance(item, (list, dict)) for item in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=inline)


_ConfigDumper.add_representer(list, _represent_list)


def config_to_yaml(cfg: Config) -> str:
    """The config as YAML, sections in schema order; it reads back to the same config with
    ``config_from_dict(yaml.safe_load(text))``."""
    return yaml.dump(config_to_dict(cfg), Dumper=_ConfigDumper, sort_keys=False, default_flow_style=False, width=1000)

"""Build a typed ``Config`` from layers: schema defaults, a preset, a YAML file, CLI overrides.

Precedence, lowest to highest::

    schema defaults  <  preset YAML  <  --config FILE  <  dotted overrides (a.b.c=value)

Every value is checked against the dataclass annotation of its field as it is applied, so a
typo or a wrong type fails here, naming the dotted key and the layer it came from, long before
a model is loaded. Semantic checks that need several keys at once (batch arithmetic) live in
``validate.py``; this module only guarantees that the result is structurally a ``Config``.

Why hand-written rather than OmegaConf/Hydra: the schema is plain dataclasses, and the few rules
we need (strict booleans, ``1e-5`` read as a float, a suggestion on every unknown key, no
``+key`` escape hatch that lets typos through) are simpler to state than to configure.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from hybridflow.config.aliases import translate_key, translate_mapping
from hybridflow.config.schema import Config

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
"""Folder of the shipped presets; ``<name>.yaml`` is the preset ``name``."""

PRESET_KEY = "preset"
"""Top-level key of a config file that names the preset to start from."""

_NUMBER_RE = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
"""A decimal float literal. YAML 1.1 (PyYAML) reads ``1e-5`` as a *string* because it lacks a
dot; we accept such strings for float fields, and nothing looser (no ``nan``, ``inf``, ``1,5``)."""

_OVERRIDE_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

_SUGGESTION_CUTOFF = 0.6
"""difflib similarity below which a guess is more confusing than helpful."""

_NAME_SIMILARITY = 0.8
"""difflib similarity a mistyped key name keeps with the name meant (``lrr``/``lr`` 0.8,
``rolout``/``rollout`` 0.92); unrelated names that share a word score lower (``return_raw_chat``/
``truncation`` 0.48)."""


class ConfigError(ValueError):
    """A config that cannot be used. The message names the dotted key (and the file or override
    it came from) and says what would be valid; ``key`` holds the dotted key when there is one."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


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
    (real booleans or the strings true/false only), ``str``, ``X | None``, ``list[X]``.
    ``choices`` (from the field's metadata) restricts the allowed values; ``single_as_list``
    (likewise) reads a lone string as a one-element list (verl's ``data.train_files=a.parquet``).
    Raises ``ConfigError`` naming ``key``, the value and the expected type.
    """
    members = _union_args(tp)
    if members is not None:
        if value is None and type(None) in members:
            return None
        others = [m for m in members if m is not type(None)]
        if len(others) != 1:
            raise ConfigError(f"config key '{key}' has an unsupported schema type {_type_name(tp)}", key=key)
        if value is None:
            raise _type_error(key, value, tp, source)
        return coerce_value(value, others[0], key, source=source, choices=choices)
    if value is None:
        raise _type_error(key, value, tp, source)
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
            setattr(target, name, coerce_value(value, tp, path, source=source, choices=meta.get("choices"),
                                               single_as_list=meta.get("single_as_list", False)))


def _parse_override(text: str) -> tuple[str, str]:
    """``'a.b=1'`` -> ``('a.b', '1')``, splitting at the first ``=``."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    expected = "expected the form section.key=value, e.g. actor.optim.lr=1e-5"
    if not sep:
        raise ConfigError(f"malformed override {text!r}: no '='; {expected}")
    if not _OVERRIDE_KEY_RE.fullmatch(key):
        raise ConfigError(
            f"malformed override {text!r}: {key!r} is not a dotted key; {expected} "
            f"(no leading '-' or '+': every key already exists in the schema)"
        )
    return key, raw


def _load_yaml_value(raw: str, key: str, source: str) -> Any:
    try:
        return yaml.load(raw, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        problem = str(exc)
        if isinstance(exc, yaml.MarkedYAMLError) and exc.problem and exc.problem_mark is not None:
            problem = f"{exc.problem} at character {exc.problem_mark.column + 1}"
        raise ConfigError(
            f"config key '{key}': value {raw!r} is not valid YAML ({problem}) ({source})", key=key
        ) from exc


def apply_override(cfg: Config, override: str) -> None:
    """Apply one ``a.b.c=value`` override to ``cfg`` in place.

    The value is read as YAML (``true``, ``null``, ``[a, b]``, ``{lr: 1e-5}`` for a section),
    except that a string field keeps the text as written, so ``trainer.experiment_name=2024``
    or ``model.path=./ckpt/1.10`` stay strings instead of becoming numbers.
    """
    key, raw = _parse_override(override)
    source = f"override {override!r}"
    translated = translate_key(key, raw)  # verl's spelling of a key (hybridflow.config.aliases)
    if translated is None:
        return
    key = translated
    parts = key.split(".")
    target: Any = cfg
    for depth, name in enumerate(parts):
        prefix = ".".join(parts[:depth])
        section_cls = type(target)
        fields = _fields(section_cls)
        if name not in fields:
            rest: Any = raw
            for later in reversed(parts[depth + 1 :]):
                rest = {later: rest}
            raise _unknown_key_error(section_cls, prefix, name, rest, source)
        tp = _field_types(section_cls)[name]
        path = _join(prefix, name)
        last = depth == len(parts) - 1
        if _is_section(tp):
            if last:
                value = _load_yaml_value(raw, path, source)
                _apply_mapping(target, {name: value}, prefix, source)
                return
            target = getattr(target, name)
            continue
        if not last:
            raise ConfigError(
                f"config key '{path}' is a {_type_name(tp)} value, not a section, so '{key}' "
                f"does not exist ({source})",
                key=key,
            )
        value = _load_yaml_value(raw, path, source)
        scalar = [m for m in (_union_args(tp) or (tp,)) if m is not type(None)]
        if scalar == [str] and value is not None and not isinstance(value, (str, list, dict)):
            value = raw.strip()  # YAML made a number, boolean or date of it; keep the text
        meta = fields[name].metadata
        setattr(target, name, coerce_value(value, tp, path, source=source, choices=meta.get("choices"),
                                           single_as_list=meta.get("single_as_list", False)))


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


def _apply_preset(cfg: Config, name: str) -> None:
    path = preset_path(name)
    mapping = read_yaml_mapping(path, what=f"preset '{name}'")
    _apply_mapping(cfg, mapping, "", f"preset '{name}' ({path})")


# ----------------------------------------------------------------------------------------------
# Public entry points


def load_config(
    preset: str | None = "grpo",
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Resolve a ``Config``: schema defaults, then ``preset``, then ``config_file``, then
    ``overrides`` (each ``a.b.c=value``), each later layer winning.

    A config file may name ``preset: NAME`` at its top level; that preset then replaces the
    ``preset`` argument (the file is the more specific choice), and is applied before the
    file's own keys. ``preset=None`` means the plain schema defaults.

    A run left unnamed (``trainer.experiment_name`` at the schema default) is named after the
    preset and the data (``default_experiment_name``): ``--preset dapo`` writes ``runs/dapo-...``.

    The result is type-checked but not semantically validated: call ``validate_config``.
    """
    if isinstance(overrides, str):
        # A bare string would be iterated character by character into nonsense overrides.
        raise TypeError("overrides must be a sequence of 'key=value' strings, not a single string")
    file_mapping: dict[str, Any] = {}
    if config_file is not None:
        file_mapping = dict(read_yaml_mapping(config_file))
        if PRESET_KEY in file_mapping:
            named = file_mapping.pop(PRESET_KEY)
            if named is not None and not isinstance(named, str):
                raise ConfigError(
                    f"config file '{config_file}': '{PRESET_KEY}' must be a preset name, got "
                    f"{_value_text(named)}; available presets: {', '.join(list_presets())}",
                    key=PRESET_KEY,
                )
            preset = named
        file_mapping = translate_mapping(file_mapping)
    cfg = Config()
    if preset is not None:
        _apply_preset(cfg, preset)
    if config_file is not None:
        _apply_mapping(cfg, file_mapping, "", f"config file '{config_file}'")
    for override in overrides:
        apply_override(cfg, override)
    if cfg.trainer.experiment_name == _UNNAMED_RUN:
        cfg.trainer.experiment_name = default_experiment_name(preset, cfg)
    return cfg


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

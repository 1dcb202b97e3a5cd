"""The schema as the loader reads it: its dotted keys, a suggestion for a mistyped one, and each value
checked against (and coerced to) its field's annotation, the error naming the key and the layer it came
from."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from hybridflow.config.errors import ConfigError
from hybridflow.config.schema import Config


PRESET_KEY = "preset"
"""Top-level key of a config file that names the preset to start from."""


_NUMBER_RE = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
"""A decimal float literal. YAML 1.1 (PyYAML) reads ``1e-5`` as a *string* because it lacks a
dot; we accept such strings for float fields, and nothing looser (no ``nan``, ``inf``, ``1,5``)."""


SUGGESTION_CUTOFF = 0.6
"""difflib similarity below which a guess is more confusing than helpful."""


_NAME_SIMILARITY = 0.8
"""difflib similarity a mistyped key name keeps with the name meant (``lrr``/``lr`` 0.8,
``rolout``/``rollout`` 0.92); unrelated names that share a word score lower (``return_raw_chat``/
``truncation`` 0.48)."""


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a schema dataclass.

    The schema uses ``from __future__ import annotations``, so ``dataclasses.fields`` only has
    strings like ``"int | None"``; ``get_type_hints`` evaluates them in the schema's module.
    """
    return typing.get_type_hints(cls)


def section_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {fld.name: fld for fld in dataclasses.fields(cls)}


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@functools.cache
def schema_paths() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """All dotted (leaf keys, section keys) of the schema, in declaration order."""
    leaves: list[str] = []
    sections: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = field_types(cls)
        for name in section_fields(cls):
            path = join_key(prefix, name)
            if is_section(hints[name]):
                sections.append(path)
                walk(hints[name], path)
            else:
                leaves.append(path)

    walk(Config, "")
    return tuple(leaves), tuple(sections)


def schema_keys() -> list[str]:
    """Every dotted leaf key of the schema (``data.train_batch_size``, ``actor.optim.lr``, ...)."""
    return list(schema_paths()[0])


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
    leaves, sections = schema_paths()
    all_paths = leaves + sections
    suffix = _first_leaf_suffix(value)
    attempted = join_key(prefix, name)
    nested = [path for path in leaves if path.startswith(f"{prefix}.") and path.rsplit(".", 1)[-1] == name]
    if prefix and nested:
        return max(nested, key=lambda p: difflib.SequenceMatcher(None, attempted, p).ratio())
    sibling = _closest_name(name, list(section_fields(section_cls)))
    if sibling:
        guess = join_key(prefix, sibling)
        return guess + suffix if guess + suffix in all_paths else guess
    same_name = [path for path in leaves if path.rsplit(".", 1)[-1] == name]
    if same_name:
        # Prefer the one that shares the most of the path the user wrote.
        return max(same_name, key=lambda p: difflib.SequenceMatcher(None, attempted, p).ratio())
    # The closest full path, among those whose last part is a typo of the last part written: paths
    # share so much (section names, _size, _per_gpu) that their similarity alone suggests unrelated
    # keys (data.return_raw_chat -> data.truncation).
    last = (join_key(prefix, name) + suffix).rsplit(".", 1)[-1]
    related = [path for path in all_paths if _similar_name(last, path.rsplit(".", 1)[-1])]
    close = difflib.get_close_matches(join_key(prefix, name) + suffix, related, n=1, cutoff=SUGGESTION_CUTOFF)
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


def unknown_key_error(section_cls: type, prefix: str, name: str, value: Any, source: str) -> ConfigError:
    path = join_key(prefix, name) + _first_leaf_suffix(value)
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
        hint = f"valid keys {where}: {', '.join(section_fields(section_cls))}"
    return ConfigError(f"unknown config key '{path}'; {hint} ({source})", key=path)


def type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def value_text(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def union_args(tp: Any) -> tuple[Any, ...] | None:
    """The members of ``X | Y`` (either spelling), or None if ``tp`` is not a union."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _type_error(key: str, value: Any, expected: Any, source: str, hint: str = "") -> ConfigError:
    extra = f"; {hint}" if hint else ""
    return ConfigError(
        f"config key '{key}' expects {type_name(expected)}, got {value_text(value)}{extra} ({source})",
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
    raise ConfigError(f"config key '{key}' has an unsupported schema type {type_name(tp)}", key=key)


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
    members = union_args(tp)
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
                raise ConfigError(f"config key '{key}' has an unsupported schema type {type_name(tp)}", key=key)
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
        close = difflib.get_close_matches(str(result), list(choices), n=1, cutoff=SUGGESTION_CUTOFF)
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

"""Setting values on a ``Config``: a nested mapping (a preset, a file, ``config_from_dict``) or one dotted
override (``key=value``, ``+key``, ``~key``, ``${...}`` interpolation), each value type-checked as it lands."""

from __future__ import annotations

import copy
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from hybridflow.config.aliases import translate_key
from hybridflow.config.coerce import (
    canonical_spelling,
    coerce_value,
    field_types,
    is_section,
    join_key,
    section_fields,
    type_name,
    union_args,
    unknown_key_error,
    value_text,
)
from hybridflow.config.errors import ConfigError
from hybridflow.config.overrides import DELETE, ParsedOverride, parse_override
from hybridflow.config.schema import Config
from hybridflow.config.yaml_io import StrictLoader, config_to_dict


def apply_mapping(target: Any, mapping: Mapping[Any, Any], prefix: str, source: str) -> None:
    """Set the keys of a (partial, nested) mapping on the section dataclass ``target``."""
    section_cls = type(target)
    fields = section_fields(section_cls)
    hints = field_types(section_cls)
    for name, value in mapping.items():
        if not isinstance(name, str):
            where = f"under '{prefix}'" if prefix else "at the top level"
            raise ConfigError(f"config keys must be strings, got {name!r} {where} ({source})", key=prefix or None)
        if name not in fields:
            raise unknown_key_error(section_cls, prefix, name, value, source)
        path = join_key(prefix, name)
        tp = hints[name]
        if is_section(tp):
            if value is None:  # "actor:" with every child commented out
                continue
            if not isinstance(value, Mapping):
                example = next(iter(section_fields(tp)))
                raise ConfigError(
                    f"config key '{path}' is a section and expects a mapping of its keys "
                    f"(e.g. {path}.{example}), got {value_text(value)} ({source})",
                    key=path,
                )
            apply_mapping(getattr(target, name), value, path, source)
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
        fields = section_fields(section_cls)
        if name not in fields:
            rest: Any = parsed.raw
            for later in reversed(parts[depth + 1 :]):
                rest = {later: rest}
            raise unknown_key_error(section_cls, prefix, name, rest, source)
        tp = field_types(section_cls)[name]
        path = join_key(prefix, name)
        last = depth == len(parts) - 1
        if is_section(tp):
            if not last:
                target = getattr(target, name)
                continue
            if parsed.kind == DELETE:
                setattr(target, name, tp())
                return key
            apply_mapping(target, {name: _override_value(cfg, parsed, key, tp, source)}, prefix, source)
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
                f"config key '{path}' is a {type_name(tp)} value, not a section, so '{key}' "
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
    scalar = [m for m in (union_args(tp) or (tp,)) if m is not type(None)]
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
        return yaml.load(raw, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
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


def config_from_dict(data: Mapping[str, Any], source: str = "the config mapping") -> Config:
    """A ``Config`` from a partial nested mapping over the schema defaults (type-checked).

    ``config_from_dict(config_to_dict(cfg)) == cfg`` for every valid ``cfg``.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source} must be a mapping of sections, got {value_text(data)}")
    cfg = Config()
    apply_mapping(cfg, data, "", source)
    return cfg

"""Config files in and out: a strict YAML reader (duplicate keys, YAML 1.1 booleans and ``1e-5`` are
what a user means, not what PyYAML reads) and the dump ``config explain`` and the run folder write."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from hybridflow.config.errors import ConfigError
from hybridflow.config.schema import Config


class StrictLoader(yaml.SafeLoader):
    """SafeLoader with three YAML 1.2 habits that PyYAML's YAML 1.1 lacks:

    - duplicate mapping keys are an error (PyYAML silently keeps the last one, which turns a
      copy-paste slip into a setting nobody meant);
    - only true/false are booleans (YAML 1.1 also reads yes/no/on/off, so ``data.shuffle=no``
      or a country code ``NO`` would change type behind the user's back);
    - ``1e-5`` is a float (YAML 1.1 needs a dot: ``1.0e-5``), the way everyone writes an lr.
    """


_BOOL_TAG = "tag:yaml.org,2002:bool"


StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


StrictLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _construct_mapping_no_duplicates(loader: StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
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


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping_no_duplicates)


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
            data = yaml.load(stream, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
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

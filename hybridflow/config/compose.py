"""``--config-path DIR --config-name NAME``: a Hydra-composed YAML config, as verl reads it.

verl's scripts point Hydra at a config folder: ``NAME.yaml`` with a defaults list (``- ppo_trainer``,
``- actor@actor_rollout_ref.actor: dp_actor``, ``- _self_``, ``override ...``), ``hydra.searchpath``
entries, ``${...}`` interpolations (relative, absolute, ``${oc.env:VAR,default}``,
``${oc.select:key,default}``). Hydra itself (hydra-core, what verl's users already run) composes it
here, so every rule of that grammar holds as they know it; the result is a list of dotted leaves,
each marked with who wrote it:

- leaves of files in a **verl config folder** (one holding ``ppo_trainer.yaml``, such as verl's own
  ``verl/trainer/config``) are verl's defaults. A default is applied where hybridflow has the key
  (through the alias table) and dropped otherwise: nobody chose it, and verl's tree has hundreds
  of keys for features hybridflow builds differently;
- leaves of any other file (the user's own ``NAME.yaml``, their group files) were chosen by
  someone, and are checked like command-line overrides: an unknown or refused key is an error.

The command line's value overrides are merged into the tree before interpolations resolve (so
``${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size}`` follows an override as in verl), and
are then applied once more by the loader, last, as the highest layer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.config.errors import ConfigError
from hybridflow.config.overrides import ADD, DELETE, FORCE_ADD, SET, ParsedOverride

VERL_MARKER = "ppo_trainer.yaml"
"""A config folder holding this file is verl's (``verl/trainer/config``): its values are verl's defaults."""

VERL_MAIN_DIR = Path("verl") / "trainer"
"""Where verl's ``main_ppo.py`` lives: Hydra reads a relative ``--config-path`` from there."""


@dataclass(frozen=True)
class Leaf:
    key: str  # dotted, verl's spelling or ours, as the file wrote it
    value: Any  # resolved; MISSING when the file left it '???'
    chosen: bool  # written by the user (checked strictly), not a verl default
    problem: str | None = None  # why it could not be resolved (an interpolation that fails)


MISSING = object()
"""A leaf that Hydra's '???' leaves for the command line to fill in."""


@dataclass(frozen=True)
class Composed:
    leaves: list[Leaf]
    source: str  # for messages: "config 'NAME' in DIR"
    uses_verl: bool  # the composition includes a verl config folder (verl's defaults apply)


def config_dir(path: str) -> Path:
    """``--config-path`` as a folder: absolute, or relative to the working directory, or, as Hydra
    reads it for verl's ``python3 -m verl.trainer.main_ppo``, relative to ``verl/trainer``."""
    given = Path(path).expanduser()
    candidates = [given] if given.is_absolute() else [Path.cwd() / given, Path.cwd() / VERL_MAIN_DIR / given]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate.resolve()
    tried = " or ".join(str(c) for c in candidates)
    raise ConfigError(f"--config-path {path!r} is not a folder (looked for {tried})", key="--config-path")


def compose(path: str, name: str, overrides: Sequence[ParsedOverride]) -> Composed:
    """Compose ``name`` from the folder ``path`` with Hydra, then resolve it leaf by leaf."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    folder = config_dir(path)
    name = name.removesuffix(".yaml")
    source = f"config '{name}' in {folder}"
    if not (folder / f"{name}.yaml").is_file():
        found = sorted(p.stem for p in folder.glob("*.yaml"))
        raise ConfigError(f"--config-name {name!r}: no {name}.yaml in {folder} (there: {', '.join(found) or 'none'})",
                          key="--config-name")
    group_choices = [o.text.strip() for o in overrides if o.is_group_choice]
    hydra_overrides = group_choices + _search_path_override(folder / f"{name}.yaml")
    try:
        with initialize_config_dir(config_dir=str(folder), version_base=None):
            tree = hydra_compose(config_name=name, overrides=hydra_overrides)
            sources = _file_sources(name, hydra_overrides)
            chosen = _chosen_keys(name, hydra_overrides, sources)
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(f"{source}: {' '.join(str(error).split())}", key="--config-name") from error
    _merge_overrides(tree, [o for o in overrides if not o.is_group_choice])
    written = {o.key for o in overrides if not o.is_group_choice}
    leaves = [leaf for leaf in _leaves(tree, "", chosen) if not _under(leaf.key, written)]
    uses_verl = any((Path(s) / VERL_MARKER).is_file() for s in sources)
    return Composed(leaves, source, uses_verl)


def _search_path_override(primary: Path) -> list[str]:
    """``hydra.searchpath`` of the primary file with its relative ``file://`` entries made absolute.

    verl's example configs say ``file://verl/trainer/config``, relative to the working directory
    (verl's checkout, where its scripts run). Run from elsewhere, the entry is looked up from the
    config folder's parents too, so a config inside a verl checkout finds verl's folder wherever
    the command runs."""
    import yaml

    try:
        data = yaml.safe_load(primary.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return []  # Hydra reports it
    entries = ((data.get("hydra") or {}).get("searchpath") or []) if isinstance(data, dict) else []
    if not entries or not all(isinstance(e, str) for e in entries):
        return []
    resolved = []
    for entry in entries:
        if entry.startswith("file://") and not Path(entry[len("file://"):]).is_absolute():
            relative = entry[len("file://"):]
            bases = [Path.cwd(), *primary.parent.parents]
            found = next((base / relative for base in bases if (base / relative).is_dir()), None)
            entry = f"file://{found}" if found is not None else entry
        resolved.append(entry)
    return [f"hydra.searchpath=[{','.join(resolved)}]"]


def _file_sources(name: str, hydra_overrides: list[str]) -> list[str]:
    """The folders Hydra searches, in its order (the config folder, then hydra.searchpath)."""
    from hydra import compose as hydra_compose

    cfg = hydra_compose(config_name=name, overrides=hydra_overrides, return_hydra_config=True)
    return [s["path"] for s in cfg.hydra.runtime.config_sources if s["schema"] == "file"]


def _chosen_keys(name: str, hydra_overrides: list[str], sources: list[str]) -> set[str]:
    """Dotted leaves written by files outside verl's config folders (the user's own files)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    from omegaconf import DictConfig, OmegaConf

    defaults = GlobalHydra.instance().config_loader().compute_defaults_list(name, hydra_overrides, RunMode.RUN)
    chosen: set[str] = set()
    for default in defaults.defaults:
        if default.config_path is None or default.package is None or default.package.startswith("hydra"):
            continue
        relative = os.path.normpath(default.config_path) + ".yaml"
        folder = next((s for s in sources if (Path(s) / relative).is_file()), None)
        if folder is None or (Path(folder) / VERL_MARKER).is_file():
            continue
        content = OmegaConf.load(Path(folder) / relative)
        if not isinstance(content, DictConfig):
            continue
        for key in ("defaults", "hydra"):
            content.pop(key, None)
        chosen |= {leaf.key for leaf in _leaves(content, default.package, set(), resolve=False)}
    return chosen


def _merge_overrides(tree: Any, overrides: list[ParsedOverride]) -> None:
    """The command line's values into the tree, so interpolations read them as verl's would."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    OmegaConf.set_struct(tree, False)
    for override in overrides:
        if override.problem is not None:
            continue  # the loader reports it on the key
        try:
            if override.kind in (SET, ADD, FORCE_ADD):
                OmegaConf.update(tree, override.key, override.value, merge=True, force_add=True)
            elif override.kind == DELETE:
                parent, _, last = override.key.rpartition(".")
                node = OmegaConf.select(tree, parent) if parent else tree
                if node is not None and last in node:
                    del node[last]
        except OmegaConfBaseException:
            continue  # a path through a value: the loader names the key


def _under(key: str, prefixes: set[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _leaves(node: Any, prefix: str, chosen: set[str], resolve: bool = True) -> list[Leaf]:
    """Every leaf of a DictConfig below ``prefix``, resolved one by one (a failing interpolation
    is that leaf's problem, not the whole file's)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    out: list[Leaf] = []
    for name in node.keys():
        key = f"{prefix}.{name}" if prefix else str(name)
        plain = not OmegaConf.is_interpolation(node, name) and not OmegaConf.is_missing(node, name)
        if plain and isinstance(node[name], DictConfig) and len(node[name]):
            out += _leaves(node[name], key, chosen, resolve)
            continue
        if not resolve:
            out.append(Leaf(key, None, True))
            continue
        try:
            value = node[name]
            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=True)
            out.append(Leaf(key, value, key in chosen))
        except MissingMandatoryValue:
            out.append(Leaf(key, MISSING, key in chosen))
        except OmegaConfBaseException as error:
            message = " ".join(str(error).split("\n")[0].split())
            out.append(Leaf(key, MISSING, key in chosen, problem=f"cannot be resolved: {message}"))
    return out

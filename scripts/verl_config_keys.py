"""verl's config keys as test data, and the docs table of what hybridflow makes of each.

Reads verl's fully resolved trainer configs (verl/trainer/config/_generated_ppo_trainer.yaml and
_generated_ppo_megatron_trainer.yaml, plus the legacy data config) and the override keys its
example scripts set, and writes one row per leaf dotted key: the key, verl's default (JSON, with
verl's ``${...}`` interpolations resolved the way OmegaConf would), where it comes from, and the
interpolation when the default is one. tests/unit/config/test_config_verl_keys.py walks that file,
so a later verl is re-read with one command::

    python scripts/verl_config_keys.py --verl ~/src/verl                 # a verl work tree
    python scripts/verl_config_keys.py --verl-git /path/to/verl.git --rev v0.8.0

and the table in docs follows the code with::

    python scripts/verl_config_keys.py --table docs/verl_keys.md

Hydra's ``_target_`` entries are left out: they name the Python class verl instantiates a
section with, not a setting (hybridflow.config.verl_keys refuses them with that reason).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
KEYS_TSV = ROOT / "tests" / "data" / "verl_config_keys.tsv"

CONFIGS = (
    ("verl/trainer/config/_generated_ppo_trainer.yaml", "fsdp"),
    ("verl/trainer/config/_generated_ppo_megatron_trainer.yaml", "megatron"),
)
LEGACY_DATA = "verl/trainer/config/data/legacy_data.yaml"
EXAMPLES_DIR = "examples"

# The top-level sections of verl's PPO trainer config: an example's override of a key under one of
# these is a key of verl's tree even when the generated file lacks it (reward_model.reward_kwargs.*).
TOP_LEVEL = (
    "actor_rollout_ref", "data", "critic", "reward_model", "reward_manager", "algorithm", "trainer",
    "custom_reward_function", "global_profiler", "ray_kwargs", "transfer_queue",
)
_OVERRIDE_RE = re.compile(r"(?:^|[\s'\"])[+~]{0,2}((?:%s)(?:\.[A-Za-z0-9_]+)+)=" % "|".join(TOP_LEVEL))
_INTERP_RE = re.compile(r"\$\{([^{}]*)\}")
_MISSING = object()


# ----------------------------------------------------------------------------------------------
# Reading verl


def reader(verl: Path | None, git_dir: Path | None, rev: str) -> Callable[[str], str | None]:
    """A function from a path inside verl to its text (None when absent)."""
    if verl is not None:
        def read(path: str) -> str | None:
            file = verl / path
            return file.read_text(encoding="utf-8") if file.is_file() else None
        return read

    def read_git(path: str) -> str | None:
        proc = subprocess.run(["git", "-C", str(git_dir), "show", f"{rev}:{path}"], capture_output=True, text=True)
        return proc.stdout if proc.returncode == 0 else None
    return read_git


def list_examples(verl: Path | None, git_dir: Path | None, rev: str) -> list[str]:
    if verl is not None:
        return sorted(str(p.relative_to(verl)) for p in (verl / EXAMPLES_DIR).rglob("*.sh"))
    out = subprocess.run(["git", "-C", str(git_dir), "ls-tree", "-r", "--name-only", rev, EXAMPLES_DIR],
                         capture_output=True, text=True, check=True).stdout
    return sorted(p for p in out.splitlines() if p.endswith(".sh"))


def revision(verl: Path | None, git_dir: Path | None, rev: str) -> str:
    where = ["-C", str(verl)] if verl is not None else ["-C", str(git_dir)]
    proc = subprocess.run(["git", *where, "rev-parse", rev if verl is None else "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


# ----------------------------------------------------------------------------------------------
# Interpolation: the subset of OmegaConf's that verl's generated configs use


def _lookup(tree: Any, path: list[str]) -> Any:
    node = tree
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _resolve(tree: dict[str, Any], where: list[str], text: str, depth: int = 0) -> Any:
    """``${a.b}``, ``${.sibling}``, ``${oc.select:a.b,default}`` inside the node at ``where``."""
    if depth > 20:
        raise ValueError(f"interpolation loop at {'.'.join(where)}: {text}")
    match = _INTERP_RE.fullmatch(text.strip())
    if match is None:
        return text
    body = match.group(1).strip()
    default: Any = _MISSING
    if body.startswith("oc.select:"):
        target, _, fallback = body[len("oc.select:"):].partition(",")
        default = yaml.safe_load(fallback.strip()) if fallback.strip() else None
    else:
        target = body
    target = target.strip()
    if target.startswith("."):
        dots = len(target) - len(target.lstrip("."))
        base = where[: len(where) - (dots - 1)]  # one dot: the containing node, two: its parent
        path = base + target.lstrip(".").split(".")
    else:
        path = target.split(".")
    value = _lookup(tree, path)
    if value is _MISSING:
        if default is _MISSING:
            raise ValueError(f"{'.'.join(where)}: {text} names a missing key")
        return default
    if isinstance(value, str) and _INTERP_RE.fullmatch(value.strip()):
        return _resolve(tree, path[:-1], value, depth + 1)
    return value


def leaves(tree: dict[str, Any]) -> Iterator[tuple[str, Any, str]]:
    """(dotted key, resolved default, the interpolation or '') for every leaf; an empty mapping is a
    leaf (its default is {}), and so is a list."""
    def walk(node: dict[str, Any], where: list[str]) -> Iterator[tuple[str, Any, str]]:
        for name, value in node.items():
            if name == "_target_":
                continue
            path = [*where, str(name)]
            if isinstance(value, dict) and value:
                yield from walk(value, path)
                continue
            expr = ""
            if isinstance(value, str) and _INTERP_RE.fullmatch(value.strip()):
                expr = value.strip()
                value = _resolve(tree, where, value)
            yield ".".join(path), value, expr
    yield from walk(tree, [])


def example_keys(read: Callable[[str], str | None], scripts: list[str]) -> set[str]:
    """Keys the PPO trainer's example scripts set (verl's SFT and generation scripts use other
    trainers, whose data.* keys mean other things, and are left out)."""
    keys: set[str] = set()
    for path in scripts:
        text = read(path) or ""
        if "main_ppo" in text:
            keys.update(_OVERRIDE_RE.findall(text))
    return keys


def collect(read: Callable[[str], str | None], scripts: list[str]) -> list[tuple[str, str, str, str]]:
    """Rows (key, default JSON, source, interpolation), sorted by key. A key with one default in
    both trainer configs is one row with source ``fsdp,megatron``."""
    per_key: dict[str, dict[str, tuple[str, str]]] = {}
    for path, source in CONFIGS:
        text = read(path)
        if text is None:
            raise SystemExit(f"verl checkout has no {path}")
        for key, value, expr in leaves(yaml.safe_load(text)):
            per_key.setdefault(key, {})[source] = (json.dumps(value, sort_keys=True), expr)
    legacy = read(LEGACY_DATA)
    if legacy is not None:
        tree = {"data": yaml.safe_load(legacy)}
        for key, value, expr in leaves(tree):
            if key not in per_key:
                per_key.setdefault(key, {})["legacy_data"] = (json.dumps(value, sort_keys=True), expr)
    for key in example_keys(read, scripts):
        # A key already in the tree, or a whole section set at once, adds nothing; a key below a
        # mapping-valued leaf (engine_kwargs.vllm.<name>) is a key users type, so it is kept.
        if not any(key == k or k.startswith(key + ".") for k in per_key):
            per_key[key] = {"examples": ("", "")}
    rows: list[tuple[str, str, str, str]] = []
    for key in sorted(per_key):
        by_value: dict[tuple[str, str], list[str]] = {}
        for source, value in per_key[key].items():
            by_value.setdefault(value, []).append(source)
        for (default, expr), sources in by_value.items():
            rows.append((key, default, ",".join(sources), expr))
    return rows


# ----------------------------------------------------------------------------------------------
# The data file


def write_tsv(rows: list[tuple[str, str, str, str]], path: Path, rev: str) -> None:
    lines = [f"# verl {rev}: python scripts/verl_config_keys.py regenerates this file",
             "key\tdefault\tsource\tinterpolation"]
    lines += ["\t".join(row) for row in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_tsv(path: Path = KEYS_TSV) -> list[tuple[str, str, str, str]]:
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#") or line.startswith("key\t") or not line:
            continue
        key, default, source, expr = line.split("\t")
        rows.append((key, default, source, expr))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl", type=Path, help="a verl work tree")
    parser.add_argument("--verl-git", type=Path, help="a verl git directory (no work tree needed)")
    parser.add_argument("--rev", default="HEAD", help="with --verl-git: the commit to read")
    parser.add_argument("--out", type=Path, default=KEYS_TSV, help="the data file to write")
    parser.add_argument("--table", type=Path, help="write the docs table (from the data file) here instead")
    args = parser.parse_args(argv)
    if args.table is not None:
        sys.path.insert(0, str(ROOT))
        from hybridflow.config.verl_table import verl_keys_markdown

        args.table.write_text(verl_keys_markdown(read_tsv(args.out)), encoding="utf-8")
        print(f"wrote {args.table}")
        return 0
    if (args.verl is None) == (args.verl_git is None):
        parser.error("give one of --verl or --verl-git")
    read = reader(args.verl, args.verl_git, args.rev)
    rows = collect(read, list_examples(args.verl, args.verl_git, args.rev))
    write_tsv(rows, args.out, revision(args.verl, args.verl_git, args.rev))
    print(f"wrote {len(rows)} rows ({len({r[0] for r in rows})} keys) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

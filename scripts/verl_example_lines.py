"""Write five of verl's example training command lines, expanded as bash expands them, into
tests/data/verl_example_lines.json, with their paths as placeholders, for the test that trains
them (tests/e2e/test_e2e_verl_examples.py). The test runs without verl; this reads it once.

    python scripts/verl_example_lines.py                     # verl's mirror (git objects), HEAD
    python scripts/verl_example_lines.py --verl ~/src/verl   # a verl work tree

Placeholders: ``{model}`` (every model and tokenizer path), ``{data}`` (train and validation
files), ``{tool_config}`` (the multi-turn tool file), ``{checkpoints}`` (trainer.default_local_dir).
A line that names a config file (``--config-path``/``--config-name``) gets that file's own settings
as overrides in its place (its ``defaults:`` are verl's trainer config, which a verl checkout has
and the test does not), noted in the line's ``notes``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verl_examples as ve  # noqa: E402  (a sibling script)

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "verl_example_lines.json"

EXAMPLES = {
    "ppo": "examples/ppo_trainer/run_deepseek7b_llm.sh",
    "grpo": "examples/grpo_trainer/run_qwen2-7b.sh",
    "rloo": "examples/rloo_trainer/run_qwen2-7b.sh",
    # verl's DAPO recipe lives in a submodule; this example is DAPO's reward manager and overlong
    # buffer with the GMPO (geo_mean) loss, through main_ppo.
    "dapo": "examples/gmpo_trainer/test_dapo_7b_math.sh",
    "multi_turn_tool": "examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh",
}

PLACEHOLDERS = [
    (re.compile(r"^(\+*)([\w.]*model\.(path|tokenizer_path))$"), "{model}"),
    (re.compile(r"^(\+*)(data\.(train_files|val_files))$"), "{data}"),
    (re.compile(r"^(\+*)([\w.]*multi_turn\.tool_config_path)$"), "{tool_config}"),
    (re.compile(r"^(\+*)(trainer\.default_local_dir)$"), "{checkpoints}"),
]


def flatten(mapping: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in mapping.items():
        if key in ("defaults", "hydra") and not prefix:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += flatten(value, f"{name}.")
        else:
            out.append(f"{name}={json.dumps(value) if isinstance(value, (list, bool)) else value}")
    return out


def placeholder(arg: str) -> str:
    key, sep, _ = arg.partition("=")
    for pattern, value in PLACEHOLDERS:
        if sep and pattern.match(key):
            return f"{key}={value}"
    return arg


def line_for(args: list[str], root: Path) -> tuple[list[str], list[str]]:
    notes, out, config_path = [], [], None
    for arg in args:
        if arg.startswith("--config-path"):
            config_path = Path(arg.split("=", 1)[1])
        elif arg.startswith("--config-name"):
            name = arg.split("=", 1)[1]
            file = config_path / f"{name}.yaml"
            settings = flatten(yaml.safe_load(file.read_text()))
            notes.append(f"--config-name={name}: its own settings in its place ({', '.join(settings)})")
            out += settings
        else:
            out.append(placeholder(arg))
    return out, notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl", default=None, help="a verl work tree or git directory (default: the mirror)")
    parser.add_argument("--rev", default="HEAD")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="verl-lines-"))
    root = ve.checkout(args.verl, args.rev, scratch)
    bin_dir = ve.stub_bin(scratch)
    home = scratch / "home"
    home.mkdir()
    lines = {}
    for name, rel in EXAMPLES.items():
        trainer = ve.trainer_args(ve.expand(root / rel, root, bin_dir, home))
        if trainer is None:
            raise SystemExit(f"{rel}: the script never launched verl's trainer")
        overrides, notes = line_for(trainer, root)
        lines[name] = {"script": rel, "overrides": overrides, "notes": notes}
    OUT.write_text(json.dumps(lines, indent=1) + "\n")
    counts = ", ".join(f"{name}: {len(line['overrides'])}" for name, line in lines.items())
    print(f"wrote {OUT} ({counts} overrides)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

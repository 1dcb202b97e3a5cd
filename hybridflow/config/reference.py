"""The configuration reference (docs/config.md), generated from the schema.

Generated, not written, so the documentation cannot drift from the code: a unit test compares
docs/config.md with ``config_reference_markdown()``. Regenerate with::

    python -m hybridflow.config.reference docs/config.md
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from hybridflow.config.loader import list_presets
from hybridflow.config.schema import Config

_HEADER = """\
# Configuration reference

<!-- Generated from hybridflow/config/schema.py by
     `python -m hybridflow.config.reference docs/config.md`; do not edit by hand.
     tests/unit/config/test_config_reference.py fails when this file is out of date. -->

A run's configuration is resolved in layers, each later one winning:

1. the defaults below (the built-in tiny model on the built-in arithmetic task, on CPU);
2. a preset, `--preset NAME` (default: `grpo`'s settings): {presets};
3. a Hydra-composed YAML config, `--config-path DIR --config-name NAME`, as verl's scripts give it
   (a defaults list with `_self_` and `group@package: option`, `hydra.searchpath`, `${{...}}`
   interpolation with `oc.env` and `oc.select`); pointed at verl's own `verl/trainer/config`,
   verl's defaults apply wherever hybridflow has the key, and keys it does not have are dropped,
   while a file of your own is checked key by key;
4. a YAML file, `--config my.yaml`, with the same nested sections as below; a top-level
   `preset: NAME` line in it picks the preset;
5. overrides on the command line in Hydra's grammar, `section.key=value`, e.g.
   `actor.optim.lr=1e-5`, `trainer.logger=[console,wandb]`, `trainer.total_training_steps=null`,
   `+key=value` and `++key=value` (the same as `key=value`: every key must still be known),
   `~key` (back to the default), quoted text `'a,b'`.

verl's spellings (`actor_rollout_ref.actor.*`, ...) are translated (docs/verl_keys.md); a
command line in verl's keys gets verl's defaults where they differ in meaning: no
`algorithm.adv_estimator` means verl's `gae` (PPO with a critic), and more than one GPU or node
(`trainer.n_gpus_per_node`, `trainer.nnodes`) means `trainer.backend=ray` unless the backend is set.

Unknown keys, wrong types and values outside a key's allowed set are errors that name the
dotted key; `hybridflow config explain [overrides]` prints the resolved config and the batch
plan it implies, or every error at once (exit 2). What this machine lacks for a valid config (no
GPU, fewer GPUs than asked, vLLM/SGLang/ray not installed) is listed as `cannot run here: ...`
and explain still exits 0, so a cluster's config can be checked on a laptop; `hybridflow train`
refuses both kinds.

Batch-size units: `data.train_batch_size` and `actor.ppo_mini_batch_size` count *prompts*
(each prompt yields `rollout.n` samples); `*_micro_batch_size_per_gpu` counts *samples* on one
data-parallel rank.
"""


def _cell(text: str) -> str:
    """Table-cell text: a ``|`` would end the cell, a newline the row."""
    return text.replace("|", "\\|").replace("\n", " ")


def _format_default(value: Any) -> str:
    """A default as the user would write it in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_format_default(v) for v in value) + "]"
    if value == "":
        return '""'
    return str(value)


def _section_markdown(title: str, help_text: str, section: Any, out: list[tuple[str, str, Any]]) -> str:
    """One section's table; nested sections are queued on ``out`` (title, help, value) to follow it."""
    lines = [f"## `{title}`", "", help_text, "", "| key | type | default | description |", "|---|---|---|---|"]
    for fld in dataclasses.fields(section):
        value = getattr(section, fld.name)
        help_cell = _cell(str(fld.metadata.get("help", "")))
        if dataclasses.is_dataclass(value):
            child = f"{title}.{fld.name}"
            anchor = child.replace(".", "")  # GitHub drops the dots of a heading in its anchor
            lines.append(f"| `{fld.name}` | section | | {help_cell} See [{child}](#{anchor}). |")
            out.append((child, str(fld.metadata.get("help", "")), value))
            continue
        choices = fld.metadata.get("choices")
        if choices:
            help_cell += " Allowed: " + ", ".join(f"`{c}`" for c in choices) + "."
        type_cell = _cell(str(fld.type))
        lines.append(f"| `{fld.name}` | `{type_cell}` | `{_cell(_format_default(value))}` | {help_cell} |")
    return "\n".join(lines)


def config_reference_markdown() -> str:
    """docs/config.md: an intro, then one table per section (key, type, default, description)."""
    presets = ", ".join(f"`{name}`" for name in list_presets())
    blocks = [_HEADER.format(presets=presets).rstrip()]
    defaults = Config()
    for top in dataclasses.fields(defaults):
        queue = [(top.name, str(top.metadata.get("help", "")), getattr(defaults, top.name))]
        while queue:  # breadth-first: a section, then its subsections
            title, help_text, section = queue.pop(0)
            blocks.append(_section_markdown(title, help_text, section, queue))
    return "\n\n".join(blocks) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the reference to the file named on the command line, or print it."""
    args = sys.argv[1:] if argv is None else argv
    text = config_reference_markdown()
    if not args:
        sys.stdout.write(text)
    else:
        Path(args[0]).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""docs/config.md is generated from the schema and must stay in sync with it."""

from __future__ import annotations

from pathlib import Path

from hybridflow.config import config_reference_markdown, schema_keys
from hybridflow.config.reference import main

DOCS = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def test_docs_config_md_is_up_to_date() -> None:
    assert DOCS.read_text(encoding="utf-8") == config_reference_markdown(), (
        "docs/config.md is out of date with hybridflow/config/schema.py; regenerate it with "
        "`python -m hybridflow.config.reference docs/config.md`"
    )


def test_every_key_has_a_row_in_its_section() -> None:
    text = config_reference_markdown()
    for key in schema_keys():
        section, _, name = key.rpartition(".")
        block = text.split(f"## `{section}`\n", 1)[1].split("\n## ", 1)[0]
        assert f"| `{name}` |" in block, f"{key} missing from the table of section {section}"


def test_rows_show_type_default_and_escaped_help() -> None:
    text = config_reference_markdown()
    assert "| `seed` | `int \\| None` | `null` | Sampler seed. None: trainer.seed. |" in text
    assert "| `betas` | `list[float]` | `[0.9, 0.999]` | AdamW betas. |" in text
    assert "error \\| left \\| right. Allowed: `error`, `left`, `right`." in text
    for line in text.splitlines():
        if line.startswith("| `"):
            assert line.replace("\\|", "").count("|") == 5, f"a stray '|' splits this row: {line}"


def test_nested_sections_are_linked() -> None:
    text = config_reference_markdown()
    assert "See [actor.optim](#actoroptim)." in text
    assert "## `actor.optim`" in text


def test_main_writes_the_file(tmp_path: Path) -> None:
    target = tmp_path / "config.md"
    assert main([str(target)]) == 0
    assert target.read_text(encoding="utf-8") == config_reference_markdown()

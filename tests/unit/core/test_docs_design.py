"""docs/design.md stays true to the code, and the README links nothing outside the repository.

The design notes used to live outside the repository (``../shared/DESIGN.md``), where a new user
could not follow the README's link (issue 22). Now every ``hybridflow/...`` path and every dotted
``hybridflow.x.y`` name in docs/design.md must exist, and its layer table must be the one
``test_layering.py`` enforces.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
DESIGN = ROOT / "docs" / "design.md"
README = ROOT / "README.md"

PATH = re.compile(r"(?<![\w./-])hybridflow/[\w./*-]*[\w/*]")
DOTTED = re.compile(r"(?<![\w./-])hybridflow(?:\.\w+)+")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BLOCK = re.compile(r"^```\w*\n(.*?)^```", re.S | re.M)
LAYER_ROW = re.compile(r"^  (\w+)(?:/|\.py)\s+L(\d)\s")
PAIR = re.compile(r"`(\w+) -> (\w+)`")


def load_layering() -> ModuleType:
    spec = importlib.util.spec_from_file_location("layering_rules", Path(__file__).with_name("test_layering.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def design_text() -> str:
    return DESIGN.read_text(encoding="utf-8")


def test_every_path_named_in_the_design_exists():
    paths = set(PATH.findall(design_text()))
    assert len(paths) > 20, paths  # the pattern still finds the paths
    missing = [p for p in sorted(paths) if not (list(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
    assert not missing, f"docs/design.md names paths that do not exist: {missing}"


def resolves(dotted: str) -> bool:
    """``hybridflow.a.b[.attr...]``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:
            continue
        obj: object = importlib.import_module(name)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_name_in_the_design_exists():
    names = set(DOTTED.findall(design_text()))
    assert names, "the design names no hybridflow.x.y module"
    missing = [name for name in sorted(names) if not resolves(name)]
    assert not missing, f"docs/design.md names modules that do not exist: {missing}"


def test_the_layout_lists_every_package_and_module_of_hybridflow():
    """The layout block's ``hybridflow/`` tree: each entry exists, and each top-level package and
    module of hybridflow is in it."""
    (layout,) = [b for b in BLOCK.findall(design_text()) if b.startswith("hybridflow/\n")]
    listed = {m.group(1) for line in layout.splitlines() if (m := LAYER_ROW.match(line))}
    package = ROOT / "hybridflow"
    actual = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    actual |= {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert listed == actual


def test_the_layer_table_is_the_one_the_layering_test_enforces():
    layering = load_layering()
    text = design_text()
    (layout,) = [b for b in BLOCK.findall(text) if b.startswith("hybridflow/\n")]
    layers = {m.group(1): int(m.group(2)) for line in layout.splitlines() if (m := LAYER_ROW.match(line))}
    assert layers == layering.LAYER
    allowed = next(line for line in text.split("\n\n") if line.startswith("Allowed within a layer:"))
    assert set(PAIR.findall(allowed)) == layering.ALLOWED_SAME_LAYER
    never = next(line for line in text.split("\n\n") if line.startswith("Never, whatever the layers:"))
    assert set(PAIR.findall(never)) == layering.FORBIDDEN


DOCS = ["README.md", "docs/guide.md", "docs/status.md", "docs/design.md", "docs/algorithms.md", "docs/serving.md",
        "docs/figures.md"]


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces
    as hyphens (headings inside code blocks are not headings)."""
    anchors, in_code = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve_inside_the_repository(doc):
    """Every relative link reaches a file of the repository, and its ``#anchor`` a heading there
    (the README's sections moved to docs/guide.md: a stale anchor would land a reader at the top)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    outside = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL (https:, mailto:)
        file, _, anchor = target.partition("#")
        path = (ROOT / doc).parent / file if file else ROOT / doc
        if not path.resolve().is_relative_to(ROOT) or not path.exists():
            outside.append(target)
        elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
            outside.append(target)
    # Paths written as code are links to a reader too: none may climb out of the repository.
    outside += [m for m in re.findall(r"`([^`\s]*\.\./[^`\s]*)`", text)]
    assert not outside, f"{doc} points at files outside the repository or missing: {outside}"


def test_the_readme_points_at_the_design_notes():
    assert "(docs/design.md)" in README.read_text(encoding="utf-8")


def test_the_readme_shows_laptops_the_cpu_only_torch_build():
    """A plain ``pip install torch`` on Linux brings ~2.2 GB of CUDA wheels (issue 22): the
    README gives the CPU build's command, pinned to the same torch as its set-up commands."""
    text = README.read_text(encoding="utf-8")
    bash = "\n".join(b for b in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M))
    installs = [line for line in bash.splitlines() if "pip install" in line and "torch" in line]
    cpu = [line for line in installs if "--index-url https://download.pytorch.org/whl/cpu" in line]
    assert cpu, installs
    assert len({re.search(r"torch==([\w.]+)", line).group(1) for line in installs}) == 1, installs

"""DESIGN.md rule 1: imports only go down the layers. Parsed from source, so it cannot rot."""

import ast
from pathlib import Path

import hybridflow

LAYER = {
    "types": 0, "utils": 0,
    "config": 1, "tracking": 1,
    "algorithms": 2, "rewards": 2, "data": 2, "models": 2,
    "rollout": 3, "agents": 3, "training": 3,
    "workers": 4, "cluster": 4,
    "controller": 5, "api": 6, "cli": 7,
}
# Same-layer imports that are part of the design: the engine computes logprobs with the
# algorithm library's chunked kernels; data and models are siblings with no cycle.
ALLOWED_SAME_LAYER = {("models", "algorithms"), ("rollout", "models"), ("training", "models")}
FORBIDDEN = {("training", "rollout"), ("training", "agents"), ("agents", "training")}


def area(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "hybridflow" or len(parts) < 2:
        return None
    return parts[1]


def test_imports_only_go_down():
    root = Path(hybridflow.__file__).parent
    problems = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        src_area = area(".".join(rel.parts))
        if src_area is None or src_area not in LAYER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                dst = area(name)
                if dst is None or dst == src_area or dst not in LAYER:
                    continue
                pair = (src_area, dst)
                if pair in FORBIDDEN or (LAYER[dst] > LAYER[src_area]) or (
                    LAYER[dst] == LAYER[src_area] and pair not in ALLOWED_SAME_LAYER
                ):
                    problems.append(f"{rel}: {src_area} (L{LAYER[src_area]}) imports {name} (L{LAYER[dst]})")
    assert not problems, "\n".join(problems)

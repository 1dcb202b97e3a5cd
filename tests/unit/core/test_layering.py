"""DESIGN.md rule 1: imports only go down the layers. Parsed from source, so it cannot rot."""

import ast
from pathlib import Path

import hybridflow

LAYER = {
    "types": 0, "utils": 0,
    "config": 1, "tracking": 1,
    "algorithms": 2, "rewards": 2, "data": 2, "models": 2, "transfer": 2,
    "inference": 3, "rollout": 3, "agents": 3, "training": 3,
    "workers": 4, "cluster": 4, "serving": 4,
    "controller": 5, "api": 6, "cli": 7, "launch": 8,
}
# Same-layer imports that are part of the design: the engine computes logprobs with the
# algorithm library's chunked kernels; data and models are siblings with no cycle; the rollout
# factory builds the native runtime's engine and the adapters share its sampling helpers (the
# runtime never imports rollout/); the rollout worker serves its engine over HTTP.
ALLOWED_SAME_LAYER = {("models", "algorithms"), ("rollout", "models"), ("training", "models"),
                      ("rollout", "inference"), ("workers", "serving")}
FORBIDDEN = {("training", "rollout"), ("training", "agents"), ("agents", "training"), ("inference", "rollout")}


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


# ------------------------------------------------------------------ no import cycles, inside a package too
# The layer rule only sees imports between packages; two modules of one package that import each
# other (even lazily, inside a function, or for type checking) are one design in two files. Every
# import statement counts, wherever it sits.


def module_imports() -> dict[str, set[str]]:
    """Each hybridflow module -> the hybridflow modules it imports (``from a.b import c`` counts
    as ``a.b.c`` when that is a module, else ``a.b``)."""
    root = Path(hybridflow.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted.
    A package's ``__init__`` that re-exports its modules is left out: importing a package runs its
    ``__init__`` first, but a module importing ``hybridflow.x.y`` does not depend on ``hybridflow.x``'s
    other modules."""
    graph = {m: {t for t in ts if not _is_package_init(t, m)} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _is_package_init(target: str, importer: str) -> bool:
    return importer.startswith(target + ".")


# Cycles allowed for now (none since issue 34 took apart the three found when this check was
# written); the list may only shrink: a new cycle fails, and so does a listed one once it is gone.
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycles():
    cycles = import_cycles(module_imports())
    assert cycles == KNOWN_CYCLES, "import cycles (each a group of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle_inside_a_package():
    graph = {"hybridflow.a.x": {"hybridflow.a.y"}, "hybridflow.a.y": {"hybridflow.a.x"}, "hybridflow.b": set()}
    assert import_cycles(graph) == [["hybridflow.a.x", "hybridflow.a.y"]]


# ------------------------------------------------------------------ the controller orders, never computes
# docs/design.md, rule 2. The controller may build tensors from Python values and glue gathered
# shards; arithmetic on tensors lives in algorithms/ (pure, tested with hand-worked numbers) or
# in the workers. These torch calls are allowed in hybridflow/controller/, each for one reason:
CONTROLLER_TORCH_CALLS = {
    "cat": "glue the shards a worker group's ranks return into one batch tensor",
    "tensor": "build a record's tensor from Python values (greedy scores, reward components, lengths)",
    "full_like": "fault injection for tests (the nan_advantages fault)",
    "get_num_threads": "report a setting as a metric; no math",
}
# Tensor methods that are arithmetic; calling one on anything in the controller is refused. (Not
# ``log``: the tracker's method has that name.)
TENSOR_MATH_METHODS = {
    "sum", "mean", "std", "var", "exp", "sqrt", "abs", "clamp", "clamp_", "cumsum", "softmax",
    "log_softmax", "where", "masked_fill", "index_add_", "scatter_", "scatter_add_", "scatter_reduce",
    "add_", "sub_", "mul_", "div_", "pow",
}


def controller_sources():
    root = Path(hybridflow.__file__).parent / "controller"
    return [(path.relative_to(root.parent.parent), ast.parse(path.read_text())) for path in sorted(root.rglob("*.py"))]


def test_the_controller_does_no_tensor_math():
    problems = []
    for rel, tree in controller_sources():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner, name = node.func.value, node.func.attr
            if isinstance(owner, ast.Name) and owner.id == "torch" and name not in CONTROLLER_TORCH_CALLS:
                problems.append(f"{rel}:{node.lineno}: torch.{name}(...) is tensor math; move it into algorithms/")
            elif name in TENSOR_MATH_METHODS:
                problems.append(f"{rel}:{node.lineno}: .{name}(...) is tensor math; move it into algorithms/")
    assert not problems, "\n".join(problems)


def algorithm_names() -> set[str]:
    from hybridflow.algorithms import ADV_ESTIMATORS, OPTIONAL_ESTIMATOR_INPUTS, POLICY_LOSSES

    return set(ADV_ESTIMATORS) | set(POLICY_LOSSES) | set(OPTIONAL_ESTIMATOR_INPUTS)


# Config fields whose value names an algorithm, and the set of inputs an estimator needs.
ALGORITHM_SELECTORS = {"adv_estimator", "loss_mode", "estimator_needs", "needs"}


def test_the_controller_never_branches_on_an_algorithm():
    """No comparison with an estimator, loss or estimator-input name, and none that reads the
    setting that names one: a new algorithm never needs a branch in the loop (rule 4)."""
    names, problems = algorithm_names(), []
    for rel, tree in controller_sources():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            strings = {o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)}
            selectors = {n.attr if isinstance(n, ast.Attribute) else n.id for o in operands for n in ast.walk(o)
                         if isinstance(n, ast.Attribute | ast.Name) and (n.attr if isinstance(n, ast.Attribute) else n.id)
                         in ALGORITHM_SELECTORS}
            if strings & names or selectors:
                problems.append(f"{rel}:{node.lineno}: compares {sorted(strings & names) or sorted(selectors)}")
    assert not problems, "\n".join(problems)

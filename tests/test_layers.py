"""The import graph: no cycles among module-level imports, and no module imports (even inside a
function) from a layer above its own. Data flows one way; algorithms know no executor, no
Flower and no runner."""

from __future__ import annotations

import ast
from pathlib import Path

import stocfl

ROOT = Path(stocfl.__file__).parent

# lowest first; a module may import from its own layer and those below
LAYERS = [
    {"errors", "bounds", "files", "state", "devices", "optim", "aggregation", "clustering", "checkpoint", "store", "report",
     "plots", "tau", "scalars"},
    {"data", "models", "training", "lowrank", "scenarios", "tasks"},
    {"algorithms"},
    {"executors", "localbn", "flower.codec", "flower.loopback", "flower.certs"},
    {"config", "build", "results", "runner", "flower", "flower.engine"},
    {"api", "newclients", "modelfiles", "compare", "reproduce", "bench", "peers", "cli", "__main__", ""},
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer(name: str) -> int:
    for k, names in enumerate(LAYERS):
        if name in names or any(name.startswith(n + ".") for n in names if n):
            return k
    raise AssertionError(f"module stocfl.{name} has no layer in tests/test_layers.py; add it")


def imports() -> dict[str, list[tuple[str, bool]]]:
    """stocfl module -> [(stocfl module it imports, at module level?)]."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "stocfl":
                names = [node.module] if node.module != "stocfl" else [f"stocfl.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "stocfl"]
            else:
                continue
            found += [(n.removeprefix("stocfl").lstrip("."), node.col_offset == 0) for n in names]
        out[module_name(path)] = found
    return out


def test_no_module_imports_a_layer_above_it():
    bad = [f"stocfl.{m} (layer {layer(m)}) imports stocfl.{t} (layer {layer(t)})"
           for m, found in imports().items() for t, _ in found if layer(t) > layer(m)]
    assert not bad, "\n".join(bad)


def test_algorithms_import_no_executor_flower_or_runner():
    bad = [(m, t) for m, found in imports().items() if m.startswith("algorithms")
           for t, _ in found if t.split(".")[0] in {"executors", "flower", "runner", "build", "results", "api"}]
    assert not bad, bad


def test_module_level_imports_have_no_cycle():
    graph = {m: {t for t, top in found if top and t != m} for m, found in imports().items()}
    # a package's __init__ that re-exports its submodules is not a cycle with them
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [m, t]))
            if state.get(t) is None:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if state.get(m) is None:
            visit(m, [])

"""The import graph: no cycles among module-level imports, and no module imports (even inside a
function) from a layer above its own. Data flows one way; algorithms know no executor, no
Flower and no runner."""

from __future__ import annotations

import ast
from pathlib import Path

import stocfl
import stocfl_lab

ROOT = Path(stocfl.__file__).parent

# lowest first, by the data flow: a module may import from its own layer and those below. A
# folder's modules share its layer, but where one is named on its own.
LAYERS = [
    {"errors", "bounds", "devices", "config", "storage"},
    {"data"},
    {"client"},
    {"algorithms"},
    {"executors", "flower.codec", "flower.loopback", "flower.certs"},
    {"experiment"},
    {"flower", "flower.engine"},
    {"api", "cli", "__main__", ""},
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer(name: str) -> int:
    # the most specific entry wins: flower.codec before flower
    best = max(
        ((len(n), k) for k, names in enumerate(LAYERS) for n in names if name == n or (n and name.startswith(n + "."))),
        default=None,
    )
    if best is not None:
        return best[1]
    raise AssertionError(f"module stocfl.{name} has no layer in tests/test_layers.py; add it")


def imports() -> dict[str, list[tuple[str, bool]]]:
    """stocfl module -> [(stocfl module it imports, at module level?)]."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "stocfl":
                # from stocfl.pkg import mod imports the module pkg.mod (and pkg, but a package's
                # __init__ re-exporting its modules is no cycle with them)
                mods = [
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if (ROOT.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").is_file()
                    or (ROOT.parent / f"{node.module}.{a.name}".replace(".", "/") / "__init__.py").is_file()
                ]
                names = mods if len(mods) == len(node.names) else [node.module] + mods
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "stocfl"]
            else:
                continue
            found += [(n.removeprefix("stocfl").lstrip("."), node.col_offset == 0) for n in names]
        out[module_name(path)] = found
    return out


def test_no_module_imports_a_layer_above_it():
    bad = [
        f"stocfl.{m} (layer {layer(m)}) imports stocfl.{t} (layer {layer(t)})"
        for m, found in imports().items()
        for t, _ in found
        if layer(t) > layer(m)
    ]
    assert not bad, "\n".join(bad)


def test_algorithms_import_no_executor_flower_or_runner():
    bad = [
        (m, t)
        for m, found in imports().items()
        if m.startswith("algorithms")
        for t, _ in found
        if t.split(".")[0] in {"executors", "flower", "runner", "build", "results", "api"}
    ]
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


LAB = Path(stocfl_lab.__file__).parent
# what the lab may import: stocfl's public face (the package, its folder packages' exports, the
# config schema, the error form, the command line's parser helpers), never a module inside a folder
PUBLIC_MODULES = {
    "stocfl",
    "stocfl.config",
    "stocfl.errors",
    "stocfl.cli",
    "stocfl.devices",
    "stocfl.data",
    "stocfl.client",
    "stocfl.algorithms",
    "stocfl.executors",
    "stocfl.storage",
    "stocfl.experiment",
    "stocfl.flower",
}


def _imported(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def test_the_library_never_imports_the_lab():
    bad = [
        f"{p.relative_to(ROOT)} imports {m}"
        for p in sorted(ROOT.rglob("*.py"))
        for m, _ in _imported(p)
        if m.split(".")[0] == "stocfl_lab"
    ]
    assert not bad, bad


def test_the_lab_imports_only_stocfls_public_api():
    import importlib

    bad = []
    for p in sorted(LAB.rglob("*.py")):
        for m, names in _imported(p):
            if m.split(".")[0] != "stocfl":
                continue
            if m not in PUBLIC_MODULES:
                bad.append(f"{p.name} imports {m}, a module inside a folder; import its package's export")
                continue
            exported = set(getattr(importlib.import_module(m), "__all__", ()))
            if m in {"stocfl.config", "stocfl.errors", "stocfl.cli", "stocfl.devices"}:
                continue  # modules of their own: their public names are those without a leading underscore
            bad += [
                f"{p.name} imports {m}.{n}, which {m}.__all__ does not export"
                for n in names
                if n not in exported and f"{m}.{n}" not in PUBLIC_MODULES
            ]
    assert not bad, "\n".join(bad)

"""Layering: no import cycles among cbjax modules, and the layers import only downwards.

Imports are read from the source (every `import`, at module level, inside functions and under
TYPE_CHECKING alike), so a cycle hidden in a lazy import fails here too. Importing a submodule
runs its packages' `__init__` first, so such an import also depends on those packages."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "cbjax").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("cbjax") else None
                while target:  # the module and the packages whose __init__ runs before it
                    if target != mod and not mod.startswith(target + "."):
                        graph[mod].add(target)
                    target = target.rpartition(".")[0] if "." in target else None
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_cbjax_modules():
    assert cycles(import_graph()) == []


def test_the_layers_import_only_downwards():
    graph = import_graph()
    app = {m for m in graph if m.startswith(("cbjax.app", "cbjax.engine.loop"))}
    for mod, deps in graph.items():
        if mod.startswith("cbjax.runtime") or mod.startswith("cbjax.kernels") or mod.startswith("cbjax.model"):
            assert not deps & app, f"{mod} (device side) imports the run layer: {sorted(deps & app)}"
        if mod.startswith(("cbjax.scheduler", "cbjax.cache", "cbjax.sim", "cbjax.workload", "cbjax.core.plan")):
            device = {d for d in deps if d.startswith(("cbjax.runtime", "cbjax.kernels", "cbjax.model"))}
            assert not device, f"{mod} (host side) imports the device side: {sorted(device)}"
            assert not deps & app, f"{mod} imports the run layer: {sorted(deps & app)}"


MAX_LINES = 400


def test_no_module_is_over_400_lines():
    over = {}
    for path in sorted((ROOT / "cbjax").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        num_lines = len(path.read_text().splitlines())
        if num_lines > MAX_LINES:
            over[name] = num_lines
    assert not over, f"modules over {MAX_LINES} lines (split them by job): {over}"


def test_the_config_layer_imports_only_itself():
    # the registries' packages import the config; the config checks no registry's names itself
    graph = import_graph()
    for mod, deps in graph.items():
        if mod.startswith("cbjax.config"):
            outside = {d for d in deps if d != "cbjax" and not d.startswith("cbjax.config")}
            assert not outside, f"{mod} imports {sorted(outside)}"

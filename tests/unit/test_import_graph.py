"""The import graph of embcache has no cycle, counting type-only and in-function imports.

import-linter's contracts (``lint-imports``, in scripts/test.sh) say which layer may import
which; this test says that no group of modules imports itself round in a circle, a cycle of
design even when ``if TYPE_CHECKING:`` hides it from the interpreter.
"""

from __future__ import annotations

import grimp


def strongly_connected(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Tarjan's components of the module graph with more than one module (or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    targets = graph.find_modules_directly_imported_by(child) & modules
                    work.append((child, iter(sorted(targets))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                loops = node in graph.find_modules_directly_imported_by(node)
                if len(component) > 1 or loops:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    graph = grimp.build_graph("embcache", include_external_packages=False)
    modules = {m for m in graph.modules if not m.startswith("embcache.proto.embcache.v1")}
    cycles = strongly_connected(graph, modules)
    assert not cycles, "import cycles (type-only imports count): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_check_finds_a_cycle() -> None:
    """The search itself: a planted two-module cycle and a self-import are both reported."""
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.c")
    found = strongly_connected(graph, {"pkg.a", "pkg.b", "pkg.c"})
    assert sorted(found) == [["pkg.a", "pkg.b"], ["pkg.c"]]


def test_above_the_engine_only_its_methods_are_used() -> None:
    """The engine's parts (``host_pool``, ``host_store``, ``device_tier``) are for tests,
    benchmarks and debugging: no module above the engine reaches around its methods."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "service"
    above = ["transport", "shared_tier", "observability", "cli", "daemon.py", "daemon_process.py"]
    files = [
        p
        for name in above
        for p in ((root / name).rglob("*.py") if (root / name).is_dir() else [root / name])
    ]
    parts = {"host_pool", "host_store", "device_tier"}
    found = [
        f"{path.relative_to(root.parent)}:{node.lineno} .{node.attr}"
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in parts and _is_engine(node.value)
    ]
    assert not found, found


def _is_engine(node: object) -> bool:
    """``engine``, ``e``, ``self.engine``, ``x.engine``: an expression naming an engine."""
    import ast

    if isinstance(node, ast.Name):
        return node.id in ("engine", "e")
    return isinstance(node, ast.Attribute) and node.attr == "engine"

"""The packages of the project import each other as a DAG: no package circles.

A package here is one part of the map in DESIGN.md: ``orchestrator.api``,
``orchestrator.dashboard``, ``orchestrator.commands``, and each top-level module
such as ``orchestrator.demo`` or ``orchestrator.cli`` on its own. Every import
counts, the ones inside functions too: a lazy import still ties the two parts
together, it only defers the failure to the first call. A circle means neither
part can be read, tested or moved without the other, so a shared piece belongs
in a module both may import.

The imports are read with ``ast``, nothing is imported, so a circle is found
even where Python's import order happens to tolerate it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("orchestrator", "training")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for top in TOP_PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            modules[module_name(path)] = path
    return modules


def imported_modules(path: Path, name: str, known: set[str]) -> Iterator[str]:
    """Every project module that ``path`` (module ``name``) imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                drop = node.level - 1 if is_package else node.level
                anchor = anchor[: len(anchor) - drop] if drop else anchor
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # `from orchestrator import contract` imports the module `contract`
                submodule = f"{base}.{alias.name}"
                yield submodule if submodule in known else base


def package_of(module: str) -> str:
    """The part of the map a module belongs to: its first two name components."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the modules of the first that import the second."""
    modules = project_modules()
    known = set(modules)
    graph: dict[str, dict[str, set[str]]] = {}
    for name, path in modules.items():
        source = package_of(name)
        graph.setdefault(source, {})
        for target in imported_modules(path, name, known):
            if target.split(".")[0] not in TOP_PACKAGES:
                continue
            imported = package_of(target)
            if imported != source:
                graph[source].setdefault(imported, set()).add(name)
    return graph


def strongly_connected(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of packages that reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def describe(group: list[str], graph: dict[str, dict[str, set[str]]]) -> str:
    members = set(group)
    ties = [
        f"  {source} -> {target} (in {', '.join(sorted(graph[source][target]))})"
        for source in group
        for target in sorted(graph[source])
        if target in members
    ]
    return " <-> ".join(group) + "\n" + "\n".join(ties)


def test_the_packages_import_each_other_as_a_dag() -> None:
    graph = package_graph()
    circles = strongly_connected(graph)
    assert not circles, "package circles:\n" + "\n".join(describe(g, graph) for g in circles)


@pytest.mark.parametrize(
    ("graph", "circle"),
    [
        ({"a": {"b": {"a.x"}}, "b": {"a": {"b.y"}}}, [["a", "b"]]),
        ({"a": {"b": {"a.x"}}, "b": {"c": {"b.y"}}, "c": {"a": {"c.z"}}}, [["a", "b", "c"]]),
        ({"a": {"b": {"a.x"}}, "b": {"c": {"b.y"}}, "c": {}}, []),
    ],
    ids=["two-way", "three-way", "chain"],
)
def test_a_circle_is_found_and_named(
    graph: dict[str, dict[str, set[str]]], circle: list[list[str]]
) -> None:
    assert strongly_connected(graph) == circle


def test_a_lazy_import_inside_a_function_counts(tmp_path: Path) -> None:
    module = tmp_path / "late.py"
    module.write_text(
        "def run():\n    from orchestrator.demo import run_demo\n    return run_demo\n"
    )
    imported = set(imported_modules(module, "orchestrator.commands.late", {"orchestrator.demo"}))
    assert package_of("orchestrator.commands.late") == "orchestrator.commands"
    assert {package_of(m) for m in imported} == {"orchestrator.demo"}


def test_a_relative_import_resolves_to_its_package(tmp_path: Path) -> None:
    module = tmp_path / "routes.py"
    module.write_text("from ..api import deps\nfrom . import charts\n")
    known = {"orchestrator.api.deps", "orchestrator.dashboard.charts"}
    imported = set(imported_modules(module, "orchestrator.dashboard.routes", known))
    assert imported == known

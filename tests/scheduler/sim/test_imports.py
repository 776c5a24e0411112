"""The simulator's modules import each other without a cycle, type-only imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import scheduler.sim

PACKAGE = "scheduler.sim"
ROOT = Path(scheduler.sim.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every ``scheduler.sim`` module ``path`` imports, anywhere in the file (``TYPE_CHECKING`` too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE + "."):
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            found.update(f"{PACKAGE}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PACKAGE + "."))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {f"{PACKAGE}.{p.stem}": p for p in ROOT.glob("*.py") if p.stem != "__init__"}
    return {name: _imports(path) & modules.keys() for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        for child in sorted(graph[node]):
            cycle = visit(child, [*path, node])
            if cycle is not None:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle is not None:
            return cycle
    return None


def test_no_import_cycle_in_the_simulator() -> None:
    graph = _graph()
    assert f"{PACKAGE}.migration_shell" in graph[f"{PACKAGE}.migration"]  # the scan sees imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_check_finds_a_type_only_cycle(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(f"from {PACKAGE}.b import B\n")
    (tmp_path / "b.py").write_text(
        f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {PACKAGE}.a import A\n"
    )
    graph = {f"{PACKAGE}.{p.stem}": _imports(p) for p in tmp_path.glob("*.py")}
    assert _cycle(graph) == [f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.a"]


def test_migration_depends_on_protocols_not_on_the_instance_or_the_simulator() -> None:
    graph = _graph()
    for module in ("migration", "migration_shell", "migration_ports"):
        imported = graph[f"{PACKAGE}.{module}"]
        assert f"{PACKAGE}.instance" not in imported and f"{PACKAGE}.simulator" not in imported, module

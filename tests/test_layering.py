"""Which part of shoal may import which, and no import circles.

Every ``import`` counts — at module level, inside functions, and under
``TYPE_CHECKING`` — because each is a dependency a reader and a refactoring
must follow. The parts ("units") and what each may import are those of
docs/DESIGN.md; from the bottom:

========================  =========================================================
unit                      may import
========================  =========================================================
schemas                   (nothing of shoal)
bus                       schemas
transport                 schemas, bus
policy core               schemas
engines                   schemas, bus
migration protocol        schemas
agent                     schemas, bus, transport, policy core, engines, migration protocol
scheduler                 schemas, bus, policy core
simulator                 schemas, policy core, engines, migration protocol, scheduler
frontend                  schemas, bus, policy core, engines, scheduler
========================  =========================================================

The top-level packages ``agents`` and ``scheduler`` each hold two layers (the
engine layer and migration protocol under the agent; the policy core under the
scheduler service and the simulator), so at package level ``agents`` imports
``scheduler`` (its policy core) and ``scheduler`` imports ``agents`` (the
simulator uses the engine layer and the migration protocol). That is the one
package-level circle, and it is no circle between units.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agents", "bus", "frontend", "scheduler", "schemas", "transport")

#: (unit, module prefixes), most specific first: a module belongs to the first unit a prefix matches.
UNITS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("policy core", ("scheduler.config", "scheduler.policy", "scheduler.cluster_state", "scheduler.fold")),
    ("simulator", ("scheduler.sim",)),
    ("scheduler", ("scheduler",)),
    ("engines", ("agents.engines",)),
    ("migration protocol", ("agents.migration.fsm",)),
    ("agent", ("agents",)),
    ("schemas", ("schemas",)),
    ("bus", ("bus",)),
    ("transport", ("transport",)),
    ("frontend", ("frontend",)),
)

ALLOWED: dict[str, set[str]] = {
    "schemas": set(),
    "bus": {"schemas"},
    "transport": {"schemas", "bus"},
    "policy core": {"schemas"},
    "engines": {"schemas", "bus"},
    "migration protocol": {"schemas"},
    "agent": {"schemas", "bus", "transport", "policy core", "engines", "migration protocol"},
    "scheduler": {"schemas", "bus", "policy core"},
    "simulator": {"schemas", "policy core", "engines", "migration protocol", "scheduler"},
    "frontend": {"schemas", "bus", "policy core", "engines", "scheduler"},
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The shoal module ``name`` refers to (``a.b.c`` may be a name inside module ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, source: str | None = None) -> set[str]:
    """The shoal modules ``module`` imports (``source``: its text, if not the file's)."""
    path = MODULES.get(module, ROOT / "virtual.py")
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES and (target := _resolve(name)) is not None and target != module:
                targets.add(target)
    return targets


GRAPH = {module: _imports(module) for module in MODULES}


def unit_of(module: str) -> str:
    for unit, prefixes in UNITS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return unit
    raise AssertionError(f"{module} belongs to no unit")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = itertools.count()

    def visit(node: str) -> None:
        index[node] = low[node] = next(counter)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
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
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_belongs_to_a_unit() -> None:
    assert len(MODULES) > 100
    for module in MODULES:
        unit_of(module)


def test_no_import_circle_between_modules() -> None:
    assert _cycles(GRAPH) == []


def test_no_import_circle_between_units() -> None:
    units: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        unit = unit_of(module)
        units.setdefault(unit, set()).update(unit_of(t) for t in targets if unit_of(t) != unit)
    assert _cycles(units) == []


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_each_unit_imports_only_what_it_may(unit: str) -> None:
    offending = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        if unit_of(module) == unit
        for target in targets
        if unit_of(target) != unit and unit_of(target) not in ALLOWED[unit]
    )
    assert offending == []


def test_the_only_package_level_circle_is_agents_and_scheduler() -> None:
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        top = module.split(".")[0]
        packages.setdefault(top, set()).update(t.split(".")[0] for t in targets if t.split(".")[0] != top)
    assert _cycles(packages) == [["agents", "scheduler"]]


def test_the_checker_sees_a_circle_when_there_is_one() -> None:
    graph = {m: set(t) for m, t in GRAPH.items()}
    graph["schemas.base"].add("agents.service")  # schemas would now reach the agent, which imports schemas
    assert _cycles(graph) != []
    assert unit_of("agents.service") not in ALLOWED[unit_of("schemas.base")]


def test_imports_under_type_checking_and_in_functions_count() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from agents.service import Agent\n"
        "def later():\n    from .migration import MigrationDriver\n"
    )
    assert _imports("scheduler.sim.example", source) == {"agents.service", "scheduler.sim.migration"}


def test_the_simulators_migration_depends_on_protocols_not_on_the_instance_or_the_simulator() -> None:
    for name in ("migration", "migration_shell", "migration_ports"):
        module = f"scheduler.sim.{name}"
        assert GRAPH[module] & {"scheduler.sim.instance", "scheduler.sim.simulator"} == set(), module

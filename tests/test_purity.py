"""The pure cores are pure: they import no bus, network, event loop, model or other component,
and read no clock, environment or randomness.

Three cores, each a set of modules and the first-party modules they may use:

* the scheduler's policy core (virtual usage, freeness, dispatch, pairing,
  selection, scaling, the cluster-state fold, the policy configuration);
* the migration protocol (the two state machines and their configuration);
* the engine core (the ``Engine`` protocol and its data, the block manager,
  the local scheduler).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Core:
    name: str
    files: tuple[str, ...]  # globs relative to the repository root
    allowed: tuple[str, ...]  # first-party module prefixes its files may import

    def paths(self) -> list[Path]:
        return sorted(p for pattern in self.files for p in ROOT.glob(pattern))

    def modules(self) -> list[str]:
        names = []
        for path in self.paths():
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
        return names


ENGINE_CORE = ("protocol", "cache_delta", "block_manager", "local_scheduler")
CORES = (
    Core(
        "scheduler policy core",
        (
            "scheduler/config.py", "scheduler/cluster_state.py", "scheduler/fold.py",
            "scheduler/prefix_index.py", "scheduler/policy/*.py",
        ),
        (
            "schemas", "scheduler.config", "scheduler.cluster_state", "scheduler.fold",
            "scheduler.prefix_index", "scheduler.policy",
        ),
    ),
    Core("migration protocol", ("agents/migration/fsm/*.py",), ("schemas", "agents.migration.fsm")),
    Core(
        "engine core",
        tuple(f"agents/engines/{name}.py" for name in ENGINE_CORE),
        ("schemas", *(f"agents.engines.{name}" for name in ENGINE_CORE)),
    ),
)

FIRST_PARTY = {"agents", "bus", "frontend", "scheduler", "schemas", "transport"}
#: Third-party and standard modules whose presence would mean I/O, a network, threads or a model.
FORBIDDEN_PACKAGES = {
    "nats", "asyncio", "socket", "ssl", "selectors", "httpx", "fastapi", "uvicorn", "ucp", "ucxx",
    "torch", "opentelemetry", "numpy",
}
#: Modules a pure module may not import itself: clocks, environment, randomness, files, threads.
FORBIDDEN_DIRECT = FORBIDDEN_PACKAGES | {
    "time", "datetime", "os", "random", "secrets", "threading", "subprocess", "pathlib", "io",
}
ALLOWED_STDLIB = {  # hashlib: a digest is a pure function of its input (a seeded, replayable draw)
    "__future__", "bisect", "collections", "dataclasses", "enum", "hashlib", "heapq", "itertools", "math",
    "sys", "typing",
}


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _is_parent_package(module: str, prefixes: tuple[str, ...]) -> bool:
    """A parent package of an allowed module (``agents`` for ``agents.migration.fsm``)."""
    return any(p.startswith(module + ".") for p in prefixes)


@pytest.mark.parametrize("core", CORES, ids=lambda c: c.name)
def test_importing_a_core_loads_no_io_and_no_other_component(core: Core) -> None:
    modules = core.modules()
    assert modules, core.name
    code = (
        "import json, sys\n"
        f"for name in {modules!r}:\n"
        "    __import__(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert {m.split(".")[0] for m in loaded} & FORBIDDEN_PACKAGES == set()
    strays = sorted(
        m
        for m in loaded
        if m.split(".")[0] in FIRST_PARTY
        and not _within(m, core.allowed)
        and not _is_parent_package(m, core.allowed)
    )
    assert strays == []


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("core", CORES, ids=lambda c: c.name)
def test_no_pure_module_imports_a_clock_the_environment_or_another_component(core: Core) -> None:
    paths = core.paths()
    assert len(paths) >= 3
    offenders: dict[str, list[str]] = {}
    for path in paths:
        bad = sorted(
            name
            for name in _imports(path)
            if name.split(".")[0] in FORBIDDEN_DIRECT
            or (name.split(".")[0] in FIRST_PARTY and not _within(name, core.allowed))
            or (name.split(".")[0] not in FIRST_PARTY | ALLOWED_STDLIB | {"msgspec"})
        )
        if bad:
            offenders[path.relative_to(ROOT).as_posix()] = bad
    assert offenders == {}

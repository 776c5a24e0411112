"""The policy core is pure: it imports nothing from the bus, the network, agents or the frontend,
and reads no clock, environment or randomness."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PURE_MODULES = [
    "scheduler.config",
    "scheduler.policy",
    "scheduler.cluster_state",
    "scheduler.fold",
    "scheduler.migration_fsm",
]
PURE_FILES = sorted(
    [ROOT / "scheduler" / name for name in ("config.py", "cluster_state.py", "fold.py", "migration_fsm.py")]
    + list((ROOT / "scheduler" / "policy").glob("*.py"))
    + list((ROOT / "scheduler" / "migration").glob("*.py"))
)
#: Top-level packages whose presence would mean I/O, a network or another component.
FORBIDDEN_PACKAGES = {
    "bus", "transport", "frontend", "agents", "nats", "asyncio", "socket", "ssl", "selectors",
    "httpx", "fastapi", "uvicorn", "ucp", "ucxx", "torch", "opentelemetry",
}
#: Modules a pure module may not import itself: clocks, environment, randomness, files, threads.
FORBIDDEN_DIRECT = FORBIDDEN_PACKAGES | {
    "time", "datetime", "os", "random", "secrets", "threading", "subprocess", "pathlib", "io",
}


def test_importing_the_core_loads_no_bus_network_or_component() -> None:
    code = (
        "import json, sys\n"
        f"for name in {PURE_MODULES!r}:\n"
        "    __import__(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert {"scheduler", "schemas", "msgspec"} <= loaded
    assert loaded & FORBIDDEN_PACKAGES == set()


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_pure_module_imports_a_clock_the_environment_or_the_network() -> None:
    assert len(PURE_FILES) >= 12
    offenders = {
        path.relative_to(ROOT).as_posix(): sorted(_imports(path) & FORBIDDEN_DIRECT)
        for path in PURE_FILES
        if _imports(path) & FORBIDDEN_DIRECT
    }
    assert offenders == {}
    for path in PURE_FILES:
        allowed = {"__future__", "collections", "dataclasses", "enum", "itertools", "math", "sys", "typing",
                   "msgspec", "schemas", "scheduler"}
        assert _imports(path) <= allowed, path

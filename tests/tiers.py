"""The test tiers: every collected test gets exactly one of ``unit``, ``integration`` and ``e2e``.

``pytest -m unit`` runs the pure tests, ``-m integration`` those on a real nats-server,
``-m e2e`` those that start processes; plain ``pytest`` runs all three.

* ``e2e``: processes. ``shoal`` subprocesses, drills, vLLM, a fresh interpreter, any child
  process other than a nats-server. A test is e2e when a marker says so
  (``pytestmark = pytest.mark.e2e``) or its folder, file or node id is listed in ``E2E``.
* ``integration``: a real nats-server or real sockets, components in-process. A test is
  integration when it uses a NATS fixture (``NATS_FIXTURES``, or any fixture that depends on
  one), runs a parametrized case listed in ``PARAM_TIERS``, a marker says so, or it is listed
  in ``INTEGRATION``.
* ``unit``: everything else: no processes, no sockets, no nats-server.

The tiers are held to what they promise, so a test in the wrong tier fails loudly rather
than drifting: while a unit test runs (setup, call and teardown), starting a process or a
nats-server, opening a listening socket or connecting one to a network address raises
``TierViolation``; an integration test may start nats-servers but no other process. A
violation fails the test even where the code under test catches the exception. A library's
probe of its host (``ctypes.util.find_library`` running ``ldconfig``: ``PROBES``) is not a
process of the test's and passes in every tier.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from bus.server import EmbeddedNats

__all__ = [
    "E2E", "INTEGRATION", "NATS_FIXTURES", "PARAM_TIERS", "PROBES", "TIERS", "TierViolation", "tier_of",
]

TIERS = ("unit", "integration", "e2e")

#: fixtures that start (or hand out) a real nats-server; a test using one, directly or through
#: another fixture, is an integration test
NATS_FIXTURES = frozenset({"nats_server", "nats_url", "secure_nats"})

#: parametrized cases that need more than their test's other cases: (argument, value) -> tier
PARAM_TIERS: dict[tuple[str, object], str] = {
    ("make_bus", "jetstream"): "integration",  # the bus contract on the session server
    ("kind", "jetstream"): "integration",  # a JetStream bus's own sockets
    ("kind", "tcp"): "integration",  # KV transport over TCP on loopback
    ("kind", "ucx"): "integration",  # KV transport, UCX over TCP on loopback
    ("core", "process"): "e2e",  # the torch engine's model steps in a child process
    ("engine", "vllm"): "e2e",  # vLLM's engine starts processes (and probes the host with lscpu)
}

#: folders (ending in "/"), files and single tests that start processes, relative to the root
E2E: tuple[str, ...] = (
    # shoal's own commands as subprocesses
    "tests/agents/test_agent_cli.py",
    "tests/agents/test_agent_cli_vllm.py",
    "tests/agents/test_bench_migration.py",
    "tests/agents/test_netns.py",  # network namespaces (ip netns), an agent in each
    "tests/bus/test_bench.py",
    "tests/bus/test_otlp_receiver.py::test_the_receiver_process_counts_spans_and_exits_cleanly_on_sigterm",
    "tests/frontend/drill/test_drill.py",
    "tests/frontend/drill/test_drill_vllm.py",
    "tests/frontend/drill/test_scenario.py::test_shoal_drill_rejects_a_bad_file_with_status_2_and_the_field",
    "tests/frontend/test_bench_serve.py::test_bench_serve_reports_each_round_and_where_its_wall_went",
    "tests/frontend/test_bench_serve.py::test_sigterm_stops_bench_serve_and_everything_it_started",
    "tests/frontend/test_bench_tracing.py",
    "tests/frontend/test_cli.py::test_help_lists_every_subcommand",
    "tests/frontend/test_otlp_trace.py",
    "tests/frontend/test_packages.py::test_a_shadowed_package_stops_shoal_with_the_distribution_named",
    "tests/frontend/test_up.py",
    "tests/frontend/test_up_secure.py",
    "tests/frontend/test_up_vllm.py",
    "tests/scheduler/test_service_recovery.py",
    "tests/test_base_install.py::test_without_torch_or_matplotlib_shoal_up_sim_serves_and_extras_are_named",
    # a fresh interpreter per case
    "tests/test_purity.py::test_importing_a_core_loads_no_io_and_no_other_component",
    # the torch engine's core process
    "tests/agents/engines/test_torch_bench.py",
    "tests/agents/engines/test_torch_bench_step.py",
    "tests/agents/engines/test_torch_core_process.py",
    # vLLM (its engine starts processes of its own)
    "tests/agents/engines/test_vllm_cli.py",
    "tests/agents/engines/test_vllm_engine.py",
    "tests/agents/migration/test_engine_aborts.py",
    "tests/agents/migration/test_vllm.py",
    "tests/frontend/test_openai_vllm.py",
)

#: folders, files and single tests on real sockets or their own nats-server without a NATS fixture
INTEGRATION: tuple[str, ...] = (
    "tests/bus/test_jetstream.py",  # servers of its own, killed and restarted
    "tests/bus/test_otlp_receiver.py",  # an HTTP receiver on loopback
    "tests/bus/test_security.py",  # servers of its own with users and TLS
    "tests/frontend/drill/test_proxy.py",  # a TCP proxy on loopback
    "tests/frontend/test_bench_serve.py",  # a metrics endpoint on loopback
    "tests/scheduler/test_replicated_log.py",  # a three-node NATS cluster
    "tests/transport/test_factory.py",  # transports listening on loopback
    "tests/transport/test_tcp.py",
)

#: what each guarded tier promises, for the error message
PROMISES = {
    "unit": "are pure (no processes, sockets or nats-server)",
    "integration": "start no process but a nats-server",
}

_ROOT = Path(__file__).resolve().parent.parent


class TierViolation(RuntimeError):
    """A test did what its tier rules out (a unit test started a process, say)."""


def _listed(nodeid: str, entries: tuple[str, ...]) -> bool:
    for entry in entries:
        if entry.endswith("/") and nodeid.startswith(entry):
            return True
        if nodeid == entry or nodeid.startswith((entry + "::", entry + "[")):
            return True
    return False


def tier_of(item: pytest.Item) -> str:
    """The one tier of ``item``: a tier marker, then the lists, then the fixtures it uses."""
    declared = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
    if len(declared) > 1:
        raise pytest.UsageError(f"{item.nodeid}: more than one tier marker ({', '.join(sorted(declared))})")
    uses_nats = bool(NATS_FIXTURES & set(getattr(item, "fixturenames", ())))
    params = getattr(getattr(item, "callspec", None), "params", {})
    param_tiers = {PARAM_TIERS[key] for key in params.items() if _hashable(key) and key in PARAM_TIERS}
    if declared:
        (tier,) = declared
        if tier == "unit" and (uses_nats or param_tiers):
            raise pytest.UsageError(f"{item.nodeid}: marked unit but uses a nats-server or a socket")
        return tier
    if _listed(item.nodeid, E2E) or "e2e" in param_tiers:
        return "e2e"
    if _listed(item.nodeid, INTEGRATION) or uses_nats or "integration" in param_tiers:
        return "integration"
    return "unit"


def _hashable(key: tuple[str, object]) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def _check_lists() -> None:
    for entry in (*E2E, *INTEGRATION):
        path = _ROOT / entry.split("::", 1)[0]
        if not path.exists():
            raise pytest.UsageError(f"tests/tiers.py lists {entry!r}, which does not exist")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its tier before ``-m`` selects (this hook runs before the mark plugin's)."""
    _check_lists()
    for item in items:
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)


#: modules whose processes are a library's probe of its host, not what a test does: a first
#: ``import torch`` inside a test runs ``ldconfig`` through ``ctypes.util.find_library``, a first
#: matplotlib font cache ``fc-list``
PROBES = frozenset({"ctypes.util", "platform", "matplotlib.font_manager"})


def _probing() -> bool:
    """Whether the process being started is a probe of ``PROBES``'s."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") in PROBES:
            return True
        frame = frame.f_back
    return False


def _program(args: Any, executable: Any) -> str:
    if executable:
        return os.fsdecode(executable)
    if isinstance(args, (str, bytes, os.PathLike)):
        words = os.fsdecode(args).split()
        return words[0] if words else ""
    return os.fsdecode(args[0]) if args else ""


@contextlib.contextmanager
def _held_to(item: pytest.Item) -> Iterator[list[str]]:
    """Patch what ``item``'s tier rules out; yields the violations seen (each also raised)."""
    tier = next((mark.name for mark in item.iter_markers() if mark.name in TIERS), "e2e")
    violations: list[str] = []
    if tier == "e2e":
        yield violations
        return

    def violation(what: str) -> TierViolation:
        promise = PROMISES[tier]
        message = (f"{item.nodeid} ({tier} tier) {what}; {tier} tests {promise}: give it its tier "
                   "(a tier marker, a NATS fixture, or tests/tiers.py's E2E or INTEGRATION list)")
        violations.append(message)
        return TierViolation(message)

    patches: list[tuple[object, str, Callable[..., Any]]] = []
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded_execute_child(self: subprocess.Popen[Any], args: Any, executable: Any, *rest: Any) -> Any:
        program = _program(args, executable)
        allowed = tier == "integration" and Path(program).name == "nats-server"
        if not allowed and not _probing():
            raise violation(f"started a process ({program!r})")
        return execute_child(self, args, executable, *rest)

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise violation(what)
        return refused

    patches.append((subprocess.Popen, "_execute_child", guarded_execute_child))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            patches.append((os, name, refuse(f"started a process (os.{name})")))
    if tier == "unit":
        connect = socket.socket.connect
        connect_ex = socket.socket.connect_ex
        patches.append((EmbeddedNats, "start", refuse("started a nats-server (EmbeddedNats.start)")))
        patches.append((socket.socket, "listen", refuse("opened a listening socket")))

        def guarded_connect(self: socket.socket, address: Any) -> Any:
            if self.family in (socket.AF_INET, socket.AF_INET6):
                raise violation(f"connected a socket to {address!r}")
            return connect(self, address)

        def guarded_connect_ex(self: socket.socket, address: Any) -> Any:
            if self.family in (socket.AF_INET, socket.AF_INET6):
                raise violation(f"connected a socket to {address!r}")
            return connect_ex(self, address)

        patches.append((socket.socket, "connect", guarded_connect))
        patches.append((socket.socket, "connect_ex", guarded_connect_ex))
    missing = object()
    saved = [(owner, name, vars(owner).get(name, missing)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield violations
    finally:
        for owner, name, original in saved:
            if original is missing:  # inherited (socket.socket's methods come from _socket.socket)
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _phase(item: pytest.Item) -> Generator[None, object, object]:
    with _held_to(item) as violations:
        result = yield
    if violations:  # the code under test caught the exception: the test fails all the same
        raise TierViolation(violations[0])
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _phase(item))

"""Session-wide fixtures (one real nats-server per test session) and the test tiers.

Tests that need NATS take ``nats_server`` (the launcher, with ``.url``); a test
that kills or restarts the server starts its own with ``EmbeddedNats``.

The session's servers die with the test process (``die_with_parent``), and
SIGTERM is turned into the interrupt pytest already cleans up after, so a
test run stopped by a timeout or a signal leaves no nats-server behind.

Every test gets exactly one tier marker (``unit``, ``integration``, ``e2e``):
see ``tests/tiers.py``.
"""

from __future__ import annotations

import concurrent.futures
import gc
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import settings

from bus.auth import NatsAuth
from bus.security import SecureDeployment
from bus.server import EmbeddedNats
from schemas import Subjects

pytest_plugins = ["pytester", "tests.hang_report", "tests.tiers"]

# property tests check behaviour, not speed: on a busy 2-core machine one example can take
# longer than hypothesis's default 200 ms deadline
settings.register_profile("shoal", deadline=None)
settings.load_profile("shoal")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    # Collection imports every test module and what it needs (torch among them): the cyclic
    # collector, run again and again over that growing heap, finds next to nothing in it.
    gc.disable()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Collect once, then freeze what collection made (``gc.freeze``): the full collections the
    tests' own garbage triggers no longer walk the modules and objects every test shares."""
    gc.collect()
    gc.freeze()
    gc.enable()


_torch_threads_set = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """In-process torch engines compute on one thread, as ``shoal agent`` does by default
    (``--threads 1``); torch's own default, a thread per core, spins for cores other processes hold."""
    global _torch_threads_set
    torch = sys.modules.get("torch")
    if torch is not None and not _torch_threads_set:
        torch.set_num_threads(1)
        _torch_threads_set = True


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats-store"), die_with_parent=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@dataclass
class SecureNats:
    """A nats-server with ``shoal up --secure``'s users, permissions and mutual TLS, streams provisioned."""

    server: EmbeddedNats
    deployment: SecureDeployment

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def subjects(self) -> Subjects:
        return self.deployment.subjects

    def auth(self, name: str) -> NatsAuth:
        return self.deployment.auth(name)


#: agent users of the secure server (the ids the secure-mode tests give their agents)
SECURE_AGENTS = ("a1", "a2", "a3", "t1", "t2", "i0", "i1", "i2", "agent-0", "agent-1")


@pytest.fixture(scope="session")
def secure_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNats]:
    from bus import BusConfig, JetStreamBus, StreamConfig
    from bus.event_loop import run
    from bus.security import create_deployment

    deployment = create_deployment(
        tmp_path_factory.mktemp("nats-secure"), Subjects("sec"), agents=SECURE_AGENTS
    )
    server = EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats-secure-store"),
                          extra_config=deployment.server_config(), die_with_parent=True)
    server.start()
    try:
        async def provision() -> None:
            streams = StreamConfig(events_max_age=3600.0, loads_max_age=3600.0)
            config = BusConfig(url=server.url, auth=deployment.auth("admin"), subjects=deployment.subjects,
                               streams=streams, name="admin")
            async with JetStreamBus(config):
                pass

        # in a thread of its own: the fixture may be first requested from inside a running event loop
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(lambda: run(provision())).result()
        yield SecureNats(server, deployment)
    finally:
        server.stop()

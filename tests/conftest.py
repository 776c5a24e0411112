"""Session-wide fixtures: one real nats-server per test session.

Tests that need NATS take ``nats_server`` (the launcher, with ``.url``); a test
that kills or restarts the server starts its own with ``EmbeddedNats``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bus.server import EmbeddedNats


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats-store"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url

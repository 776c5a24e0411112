"""Transport pairs for the contract tests: the same tests run over inproc, TCP and UCX.

UCX runs over TCP on loopback (``ucx_tls="tcp"``); where ``ucxx`` cannot be
imported its cases skip, naming the import failure.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from transport import KVTransport, TransportConfig, create_transport
from transport.ucx import ucx_available

KINDS = ("inproc", "tcp", "ucx")


def config_for(kind: str, **overrides: object) -> TransportConfig:
    settings: dict[str, object] = {"kind": kind, "connect_timeout_s": 2.0, "send_timeout_s": 20.0}
    if kind == "ucx":
        settings["ucx_tls"] = "tcp"
    settings.update(overrides)
    return TransportConfig(**settings)  # type: ignore[arg-type]


def skip_without_ucx(kind: str) -> None:
    if kind == "ucx":
        reason = ucx_available()
        if reason is not None:
            pytest.skip(f"UCX transport not testable here: {reason}")


@dataclass
class Pair:
    kind: str
    sender: KVTransport
    receiver: KVTransport
    address: str


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    skip_without_ucx(request.param)
    return str(request.param)


@pytest.fixture
async def pair(kind: str) -> AsyncIterator[Pair]:
    sender = create_transport(config_for(kind))
    receiver = create_transport(config_for(kind))
    await sender.start()
    address = await receiver.start()
    try:
        yield Pair(kind=kind, sender=sender, receiver=receiver, address=address)
    finally:
        await sender.close()
        await receiver.close()


@pytest.fixture
def dead_address(kind: str) -> Callable[[], str]:
    """An address of the pair's kind where nothing listens."""

    def make() -> str:
        if kind == "inproc":
            return "inproc://nobody-here"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return f"{kind}://127.0.0.1:{port}"

    return make

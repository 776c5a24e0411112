"""Choosing and starting a transport from a ``TransportConfig``.

``kind="auto"`` tries UCX first and falls back to TCP when UCX is unavailable
(``ucxx`` not installed, or UCX failing to initialise or to listen), saying so
with a ``logging.warning``. ``open_transport`` returns a started transport;
``create_transport`` only builds one (for ``auto`` it cannot know yet whether
UCX will start, so it picks UCX when ``ucxx`` imports).
"""

from __future__ import annotations

import logging

import msgspec

from transport.config import TransportConfig
from transport.errors import TransportError, TransportUnavailable
from transport.inproc import InprocTransport
from transport.protocol import KVTransport
from transport.tcp import TcpTransport

__all__ = ["create_transport", "open_transport", "transport_for_address"]

log = logging.getLogger(__name__)


def create_transport(config: TransportConfig) -> KVTransport:
    """Build (not start) the transport ``config.kind`` names."""
    if config.kind == "inproc":
        return InprocTransport(config)
    if config.kind == "tcp":
        return TcpTransport(config)
    from transport.ucx import UcxTransport, ucx_available

    if config.kind == "ucx":
        reason = ucx_available()
        if reason is not None:
            raise TransportUnavailable(reason)
        return UcxTransport(config)
    if ucx_available() is None:
        return UcxTransport(config)
    return TcpTransport(msgspec.structs.replace(config, kind="tcp"))


async def open_transport(config: TransportConfig) -> KVTransport:
    """Build and start the configured transport; ``auto`` falls back from UCX to TCP (logged)."""
    if config.kind != "auto":
        transport = create_transport(config)
        await transport.start()
        return transport
    from transport.ucx import UcxTransport, ucx_available

    reason = ucx_available()
    if reason is None:
        ucx = UcxTransport(msgspec.structs.replace(config, kind="ucx"))
        try:
            await ucx.start()
        except TransportError as exc:  # TransportUnavailable included
            reason = f"UCX failed to start: {exc}"
        else:
            return ucx
    log.warning("transport 'auto': UCX unavailable (%s); falling back to TCP", reason)
    tcp = TcpTransport(msgspec.structs.replace(config, kind="tcp"))
    await tcp.start()
    return tcp


def transport_for_address(address: str) -> str:
    """The transport kind that can reach ``address`` (its scheme)."""
    from transport.address import scheme_of

    scheme = scheme_of(address)
    if scheme not in ("tcp", "ucx", "inproc"):
        raise TransportError(f"no transport speaks {scheme}:// ({address!r})")
    return scheme

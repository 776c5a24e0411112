"""Connections kept per peer and reused across stages, shared by the TCP and UCX transports.

A :class:`PeerPools` holds, per peer address, at most ``max_per_peer``
connections in use at once and the idle ones for reuse, so consecutive stages
of a migration do not pay a connect each. :meth:`PeerPools.run` takes an idle
connection (or connects), runs one transfer on it and puts it back; a reused
connection that fails before the receiver saw the offer raises
:class:`StaleConnection` from the transfer and is retried once on a fresh one.
What a connection is (a socket, a UCX endpoint) and how it is opened and
discarded is the transport's business: it passes ``connect`` and ``discard``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from transport.errors import PeerUnreachable

__all__ = ["PeerPools", "StaleConnection"]

Conn = TypeVar("Conn")
Peer = tuple[str, int]


class StaleConnection(Exception):
    """A reused connection failed before the receiver saw the offer: safe to retry."""


@dataclass(eq=False)
class _Pool(Generic[Conn]):
    slots: asyncio.Semaphore
    idle: list[Conn] = field(default_factory=list)


class PeerPools(Generic[Conn]):
    """Per-peer connection pools; see the module docstring."""

    def __init__(
        self,
        *,
        max_per_peer: int,
        connect: Callable[[Peer], Awaitable[Conn]],
        discard: Callable[[Conn], Awaitable[None]],
        scheme: str,
    ) -> None:
        self._max_per_peer = max_per_peer
        self._connect = connect
        self._discard = discard
        self._scheme = scheme
        self._pools: dict[Peer, _Pool[Conn]] = {}

    async def run(
        self,
        peer: Peer,
        transfer: Callable[[Conn, bool], Awaitable[None]],
        *,
        keep: Callable[[], bool],
    ) -> None:
        """Run ``transfer(conn, reused)`` on a connection to ``peer``; keep it for reuse if ``keep()``."""
        pool = self._pools.get(peer)
        if pool is None:
            pool = self._pools[peer] = _Pool(asyncio.Semaphore(self._max_per_peer))
        async with pool.slots:
            for _attempt in range(2):
                reused = bool(pool.idle)
                conn = pool.idle.pop() if reused else await self._connect(peer)
                try:
                    await transfer(conn, reused)
                except StaleConnection:
                    await self._discard(conn)
                    continue
                except BaseException:
                    await self._discard(conn)
                    raise
                if keep():
                    pool.idle.append(conn)
                else:
                    await self._discard(conn)
                return
            raise PeerUnreachable(f"connection to {self._scheme}://{peer[0]}:{peer[1]} broke twice")

    async def close(self) -> None:
        """Discard every idle connection and forget the peers."""
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            idle, pool.idle = pool.idle, []
            for conn in idle:
                await self._discard(conn)

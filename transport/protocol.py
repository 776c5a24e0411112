"""The port every KV transport implements: :class:`KVTransport`.

One instance per agent, both directions: the destination ``expect``s a buffer
per migration stage (a :class:`~transport.receiving.PendingTransfer`), the
source ``send``s it. Implementations: :mod:`transport.tcp`, :mod:`transport.ucx`,
:mod:`transport.inproc`; the data types they share live in :mod:`transport.base`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from transport.base import ChunkSource, Payload, TransferHeader, TransportStats, WritableBuffer
from transport.receiving import PendingTransfer

__all__ = ["KVTransport"]


@runtime_checkable
class KVTransport(Protocol):
    """Moves fused KV buffers between agents. One instance per agent, both directions."""

    @property
    def kind(self) -> str:
        """``"inproc"``, ``"tcp"`` or ``"ucx"``."""
        ...

    @property
    def address(self) -> str:
        """Where peers send to (``tcp://host:port``, ``ucx://host:port``, ``inproc://name``).

        Raises ``TransportClosed`` before ``start``."""
        ...

    async def start(self) -> str:
        """Start listening; returns ``address``."""
        ...

    async def close(self) -> None:
        """Stop listening, drop connections, fail pending expectations with ``TransportClosed``."""
        ...

    async def send(
        self, address: str, header: TransferHeader, payload: Payload, *, timeout: float | None = None
    ) -> None:
        """Send one buffer; returns once it sits in the receiver's expected slot.

        Raises ``TransferRejected`` (refused, with ``.reason``), ``PeerUnreachable``,
        ``TransferTimeout``, ``InvalidAddress``, ``TransportClosed``; ``ValueError`` if
        ``header.nbytes`` differs from the payload's size.
        """
        ...

    async def send_paced(
        self, address: str, header: TransferHeader, next_chunk: ChunkSource, *, timeout: float | None = None
    ) -> None:
        """Send one buffer of ``header.nbytes`` bytes that ``next_chunk`` hands out piece by piece.

        The receiver sees one buffer, as from :meth:`send`. The TCP transport puts each piece on
        the wire as it comes, so the sender decides when the bytes move (a migration copy paced
        to the engine's steps); the others gather the pieces, then send (only their
        production is paced), and so does TCP when it must checksum the whole buffer first.
        Raises what :meth:`send` raises; ``ValueError`` if the pieces overrun ``header.nbytes``.
        """
        ...

    def expect(
        self,
        migration_id: str,
        stage: int,
        nbytes: int,
        *,
        reservation_id: str = "",
        into: WritableBuffer | None = None,
    ) -> PendingTransfer:
        """Register the slot for one incoming buffer; await the result for the buffer.

        The buffer is ``into`` itself once filled, or a new ``bytearray`` when ``into`` is None.
        """
        ...

    def cancel(self, migration_id: str) -> int:
        """Drop every expectation of the migration (their waiters get ``TransferCancelled``);
        later arrivals for it are rejected as ``cancelled``. Returns how many were dropped."""
        ...

    def stats(self) -> TransportStats: ...

"""The receive-side bookkeeping every transport shares: expectations and their verdicts.

``ExpectationTable`` is synchronous and does no I/O. A transport asks it to
``admit`` an offered header (getting an ``Admission`` with the landing slot,
or a ``RejectReason``), writes the bytes, then calls ``land`` (deliver to the
waiter, or refuse after the fact: checksum mismatch, cancelled meanwhile) or
``release`` (the connection broke; the slot waits again for a retry).

A slot is keyed by ``(migration_id, stage)``. Each key accepts one buffer:
while one is in flight or after it landed, another is a ``duplicate``. After
``cancel(migration_id)`` every buffer of that migration is refused as
``cancelled``; after a waiter's timeout its key refuses as ``expired``. These
tombstones are bounded (the oldest are forgotten, and then read as
``unknown_transfer``).

Counters (transfers and bytes in and out, refusals by reason) live here too,
so ``stats()`` reads the same for every transport.

``TransportBase`` is what every transport class shares on top of the table
(``expect``, ``cancel``, ``stats``, ``async with``), and ``serve_offer`` is the
receive side of one offer in ``transport.wire``'s protocol (verdict, payload,
landed), for the transports that speak it over a connection.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Self

from transport.base import ChunkSource, Payload, RejectReason, TransferHeader, TransportStats, WritableBuffer
from transport.buffers import Landing
from transport.errors import TransferCancelled, TransferRejected, TransferTimeout, TransportClosed
from transport.wire import PROTOCOL_VERSION, Control, Offer, landed_for, verdict_for

__all__ = ["Admission", "ExpectationTable", "PendingTransfer", "TransportBase", "serve_offer"]

TransferKey = tuple[str, int]


@dataclass(eq=False)
class _Expectation:
    key: TransferKey
    reservation_id: str
    landing: Landing
    future: asyncio.Future[Any]
    in_flight: bool = False
    dropped: RejectReason | None = None


@dataclass(frozen=True, eq=False)
class Admission:
    """An accepted offer: write ``header.nbytes`` bytes into ``landing``, then ``land`` or ``release``."""

    header: TransferHeader
    landing: Landing
    _expectation: _Expectation = field(repr=False)


class PendingTransfer:
    """The receiving end of one ``expect``: await it (or ``wait(timeout)``) for the buffer."""

    def __init__(self, table: ExpectationTable, expectation: _Expectation) -> None:
        self._table = table
        self._expectation = expectation

    @property
    def migration_id(self) -> str:
        return self._expectation.key[0]

    @property
    def stage(self) -> int:
        return self._expectation.key[1]

    @property
    def nbytes(self) -> int:
        return self._expectation.landing.nbytes

    def done(self) -> bool:
        return self._expectation.future.done()

    async def wait(self, timeout: float | None = None) -> Any:
        """The landed buffer. On timeout the expectation is dropped (late arrivals are
        refused as ``expired``) and ``TransferTimeout`` is raised."""
        future = self._expectation.future
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(future)
        except TimeoutError:
            if future.done():
                return future.result()
            self._table._drop(self._expectation, RejectReason.EXPIRED)
            raise TransferTimeout(
                f"buffer for migration {self.migration_id!r} stage {self.stage} "
                f"did not arrive within {timeout}s"
            ) from None

    def cancel(self) -> None:
        """Drop this one expectation (its waiter gets ``TransferCancelled``)."""
        self._table._drop(self._expectation, RejectReason.CANCELLED)

    def __await__(self) -> Generator[Any, None, Any]:
        return self.wait().__await__()


class ExpectationTable:
    """Expected buffers by ``(migration_id, stage)``, refusal counters, tombstones."""

    def __init__(self, *, tombstone_limit: int = 4096) -> None:
        self._tombstone_limit = tombstone_limit
        self._waiting: dict[TransferKey, _Expectation] = {}
        self._finished: OrderedDict[TransferKey, RejectReason] = OrderedDict()
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._rejected: Counter[RejectReason] = Counter()
        self._closed = False
        self.transfers_received = 0
        self.bytes_received = 0
        self.transfers_sent = 0
        self.bytes_sent = 0
        self.sends_rejected = 0

    # -- the destination's side -------------------------------------------------------

    def expect(
        self,
        migration_id: str,
        stage: int,
        nbytes: int,
        *,
        reservation_id: str = "",
        into: WritableBuffer | None = None,
    ) -> PendingTransfer:
        if self._closed:
            raise TransportClosed("transport is closed")
        key = (migration_id, stage)
        if key in self._waiting:
            raise ValueError(f"a buffer for migration {migration_id!r} stage {stage} is already expected")
        landing = Landing.open(into, nbytes)
        self._cancelled.pop(migration_id, None)
        self._finished.pop(key, None)
        expectation = _Expectation(
            key=key,
            reservation_id=reservation_id,
            landing=landing,
            future=asyncio.get_running_loop().create_future(),
        )
        self._waiting[key] = expectation
        return PendingTransfer(self, expectation)

    def cancel(self, migration_id: str) -> int:
        self._remember(self._cancelled, migration_id, None)
        dropped = [e for key, e in self._waiting.items() if key[0] == migration_id]
        for expectation in dropped:
            self._drop(expectation, RejectReason.CANCELLED)
        return len(dropped)

    def close(self) -> None:
        """Fail every waiter with ``TransportClosed``; later offers are refused as ``closed``."""
        self._closed = True
        for expectation in list(self._waiting.values()):
            expectation.dropped = RejectReason.CLOSED
            _fail(expectation.future, TransportClosed("transport closed before the buffer arrived"))
        self._waiting.clear()

    # -- the transport's side ---------------------------------------------------------

    def admit(self, header: TransferHeader) -> Admission | RejectReason:
        """Accept an offered header into its slot, or say why not (and count it)."""
        reason = self._judge(header)
        if reason is not None:
            self._rejected[reason] += 1
            return reason
        expectation = self._waiting[header.key]
        expectation.in_flight = True
        return Admission(header=header, landing=expectation.landing, _expectation=expectation)

    def land(self, admission: Admission, *, checksum: int | None = None) -> RejectReason | None:
        """The bytes are in the slot: deliver them, or refuse (and count) if the slot was
        dropped meanwhile or the checksum (computed by the caller when the header has one)
        does not match."""
        expectation = admission._expectation
        if expectation.dropped is not None:
            self._rejected[expectation.dropped] += 1
            return expectation.dropped
        expected = admission.header.checksum
        if expected is not None and checksum is not None and expected != checksum:
            expectation.in_flight = False
            self._rejected[RejectReason.CHECKSUM_MISMATCH] += 1
            return RejectReason.CHECKSUM_MISMATCH
        del self._waiting[expectation.key]
        self._remember(self._finished, expectation.key, RejectReason.DUPLICATE)
        self.transfers_received += 1
        self.bytes_received += expectation.landing.nbytes
        if not expectation.future.done():
            expectation.future.set_result(expectation.landing.result)
        return None

    def release(self, admission: Admission) -> None:
        """The transfer broke before its bytes were complete; the slot waits for a retry."""
        admission._expectation.in_flight = False

    def refuse(self, reason: RejectReason) -> RejectReason:
        """Count a refusal decided outside the table (e.g. an unsupported protocol version)."""
        self._rejected[reason] += 1
        return reason

    def count_sent(self, nbytes: int) -> None:
        self.transfers_sent += 1
        self.bytes_sent += nbytes

    def count_send_rejected(self) -> None:
        self.sends_rejected += 1

    def stats(self) -> TransportStats:
        return TransportStats(
            transfers_sent=self.transfers_sent,
            bytes_sent=self.bytes_sent,
            sends_rejected=self.sends_rejected,
            transfers_received=self.transfers_received,
            bytes_received=self.bytes_received,
            rejected={reason.value: self._rejected[reason] for reason in sorted(self._rejected, key=str)},
        )

    # -- internals --------------------------------------------------------------------

    def _judge(self, header: TransferHeader) -> RejectReason | None:
        if self._closed:
            return RejectReason.CLOSED
        expectation = self._waiting.get(header.key)
        if expectation is None:
            if header.migration_id in self._cancelled:
                return RejectReason.CANCELLED
            return self._finished.get(header.key, RejectReason.UNKNOWN_TRANSFER)
        if expectation.in_flight:
            return RejectReason.DUPLICATE
        if header.nbytes != expectation.landing.nbytes:
            return RejectReason.SIZE_MISMATCH
        if header.reservation_id != expectation.reservation_id:
            return RejectReason.RESERVATION_MISMATCH
        return None

    def _drop(self, expectation: _Expectation, reason: RejectReason) -> None:
        if self._waiting.get(expectation.key) is not expectation:
            return
        del self._waiting[expectation.key]
        expectation.dropped = reason
        if reason is RejectReason.EXPIRED:
            self._remember(self._finished, expectation.key, reason)
        else:
            self._remember(self._finished, expectation.key, RejectReason.CANCELLED)
        key = expectation.key
        _fail(expectation.future, TransferCancelled(f"migration {key[0]!r} stage {key[1]} was cancelled"))

    def _remember(self, tombstones: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        tombstones[key] = value
        tombstones.move_to_end(key)
        while len(tombstones) > self._tombstone_limit:
            tombstones.popitem(last=False)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if future.done():
        return
    future.set_exception(error)
    future.exception()  # a dropped expectation need not be awaited: mark the error retrieved


class TransportBase:
    """The part of a ``KVTransport`` that is its expectation table; subclasses set ``_table``."""

    _table: ExpectationTable

    async def start(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} does not implement start")

    async def close(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement close")

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def send(
        self, address: str, header: TransferHeader, payload: Payload, *, timeout: float | None = None
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement send")

    async def send_paced(
        self, address: str, header: TransferHeader, next_chunk: ChunkSource, *, timeout: float | None = None
    ) -> None:
        """Gather the pieces into one buffer, then :meth:`send` it (only their production is paced)."""
        buffer = await gather_chunks(header.nbytes, next_chunk)
        await self.send(address, header, buffer, timeout=timeout)

    def expect(
        self,
        migration_id: str,
        stage: int,
        nbytes: int,
        *,
        reservation_id: str = "",
        into: WritableBuffer | None = None,
    ) -> PendingTransfer:
        return self._table.expect(migration_id, stage, nbytes, reservation_id=reservation_id, into=into)

    def cancel(self, migration_id: str) -> int:
        return self._table.cancel(migration_id)

    def stats(self) -> TransportStats:
        return self._table.stats()

    async def _send_counted(
        self, address: str, size: int, limit: float, transfer: Awaitable[None]
    ) -> None:
        """Run one send under its time limit and count it: sent, or refused by the receiver."""
        try:
            async with asyncio.timeout(limit):
                await transfer
        except TimeoutError as exc:
            raise TransferTimeout(f"sending {size} bytes to {address} took over {limit}s") from exc
        except TransferRejected:
            self._table.count_send_rejected()
            raise
        self._table.count_sent(size)


async def gather_chunks(nbytes: int, next_chunk: ChunkSource) -> bytearray:
    """Ask ``next_chunk`` for the pieces of an ``nbytes`` buffer and put them together."""
    buffer = bytearray(nbytes)
    offset = 0
    while offset < nbytes:
        offset = _place(buffer, offset, await next_chunk(offset))
    return buffer


def _place(buffer: bytearray, offset: int, chunk: bytes | bytearray | memoryview) -> int:
    view = memoryview(chunk).cast("B")
    end = offset + view.nbytes
    if not view.nbytes or end > len(buffer):
        raise ValueError(f"a piece of {view.nbytes} bytes at {offset} does not fit {len(buffer)} bytes")
    buffer[offset:end] = view
    return end


async def serve_offer(
    table: ExpectationTable,
    offer: Offer,
    reply: Callable[[Control], Awaitable[None]],
    receive_payload: Callable[[Admission], Awaitable[int | None]],
) -> None:
    """The receive side of one offer: answer a verdict, take the payload, land it, answer ``Landed``.

    An unsupported protocol version or a header the table refuses gets a refusing
    verdict and nothing more. ``receive_payload`` writes the admitted bytes into
    ``admission.landing`` and returns their checksum (None when not computed); if it
    raises, the slot is released for a retry and the error propagates.
    """
    if offer.protocol != PROTOCOL_VERSION:
        await reply(verdict_for(table.refuse(RejectReason.UNSUPPORTED_PROTOCOL)))
        return
    admission = table.admit(offer.header)
    await reply(verdict_for(admission))
    if isinstance(admission, RejectReason):
        return
    try:
        checksum = await receive_payload(admission)
    except BaseException:
        table.release(admission)
        raise
    await reply(landed_for(table.land(admission, checksum=checksum)))

"""The KV data plane's shared data: headers, reject reasons, stats, payload types.

During a live migration the source agent sends, per stage, one fused buffer
(the request's KV blocks gathered into one contiguous buffer) to the
destination agent, out of band of the NATS bus. The destination first
*expects* that buffer (``expect`` is synchronous, so it is registered before
the destination ACKs the PRE-ALLOCATE), then awaits it; anything that arrives
without a matching expectation — unknown migration, wrong size, wrong
reservation, after ``cancel`` or after the wait timed out — is refused before
its bytes are read (the sender gets ``TransferRejected``), counted by reason
in ``stats()``, and never delivered.

``send`` returns only once the receiver has the bytes in the expected slot,
so a source can send ``StageDone`` right after it.

Here: the header, the reject reasons, the stats snapshot and the payload type.
Not here: the ``KVTransport`` protocol (``transport.protocol``), the expectation bookkeeping
(``transport.receiving``), the wire format (``transport.wire``), the
transports themselves (``inproc``, ``tcp``, ``ucx``), the choice between
them (``transport.factory``).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import msgspec

__all__ = [
    "ChunkSource",
    "Payload",
    "RejectReason",
    "TransferHeader",
    "TransportStats",
    "WritableBuffer",
]

Payload: TypeAlias = Any
"""What ``send`` takes: ``bytes``, ``bytearray``, ``memoryview``, a numpy array or a torch
tensor (any dtype, contiguous; CUDA tensors go device-to-device over UCX)."""

ChunkSource: TypeAlias = Callable[[int], Awaitable[bytes | bytearray | memoryview]]
"""What ``send_paced`` takes: called with the bytes sent so far, it waits as long as the sender
wants and returns the next bytes of the buffer (at least one, at most what is left)."""

WritableBuffer: TypeAlias = Any
"""What ``expect(into=...)`` takes: ``bytearray``, a writable ``memoryview``, a numpy array
or a torch tensor, of exactly ``nbytes`` bytes."""


class TransferHeader(msgspec.Struct, frozen=True, kw_only=True):
    """Names one fused buffer: which migration, which stage, which reservation, how big.

    ``checksum`` is an optional CRC-32 of the payload; a transport configured with
    ``checksum=True`` fills it in, and the receiver verifies it when present.
    """

    migration_id: str
    stage: int
    nbytes: int
    reservation_id: str = ""
    checksum: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.migration_id, self.stage)


class RejectReason(enum.StrEnum):
    """Why a receiver refused a buffer (the keys of ``TransportStats.rejected``)."""

    UNKNOWN_TRANSFER = "unknown_transfer"
    SIZE_MISMATCH = "size_mismatch"
    RESERVATION_MISMATCH = "reservation_mismatch"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    DUPLICATE = "duplicate"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    UNSUPPORTED_PROTOCOL = "unsupported_protocol"
    CLOSED = "closed"


class TransportStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one transport's counters since it was created."""

    transfers_sent: int = 0
    bytes_sent: int = 0
    sends_rejected: int = 0
    transfers_received: int = 0
    bytes_received: int = 0
    rejected: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

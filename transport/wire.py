"""The transfer protocol spoken over TCP and UCX connections.

One transfer on one connection, strictly in turn::

    sender   → Offer(header)
    receiver → Verdict(accepted | reason)          # refused offers stop here
    sender   → the payload's nbytes raw bytes
    receiver → Landed(ok | reason)                 # ok: the bytes are in the slot

so a refused buffer's bytes are never sent, and ``send`` returns only once the
buffer has landed. A connection carries any number of transfers one after the
other; senders keep a small pool per peer.

Control messages are msgpack-encoded tagged structs. Over TCP each is framed
by a 4-byte big-endian length; over UCX the same frame is one tagged message,
received into a ``CONTROL_SLOT_BYTES`` buffer (so each control message costs
one UCX message, not two). Pure: no I/O here.
"""

from __future__ import annotations

import struct
from typing import TypeVar

import msgspec

from transport.base import RejectReason, TransferHeader
from transport.errors import ProtocolViolation, TransferRejected

__all__ = [
    "CONTROL_SLOT_BYTES",
    "FRAME_PREFIX",
    "PROTOCOL_VERSION",
    "Control",
    "Landed",
    "Offer",
    "Verdict",
    "decode_control",
    "encode_control",
    "expect_reply",
    "frame_control",
    "landed_for",
    "raise_if_refused",
    "unframe_control",
    "verdict_for",
]

PROTOCOL_VERSION = 1
CONTROL_SLOT_BYTES = 4096
"""The largest control frame (prefix included); ``frame_control`` refuses bigger ones."""
FRAME_PREFIX = struct.Struct("!I")


class Offer(msgspec.Struct, frozen=True, kw_only=True, tag="offer"):
    header: TransferHeader
    protocol: int = PROTOCOL_VERSION


class Verdict(msgspec.Struct, frozen=True, kw_only=True, tag="verdict"):
    accepted: bool
    reason: str = ""


class Landed(msgspec.Struct, frozen=True, kw_only=True, tag="landed"):
    ok: bool
    reason: str = ""


Control = Offer | Verdict | Landed

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Control)


def encode_control(message: Control) -> bytes:
    return _encoder.encode(message)


def frame_control(message: Control) -> bytes:
    """The message with its length prefix; ``ValueError`` past ``CONTROL_SLOT_BYTES`` (ids too long)."""
    body = _encoder.encode(message)
    if FRAME_PREFIX.size + len(body) > CONTROL_SLOT_BYTES:
        raise ValueError(f"control message of {len(body)} bytes exceeds {CONTROL_SLOT_BYTES}: ids too long")
    return FRAME_PREFIX.pack(len(body)) + body


def unframe_control(slot: bytes | bytearray | memoryview) -> Control:
    """Decode one framed control message from the start of ``slot`` (which may be longer)."""
    if len(slot) < FRAME_PREFIX.size:
        raise ProtocolViolation("control frame shorter than its length prefix")
    (length,) = FRAME_PREFIX.unpack_from(slot)
    end = FRAME_PREFIX.size + length
    if end > len(slot):
        raise ProtocolViolation(f"control frame of {length} bytes does not fit its {len(slot)}-byte slot")
    return decode_control(memoryview(slot)[FRAME_PREFIX.size : end])


def decode_control(data: bytes | bytearray | memoryview) -> Control:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolViolation(f"not a transfer control message: {exc}") from exc


_Reply = TypeVar("_Reply", Verdict, Landed)


def expect_reply(message: Control, kind: type[_Reply]) -> _Reply:
    if not isinstance(message, kind):
        raise ProtocolViolation(f"expected {kind.__name__}, got {type(message).__name__}")
    return message


def raise_if_refused(reply: Verdict | Landed) -> None:
    """Translate a refusal from the receiver into ``TransferRejected``."""
    accepted = reply.accepted if isinstance(reply, Verdict) else reply.ok
    if not accepted:
        raise TransferRejected(reply.reason or "unspecified")


def verdict_for(result: object) -> Verdict:
    """The reply to an offer, from ``ExpectationTable.admit``'s result."""
    if isinstance(result, RejectReason):
        return Verdict(accepted=False, reason=result.value)
    return Verdict(accepted=True)


def landed_for(reason: RejectReason | None) -> Landed:
    return Landed(ok=True) if reason is None else Landed(ok=False, reason=reason.value)

"""The envelope around every bus message, and the codec that (de)serializes it.

An envelope carries the schema version, the producer, the event time (seconds
since the epoch, stamped by the producer) and the W3C ``traceparent`` of the
span that produced it. The body is one of the tagged message types. Decoding
is strict: an unknown tag, a missing field or a wrong type (an enum value no
member has included) raises a typed :class:`~schemas.errors.MalformedMessage`,
and :class:`Codec` counts it. An envelope of another schema version that does
not decode raises :class:`~schemas.errors.UnsupportedVersion`, naming the
version, the field and what changed (``schemas.base.SCHEMA_CHANGES``); one of
an older version that still decodes is accepted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, TypeVar

import msgspec

from schemas.base import SCHEMA_CHANGES, SCHEMA_VERSION
from schemas.decisions import DecisionEvent
from schemas.errors import (
    MalformedMessage,
    MissingField,
    NotDecodable,
    UnknownMessageType,
    UnsupportedVersion,
    WrongType,
)
from schemas.history import HistoryMessage
from schemas.instance import InstanceEvent
from schemas.kv_events import KVMessage
from schemas.load import LoadReport
from schemas.migration import MigrationEvent
from schemas.requests import RequestEvent
from schemas.rpc import RpcMessage
from schemas.tokens import TokenDelta, TokenDeltaBatch

__all__ = ["Body", "Codec", "Envelope", "decode_body", "encode_body"]

Body = (
    InstanceEvent
    | LoadReport
    | DecisionEvent
    | MigrationEvent
    | RequestEvent
    | RpcMessage
    | TokenDelta
    | HistoryMessage
    | TokenDeltaBatch
    | KVMessage
)

T = TypeVar("T")


class Envelope(msgspec.Struct, frozen=True, kw_only=True):
    body: Body
    producer: str = ""
    time: float = 0.0
    trace: str | None = None
    v: int = SCHEMA_VERSION


class _VersionOnly(msgspec.Struct):
    """An envelope read for its version alone (every other field is skipped)."""

    v: int = SCHEMA_VERSION


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_version_decoder = msgspec.msgpack.Decoder(_VersionOnly)


def _translate(exc: Exception) -> MalformedMessage:
    """Map msgspec's errors onto the typed tree."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        if text.startswith("Invalid value") and "type`" in text:
            return UnknownMessageType(text)
        if "missing required field" in text:
            return MissingField(text)
        return WrongType(text)
    return NotDecodable(text)


def _version_of(data: bytes) -> int | None:
    """The schema version an envelope says it has, if it is an envelope at all."""
    try:
        return _version_decoder.decode(data).v
    except Exception:  # not even an envelope: the caller's error stands
        return None


def _other_version(version: int, error: MalformedMessage) -> UnsupportedVersion:
    """The error for an envelope of another schema version whose body does not decode here."""
    if version > SCHEMA_VERSION:
        return UnsupportedVersion(
            f"schema version {version} is newer than supported {SCHEMA_VERSION} ({error.kind}: {error})",
            version=version,
        )
    later = range(version + 1, SCHEMA_VERSION + 1)
    changes = "; ".join(f"v{v} {SCHEMA_CHANGES[v]}" for v in later if v in SCHEMA_CHANGES)
    return UnsupportedVersion(
        f"schema version {version} no longer decodes under version {SCHEMA_VERSION} "
        f"({error.kind}: {error}); changed since: {changes}",
        version=version,
    )


def encode_body(body: Any) -> bytes:
    """Encode a bare message (no envelope), e.g. for RPC payloads in benchmarks."""
    return _encoder.encode(body)


def decode_body(data: bytes, type_: type[T]) -> T:
    """Decode a bare message of a known type, raising typed errors."""
    try:
        return msgspec.msgpack.decode(data, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _translate(exc) from exc


class Codec:
    """Encodes and decodes envelopes, and counts what it had to reject.

    One codec per component; ``rejected`` maps an error kind to how many
    messages of that kind were dropped.
    """

    def __init__(self, producer: str = "") -> None:
        self.producer = producer
        self.rejected: Counter[str] = Counter()

    def wrap(self, body: Body, *, time: float, trace: str | None = None) -> Envelope:
        return Envelope(body=body, producer=self.producer, time=time, trace=trace)

    def encode(self, body: Body, *, time: float, trace: str | None = None) -> bytes:
        return _encoder.encode(self.wrap(body, time=time, trace=trace))

    @staticmethod
    def encode_envelope(envelope: Envelope) -> bytes:
        return _encoder.encode(envelope)

    def decode(self, data: bytes) -> Envelope:
        """Decode an envelope; on failure count it and raise a typed error."""
        try:
            envelope = _envelope_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            error = _translate(exc)
            version = _version_of(data) if isinstance(exc, msgspec.ValidationError) else None
            if version is not None and version != SCHEMA_VERSION:
                error = _other_version(version, error)
            self.rejected[error.kind] += 1
            raise error from exc
        except Exception as exc:  # msgspec may raise others on pathological input
            error = NotDecodable(f"{type(exc).__name__}: {exc}")
            self.rejected[error.kind] += 1
            raise error from exc
        if envelope.v > SCHEMA_VERSION:
            self.rejected[UnsupportedVersion.kind] += 1
            raise UnsupportedVersion(
                f"schema version {envelope.v} is newer than supported {SCHEMA_VERSION}",
                version=envelope.v,
            )
        return envelope

    def decode_or_none(self, data: bytes) -> Envelope | None:
        """Decode, or count the failure and return None (for receive loops)."""
        try:
            return self.decode(data)
        except MalformedMessage:
            return None

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

"""The error tree for decoding wire messages.

``MalformedMessage`` is the base; callers catch it, count it and drop the
message. Subclasses say what was wrong.
"""

from __future__ import annotations

__all__ = [
    "MalformedMessage",
    "MissingField",
    "NotDecodable",
    "UnknownMessageType",
    "UnsupportedVersion",
    "WrongType",
]


class MalformedMessage(ValueError):
    """A payload that is not a valid shoal message."""

    kind = "malformed"


class NotDecodable(MalformedMessage):
    """The bytes are not valid msgpack (or JSON) at all."""

    kind = "not_decodable"


class UnknownMessageType(MalformedMessage):
    """The ``type`` tag names no known message."""

    kind = "unknown_type"


class MissingField(MalformedMessage):
    """A required field is absent."""

    kind = "missing_field"


class WrongType(MalformedMessage):
    """A field holds a value of the wrong type or out of range."""

    kind = "wrong_type"


class UnsupportedVersion(MalformedMessage):
    """The envelope's schema version is newer than this code understands, or older and its body
    no longer decodes (the message names the field and what changed since). ``version`` is the
    envelope's."""

    kind = "unsupported_version"

    def __init__(self, message: str, *, version: int | None = None) -> None:
        super().__init__(message)
        self.version = version

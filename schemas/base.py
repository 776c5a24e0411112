"""Base struct configuration shared by every wire message.

Every message that crosses the bus is a frozen, keyword-only ``msgspec.Struct``
tagged by a short string in the ``type`` field, so that families of messages can
be decoded as tagged unions. Nothing here does I/O.
"""

from __future__ import annotations

import msgspec

__all__ = ["SCHEMA_VERSION", "Message"]

#: Bumped when a message changes incompatibly. Decoders reject newer versions.
SCHEMA_VERSION = 1


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every wire message. Subclasses pass ``tag="..."``."""

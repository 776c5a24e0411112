"""Where a message sits in the log: a stream and its sequence there.

One type for the bus (where appends and reads return it) and the fold (which
checks that positions strictly increase). Pure data.
"""

from __future__ import annotations

import msgspec

__all__ = ["Position"]


class Position(msgspec.Struct, frozen=True):
    """A stream name and a sequence in it (from 1, strictly increasing)."""

    stream: str
    seq: int

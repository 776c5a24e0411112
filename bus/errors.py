"""The bus layer's one error tree.

Every error the bus raises is a :class:`BusError`. The JetStream adapter
translates nats-py's exceptions at the seam (``raise RequestTimeout(...) from
exc``), and the in-memory bus raises the same classes in the same situations,
so callers never import ``nats``. Nothing here does I/O.

::

    BusError
    ├── NotConnected            no connection (not yet connected, closed, or the server is unreachable)
    ├── InvalidName             a subject, stream name or KV key that NATS would reject (also a ValueError)
    ├── BusTimeout              a deadline passed (also a builtin TimeoutError)
    │   └── RequestTimeout      a request got no reply in time
    ├── NoResponders            a request reached no subscriber at all
    ├── HandlerFailed           the serving side's handler raised; carries its message
    ├── AppendFailed            the stream refused an append (e.g. message too large)
    │   └── AppendTimeout       no ack before the append's deadline (also a BusTimeout)
    ├── StreamNotFound          no such stream, or no stream captures the subject
    ├── KeyConflict             a KV compare-and-set found another revision (or create found the key)
    │   └── KeyNotFound         a compare-and-set expected a key that does not exist
    └── SequenceGap             a reader that needs contiguous positions saw one skipped
"""

from __future__ import annotations

__all__ = [
    "AppendFailed",
    "AppendTimeout",
    "BusError",
    "BusTimeout",
    "HandlerFailed",
    "InvalidName",
    "KeyConflict",
    "KeyNotFound",
    "NoResponders",
    "NotConnected",
    "RequestTimeout",
    "SequenceGap",
    "StreamNotFound",
]


class BusError(Exception):
    """Base of every error raised by the bus layer."""


class NotConnected(BusError):
    """The bus is not connected: ``connect()`` was not called, failed, or ``close()`` ran."""


class InvalidName(BusError, ValueError):
    """A subject, stream name or KV key that NATS would reject."""


class BusTimeout(BusError, TimeoutError):
    """A deadline passed before the operation completed."""


class RequestTimeout(BusTimeout):
    """A request reached a responder (or may have) but no reply came in time."""


class NoResponders(BusError):
    """A request was published on a subject nobody subscribes to."""


class HandlerFailed(BusError):
    """The handler serving a request raised; ``remote`` is its ``"Type: message"`` text."""

    def __init__(self, subject: str, remote: str) -> None:
        super().__init__(f"handler for {subject!r} failed: {remote}")
        self.subject = subject
        self.remote = remote


class AppendFailed(BusError):
    """The stream refused an append; ``code``/``err_code`` are the JetStream error codes if any."""

    def __init__(self, message: str, *, code: int = 0, err_code: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.err_code = err_code


class AppendTimeout(AppendFailed, BusTimeout):
    """No acknowledgement before the append's deadline.

    The message may still have been stored: retrying with the same message id
    within the stream's duplicate window stores it at most once.
    """


class StreamNotFound(BusError):
    """The named stream does not exist, or no stream captures an appended subject."""


class KeyConflict(BusError):
    """A KV write expected a revision (or absence) and found something else."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key!r}: {message}")
        self.key = key


class KeyNotFound(KeyConflict):
    """A compare-and-set expected a revision of a key that does not exist (or was deleted)."""


class SequenceGap(BusError):
    """A reader that requires contiguous positions saw a sequence skipped.

    The bus itself delivers every retained message of a stream in order; folds
    over a stream (the scheduler's) raise this when they see ``seq`` jump.
    """

    def __init__(self, stream: str, expected: int, got: int) -> None:
        super().__init__(f"stream {stream!r}: expected sequence {expected}, got {got}")
        self.stream = stream
        self.expected = expected
        self.got = got

"""The error tree of the KV data plane.

``TransportError`` is the base every transport raises; lower-layer errors
(``OSError`` from sockets, ``ucxx`` exceptions, ``asyncio.TimeoutError``) are
translated into one of its subclasses at the seam, with the original kept as
``__cause__``. Programming errors (a header whose ``nbytes`` does not match
the payload, an ``into`` buffer of the wrong size) are plain ``ValueError``.
"""

from __future__ import annotations

__all__ = [
    "InvalidAddress",
    "PeerUnreachable",
    "ProtocolViolation",
    "TransferCancelled",
    "TransferRejected",
    "TransferTimeout",
    "TransportClosed",
    "TransportError",
    "TransportUnavailable",
]


class TransportError(Exception):
    """Base of every error the KV data plane raises."""


class TransportUnavailable(TransportError):
    """This kind of transport cannot run here (library missing or failing to initialise)."""


class TransportClosed(TransportError):
    """The transport is not started, or was closed."""


class InvalidAddress(TransportError, ValueError):
    """An address that does not name an endpoint of this transport kind."""


class PeerUnreachable(TransportError):
    """The destination cannot be reached, or the connection broke mid-transfer."""


class TransferTimeout(TransportError, TimeoutError):
    """A send or an expected buffer did not complete in time."""


class TransferCancelled(TransportError):
    """The expectation was cancelled (``cancel(migration_id)``) before the buffer landed."""


class TransferRejected(TransportError):
    """The receiver refused the buffer (stray, wrong size, cancelled, ...).

    ``reason`` is one of the ``RejectReason`` values; ``detail`` is for humans.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"transfer rejected: {reason}" + (f" ({detail})" if detail else ""))
        self.reason = reason
        self.detail = detail


class ProtocolViolation(TransportError):
    """The peer sent something that is not the transfer protocol."""

"""The KV data plane: moving fused KV-block buffers between agents (UCX, TCP, in-process).

Agents use it through ``open_transport(TransportConfig(...))`` and the
``KVTransport`` protocol: the destination ``expect``s a buffer per migration
stage, the source ``send``s it; strays are refused and counted. ``ucxx`` is
imported only when a UCX transport starts.
"""

from transport.base import Payload, RejectReason, TransferHeader, TransportStats, WritableBuffer
from transport.config import TransportConfig, TransportKind
from transport.errors import (
    InvalidAddress,
    PeerUnreachable,
    ProtocolViolation,
    TransferCancelled,
    TransferRejected,
    TransferTimeout,
    TransportClosed,
    TransportError,
    TransportUnavailable,
)
from transport.factory import create_transport, open_transport, transport_for_address
from transport.protocol import KVTransport
from transport.receiving import PendingTransfer

__all__ = [
    "InvalidAddress",
    "KVTransport",
    "Payload",
    "PeerUnreachable",
    "PendingTransfer",
    "ProtocolViolation",
    "RejectReason",
    "TransferCancelled",
    "TransferHeader",
    "TransferRejected",
    "TransferTimeout",
    "TransportClosed",
    "TransportConfig",
    "TransportError",
    "TransportKind",
    "TransportStats",
    "TransportUnavailable",
    "WritableBuffer",
    "create_transport",
    "open_transport",
    "transport_for_address",
]

#: Marks this top-level package as shoal's own; `shoal` checks it at start-up (frontend/packages.py).
__shoal_package__ = True

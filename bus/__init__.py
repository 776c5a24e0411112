"""The NATS / JetStream adapter: streams, appends, replay, RPC, KV, and the embedded server.

Components talk to the :class:`Bus` port (``bus.protocol``): ``JetStreamBus``
on a real nats-server, ``MemoryBus`` in process (unit tests of pure logic and
the simulator). Both raise the errors of ``bus.errors``; ``bus.tracing`` puts
W3C trace context into headers. The bus moves bytes and knows nothing of what
the payloads mean.
"""

from bus.auth import NatsAuth
from bus.errors import (
    AppendFailed,
    AppendTimeout,
    BusError,
    BusTimeout,
    HandlerFailed,
    InvalidName,
    KeyConflict,
    KeyNotFound,
    NoResponders,
    NotConnected,
    RequestTimeout,
    SequenceGap,
    StreamNotFound,
)
from bus.jetstream import JetStreamBus
from bus.memory import MemoryBroker, MemoryBus
from bus.protocol import (
    ERROR_HEADER,
    EXPECTED_LAST_SUBJECT_SEQ_HEADER,
    MSG_ID_HEADER,
    Appender,
    Bus,
    BusConfig,
    BusMessage,
    Handler,
    KvBucket,
    KvChange,
    KvEntry,
    MessageFeed,
    Position,
    Service,
    StoredMessage,
    StreamConfig,
    Subscription,
)

__all__ = [
    "ERROR_HEADER",
    "EXPECTED_LAST_SUBJECT_SEQ_HEADER",
    "MSG_ID_HEADER",
    "AppendFailed",
    "AppendTimeout",
    "Appender",
    "Bus",
    "BusConfig",
    "BusError",
    "BusMessage",
    "BusTimeout",
    "Handler",
    "HandlerFailed",
    "InvalidName",
    "JetStreamBus",
    "KeyConflict",
    "KeyNotFound",
    "KvBucket",
    "KvChange",
    "KvEntry",
    "MemoryBroker",
    "MemoryBus",
    "MessageFeed",
    "NatsAuth",
    "NoResponders",
    "NotConnected",
    "Position",
    "RequestTimeout",
    "SequenceGap",
    "Service",
    "StoredMessage",
    "StreamConfig",
    "StreamNotFound",
    "Subscription",
]

#: Marks this top-level package as shoal's own; `shoal` checks it at start-up (frontend/packages.py).
__shoal_package__ = True

"""The ``Bus`` port: what every shoal component may ask of the message bus.

Holds the protocol (``typing.Protocol``) that both implementations satisfy —
:class:`bus.jetstream.JetStreamBus` on a real NATS server and
:class:`bus.memory.MemoryBus` in process — the small immutable values that
cross it (:class:`Position`, :class:`StoredMessage`, :class:`BusMessage`,
:class:`KvEntry`, :class:`KvChange`) and the frozen configuration
(:class:`StreamConfig`, :class:`BusConfig`). The bus moves bytes: it knows
stream and subject names from :class:`schemas.Subjects` and nothing about what
the payloads mean. No I/O lives here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import NamedTuple, Protocol, Self, TypeVar

import msgspec

from bus.auth import NatsAuth
from schemas.position import Position
from schemas.subjects import Subjects

__all__ = [
    "ERROR_HEADER",
    "EXPECTED_LAST_SUBJECT_SEQ_HEADER",
    "MSG_ID_HEADER",
    "Appender",
    "Bus",
    "BusConfig",
    "BusMessage",
    "Handler",
    "KvBucket",
    "KvChange",
    "KvEntry",
    "MessageFeed",
    "Position",
    "Service",
    "StoredMessage",
    "StreamConfig",
    "Subscription",
]

T_co = TypeVar("T_co", covariant=True)

#: JetStream de-duplicates appends carrying the same value within the duplicate window.
MSG_ID_HEADER = "Nats-Msg-Id"
#: An append carrying this header is refused (:class:`bus.errors.AppendFailed`, ``err_code`` 10071)
#: unless the last message on its subject has exactly this sequence ("0": the subject is empty).
#: The server checks it *before* de-duplication: a retry of a conditional append that was stored
#: (ack lost) is refused too, so read the subject back to learn whether yours won.
EXPECTED_LAST_SUBJECT_SEQ_HEADER = "Nats-Expected-Last-Subject-Sequence"
#: Set on a reply whose handler raised; the requester raises :class:`bus.errors.HandlerFailed`.
ERROR_HEADER = "Shoal-Error"

#: Serves one request: ``handler(data, headers)`` returns the reply payload, or an awaitable of it.
#: A plain function (it answers at once) is run where the request arrives, with no task of its own.
Handler = Callable[[bytes, dict[str, str]], Awaitable[bytes] | bytes]


class StoredMessage(msgspec.Struct, frozen=True):
    """A message read back from a stream. ``time`` is when the server stored it (epoch seconds)."""

    subject: str
    data: bytes
    headers: dict[str, str]
    position: Position
    time: float


class BusMessage(msgspec.Struct, frozen=True):
    """A core-NATS message (subscription delivery or request reply); ``reply`` is "" if none."""

    subject: str
    data: bytes
    headers: dict[str, str]
    reply: str = ""


class KvEntry(NamedTuple):
    """The current value of a key and its revision (unpacks as ``value, revision``)."""

    value: bytes
    revision: int


class KvBucket(Protocol):
    """A key-value bucket of its own beside the bus's (:meth:`Bus.kv_bucket`): an entry expires
    ``max_age`` seconds after its last write; a deleted, expired or never written key reads None."""

    @property
    def name(self) -> str: ...

    @property
    def max_age(self) -> float: ...

    async def get(self, key: str) -> KvEntry | None: ...

    async def put(self, key: str, value: bytes) -> int: ...

    async def delete(self, key: str) -> None: ...


class KvChange(msgspec.Struct, frozen=True):
    """One change seen by a KV watch; ``value`` is None when the key was deleted."""

    key: str
    value: bytes | None
    revision: int

    @property
    def deleted(self) -> bool:
        return self.value is None


@dataclass(frozen=True)
class StreamConfig:
    """Retention of the four streams and the KV bucket (seconds for ages and windows).

    ``events`` keeps history by age. ``loads`` is bounded by age *and* by
    ``loads_max_msgs_per_subject`` reports per instance (one subject each).
    ``history`` (archived load reports and state checkpoints, see
    ``schemas.history``) keeps ``history_max_age``: the window a replay can
    rebuild, plus one checkpoint interval.
    ``duplicate_window`` is how long a message id is remembered for de-duplication.
    """

    events_max_age: float = 7 * 24 * 3600.0
    loads_max_age: float = 3600.0
    loads_max_msgs_per_subject: int = 100
    history_max_age: float = 24 * 3600.0 + 900.0
    #: prefix-cache events (``<prefix>_kv``): kept as long as the history, and at most this many
    #: bytes (the oldest dropped first; an agent's periodic full batch is the restart point)
    kv_max_age: float = 24 * 3600.0 + 900.0
    kv_max_bytes: int = 1 << 30
    duplicate_window: float = 120.0
    kv_history: int = 1
    replicas: int = 1

    def __post_init__(self) -> None:
        if min(self.events_max_age, self.loads_max_age, self.history_max_age, self.kv_max_age) <= 0:
            raise ValueError("stream max ages must be positive")
        if self.kv_max_bytes < 1:
            raise ValueError("kv_max_bytes must be >= 1")
        if self.loads_max_msgs_per_subject < 1:
            raise ValueError("loads_max_msgs_per_subject must be >= 1")
        if (
            not 0
            < self.duplicate_window
            <= min(self.events_max_age, self.loads_max_age, self.history_max_age)
        ):
            raise ValueError("duplicate_window must be positive and not exceed any stream's max age")
        if not 1 <= self.kv_history <= 64:
            raise ValueError("kv_history must be in [1, 64]")
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")


@dataclass(frozen=True)
class BusConfig:
    """How to reach NATS and how patient to be. Passed in; nothing reads the environment.

    ``url`` may list several servers separated by commas. ``connect()`` tries
    each ``connect_attempts`` times (-1: until it succeeds) and then raises;
    once connected, reconnection never gives up by default
    (``max_reconnect_attempts=-1``). An append is resent
    with the same message id every ``ack_timeout`` seconds until acknowledged
    or until its deadline (``append_timeout`` unless the call passes one),
    which must stay inside the duplicate window so a resend is stored once.
    ``heartbeat`` is the idle heartbeat of replay/tail/watch consumers; a
    consumer silent for three heartbeats is recreated where it left off. A
    core subscription buffers up to ``subscription_buffer`` messages and drops
    (and counts) the rest.
    """

    url: str = "nats://127.0.0.1:4222"
    auth: NatsAuth = field(default_factory=NatsAuth)
    subjects: Subjects = field(default_factory=Subjects)
    streams: StreamConfig = field(default_factory=StreamConfig)
    name: str = "shoal"
    provision: bool = True
    connect_timeout: float = 5.0
    connect_attempts: int = 3
    reconnect_time_wait: float = 0.25
    max_reconnect_attempts: int = -1
    reconnect_buffer_bytes: int = 8 * 1024 * 1024
    ping_interval: float = 10.0
    max_outstanding_pings: int = 3
    api_timeout: float = 5.0
    ack_timeout: float = 2.0
    append_timeout: float = 30.0
    heartbeat: float = 2.0
    subscription_buffer: int = 65_536

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("url must name at least one server")
        for name in (
            "connect_timeout",
            "reconnect_time_wait",
            "api_timeout",
            "ack_timeout",
            "append_timeout",
            "heartbeat",
            "ping_interval",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.connect_attempts == 0 or self.connect_attempts < -1:
            raise ValueError("connect_attempts must be positive or -1")
        if self.subscription_buffer < 1:
            raise ValueError("subscription_buffer must be >= 1")
        if self.append_timeout >= self.streams.duplicate_window:
            raise ValueError("append_timeout must be shorter than the duplicate window")

    @property
    def servers(self) -> list[str]:
        return [part.strip() for part in self.url.split(",") if part.strip()]


class MessageFeed(Protocol[T_co]):
    """An async iterator of messages that must be closed: ``async with feed: async for m in feed``.

    Leaving the ``async with`` block (or ``await feed.aclose()``) releases the
    server-side consumer or subscription; iteration then stops.
    """

    def __aiter__(self) -> AsyncIterator[T_co]: ...

    async def __anext__(self) -> T_co: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class Subscription(MessageFeed[BusMessage], Protocol):
    """A core-NATS subscription; ``unsubscribe()`` ends the iteration. ``num_dropped`` counts overflow."""

    @property
    def subject(self) -> str: ...

    @property
    def num_dropped(self) -> int: ...

    async def unsubscribe(self) -> None: ...


class Service(Protocol):
    """A running request handler (from :meth:`Bus.serve`); ``stop()`` unsubscribes and waits."""

    @property
    def subject(self) -> str: ...

    @property
    def num_handled(self) -> int: ...

    @property
    def num_failed(self) -> int: ...

    async def stop(self) -> None: ...


class Appender(Protocol):
    """Pipelined appends: many in flight, each resolving to its :class:`Position`.

    ``await pipe.append(...)`` waits for a free slot (at most ``max_in_flight``
    unacknowledged) and returns a future of the position. ``flush()`` waits for
    every append so far and raises :class:`bus.errors.AppendFailed` if any of
    them failed. Leaving ``async with`` flushes.
    """

    @property
    def num_in_flight(self) -> int: ...

    async def append(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Awaitable[Position]: ...

    async def flush(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class Bus(Protocol):
    """The message bus: durable appends and replay, core pub/sub, request/reply and a KV bucket.

    Streams: ``config.subjects.events_stream`` captures ``<prefix>.ev.>`` and
    ``config.subjects.loads_stream`` captures ``<prefix>.load.*``; the KV bucket
    is ``config.subjects.kv_bucket``. Timeouts are float seconds; ``None``
    means the configured default.
    """

    @property
    def config(self) -> BusConfig: ...

    @property
    def is_connected(self) -> bool: ...

    async def connect(self) -> None: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    # -- durable log -------------------------------------------------------
    async def append(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Position:
        """Store ``data`` in the stream capturing ``subject``; a retry with the same msg_id stores once."""
        ...

    def appender(self, *, max_in_flight: int = 256, timeout: float | None = None) -> Appender: ...

    def replay(
        self,
        stream: str,
        *,
        from_seq: int = 1,
        until_seq: int | None = None,
        subjects: Sequence[str] | None = None,
    ) -> MessageFeed[StoredMessage]:
        """Messages of ``stream`` in sequence order, from ``from_seq`` up to ``until_seq``.

        ``until_seq`` defaults to the stream's last sequence when iteration
        starts (the feed opens lazily), so a replay always ends. ``subjects``
        are filters with wildcards; messages that aged out are simply absent.
        """
        ...

    def tail(
        self, stream: str, *, from_seq: int | None = None, subjects: Sequence[str] | None = None
    ) -> MessageFeed[StoredMessage]:
        """Messages of ``stream`` as they arrive, from ``from_seq`` (default: those after the last one
        when iteration starts); never ends by itself and survives server restarts without gaps."""
        ...

    async def last_seq(self, stream: str) -> int: ...

    async def seq_at_time(self, stream: str, at: float) -> int | None:
        """The sequence of the first message of ``stream`` stored at or after ``at`` (epoch seconds),
        found by the server; None if there is none."""
        ...

    # -- core NATS ---------------------------------------------------------
    async def publish(
        self, subject: str, data: bytes, *, headers: Mapping[str, str] | None = None
    ) -> None: ...

    async def subscribe(self, subject: str, *, queue: str | None = None) -> Subscription: ...

    async def request(
        self, subject: str, data: bytes, *, timeout: float, headers: Mapping[str, str] | None = None
    ) -> BusMessage: ...

    async def serve(self, subject: str, handler: Handler, *, queue: str | None = None) -> Service: ...

    # -- key-value ---------------------------------------------------------
    async def kv_get(self, key: str) -> KvEntry | None: ...

    async def kv_put(self, key: str, value: bytes) -> int: ...

    async def kv_create(self, key: str, value: bytes) -> int: ...

    async def kv_update(self, key: str, value: bytes, *, last_revision: int) -> int: ...

    async def kv_delete(self, key: str) -> None: ...

    def kv_watch(self, pattern: str = ">") -> MessageFeed[KvChange]: ...

    async def kv_bucket(self, name: str, *, max_age: float) -> KvBucket:
        """The bucket ``name``, created if missing (one bucket per name, whoever asks first), its
        entries kept ``max_age`` seconds after their last write (a bucket found with another age is
        set to this one)."""
        ...

"""The in-memory bus: the :class:`bus.protocol.Bus` port without a server.

For unit tests of pure logic and for the simulator. A :class:`MemoryBroker`
holds what a NATS server would (streams, core subscriptions, the KV bucket);
any number of :class:`MemoryBus` handles share one broker, as processes share
a server. Semantics follow JetStream: per-stream sequences from 1, subject
filters with ``*`` and ``>``, message-id de-duplication inside the duplicate
window (a duplicate returns the original position), max age and max messages
per subject, core publishes on captured subjects stored too, request/reply
with no-responders and timeouts, KV revisions shared by the bucket, CAS, and
watches that start with the current values. Ages use the broker's ``clock``
(the simulator passes its virtual clock); request timeouts use asyncio time.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from bus.errors import (
    AppendFailed,
    HandlerFailed,
    KeyConflict,
    KeyNotFound,
    NoResponders,
    NotConnected,
    RequestTimeout,
    StreamNotFound,
)
from bus.flow import CoreSubscription, Feed, Pipeline, RequestService
from bus.protocol import (
    ERROR_HEADER,
    EXPECTED_LAST_SUBJECT_SEQ_HEADER,
    MSG_ID_HEADER,
    BusConfig,
    BusMessage,
    Handler,
    KvBucket,
    KvChange,
    KvEntry,
    Position,
    StoredMessage,
)
from bus.wildcards import subject_matches, validate_key, validate_key_pattern, validate_subject

__all__ = ["MemoryBroker", "MemoryBus"]

Listener = Callable[[StoredMessage], None]


@dataclass
class _MemoryStream:
    name: str
    subjects: tuple[str, ...]
    max_age: float
    max_msgs_per_subject: int  # 0: unlimited
    duplicate_window: float
    messages: dict[int, StoredMessage] = field(default_factory=dict)
    last_seq: int = 0
    per_subject: dict[str, deque[int]] = field(default_factory=dict)
    dedupe: dict[str, tuple[int, float]] = field(default_factory=dict)
    listeners: list[Listener] = field(default_factory=list)

    def captures(self, subject: str) -> bool:
        return any(subject_matches(pattern, subject) for pattern in self.subjects)

    def expire(self, now: float) -> None:
        horizon = now - self.max_age
        while self.messages:
            seq, message = next(iter(self.messages.items()))
            if message.time >= horizon:
                break
            self._remove(seq)
        window = now - self.duplicate_window
        while self.dedupe:
            msg_id, (_, stored_at) = next(iter(self.dedupe.items()))
            if stored_at >= window:
                break
            del self.dedupe[msg_id]

    def _remove(self, seq: int) -> None:
        message = self.messages.pop(seq)
        seqs = self.per_subject[message.subject]
        seqs.remove(seq)
        if not seqs:
            del self.per_subject[message.subject]

    def store(self, subject: str, data: bytes, headers: dict[str, str], now: float) -> Position:
        self.expire(now)
        expected = headers.get(EXPECTED_LAST_SUBJECT_SEQ_HEADER)
        if expected is not None:  # checked before de-duplication, as nats-server does
            held = self.per_subject.get(subject)
            last = held[-1] if held else 0
            if int(expected) != last:
                reason = f"wrong last sequence: {last} on {subject!r}, expected {expected}"
                raise AppendFailed(reason, code=400, err_code=10071)
        msg_id = headers.get(MSG_ID_HEADER)
        if msg_id is not None and msg_id in self.dedupe:
            return Position(self.name, self.dedupe[msg_id][0])
        self.last_seq += 1
        position = Position(self.name, self.last_seq)
        message = StoredMessage(subject, data, headers, position, now)
        self.messages[self.last_seq] = message
        seqs = self.per_subject.setdefault(subject, deque())
        seqs.append(self.last_seq)
        if self.max_msgs_per_subject and len(seqs) > self.max_msgs_per_subject:
            self._remove(seqs[0])
        if msg_id is not None:
            self.dedupe[msg_id] = (self.last_seq, now)
        for listener in list(self.listeners):
            listener(message)
        return position

    def scan(self, from_seq: int, until_seq: int) -> Iterator[StoredMessage]:
        if not self.messages:
            return
        first = next(iter(self.messages))
        for seq in range(max(from_seq, first), min(until_seq, self.last_seq) + 1):
            message = self.messages.get(seq)
            if message is not None:
                yield message


@dataclass
class _CoreSubscriber:
    pattern: str
    queue: str
    deliver: Callable[[BusMessage], object]


@dataclass
class _Bucket:
    revision: int = 0
    entries: dict[str, tuple[bytes | None, int]] = field(default_factory=dict)
    #: when each key was last written (the broker's clock): ages of the buckets with a max age
    written: dict[str, float] = field(default_factory=dict)
    max_age: float | None = None
    watchers: list[tuple[str, Feed[KvChange]]] = field(default_factory=list)

    def write(self, key: str, value: bytes | None) -> int:
        self.revision += 1
        self.entries[key] = (value, self.revision)
        change = KvChange(key, value, self.revision)
        for pattern, feed in list(self.watchers):
            if subject_matches(pattern, key):
                feed.push(change)
        return self.revision


class MemoryBroker:
    """What a NATS server holds, in process: streams, subscriptions, KV buckets."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._streams: dict[str, _MemoryStream] = {}
        self._subscribers: list[_CoreSubscriber] = []
        self._buckets: dict[str, _Bucket] = {}
        self._queue_turns: dict[tuple[str, str], int] = {}
        self._inbox_ids = itertools.count(1)

    def ensure_stream(
        self,
        name: str,
        subjects: Sequence[str],
        *,
        max_age: float,
        max_msgs_per_subject: int = 0,
        duplicate_window: float,
    ) -> None:
        """Create the stream, or update its limits if it exists (messages are kept)."""
        stream = self._streams.get(name)
        if stream is None:
            self._streams[name] = _MemoryStream(
                name, tuple(subjects), max_age, max_msgs_per_subject, duplicate_window
            )
            return
        stream.subjects = tuple(subjects)
        stream.max_age = max_age
        stream.max_msgs_per_subject = max_msgs_per_subject
        stream.duplicate_window = duplicate_window

    def ensure_bucket(self, name: str) -> None:
        self._buckets.setdefault(name, _Bucket())

    def stream(self, name: str) -> _MemoryStream:
        stream = self._streams.get(name)
        if stream is None:
            raise StreamNotFound(f"stream {name!r} not found")
        stream.expire(self.clock())
        return stream

    def bucket(self, name: str) -> _Bucket:
        return self._buckets[name]

    def capturing_stream(self, subject: str) -> _MemoryStream | None:
        for stream in self._streams.values():
            if stream.captures(subject):
                return stream
        return None

    def new_inbox(self) -> str:
        return f"_INBOX.memory.{next(self._inbox_ids)}"

    def add_subscriber(self, subscriber: _CoreSubscriber) -> Callable[[], None]:
        self._subscribers.append(subscriber)

        def remove() -> None:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

        return remove

    def deliver(self, subject: str, data: bytes, headers: dict[str, str], reply: str = "") -> int:
        """Hand a core message to every matching subscriber (one per queue group); how many got it."""
        message = BusMessage(subject, data, headers, reply)
        groups: dict[str, list[_CoreSubscriber]] = {}
        receivers = 0
        for subscriber in list(self._subscribers):
            if not subject_matches(subscriber.pattern, subject):
                continue
            if subscriber.queue:
                groups.setdefault(subscriber.queue, []).append(subscriber)
            else:
                subscriber.deliver(message)
                receivers += 1
        for queue, members in sorted(groups.items(), key=lambda item: item[0]):
            turn = self._queue_turns.get((subject, queue), 0)
            self._queue_turns[(subject, queue)] = turn + 1
            members[turn % len(members)].deliver(message)
            receivers += 1
        return receivers


class MemoryBus:
    """A :class:`bus.protocol.Bus` on a :class:`MemoryBroker` (a private one unless given)."""

    def __init__(self, config: BusConfig | None = None, *, broker: MemoryBroker | None = None) -> None:
        self._config = config or BusConfig()
        self.broker = broker or MemoryBroker()
        self._connected = False
        self._feeds: set[Feed[StoredMessage] | Feed[KvChange] | CoreSubscription] = set()
        self._services: set[RequestService] = set()

    @property
    def config(self) -> BusConfig:
        return self._config

    @property
    def is_connected(self) -> bool:
        return self._connected

    async def connect(self) -> None:
        subjects, streams = self._config.subjects, self._config.streams
        if self._config.provision:
            self.broker.ensure_stream(
                subjects.events_stream,
                [subjects.events_all],
                max_age=streams.events_max_age,
                duplicate_window=streams.duplicate_window,
            )
            self.broker.ensure_stream(
                subjects.loads_stream,
                [subjects.loads_all],
                max_age=streams.loads_max_age,
                max_msgs_per_subject=streams.loads_max_msgs_per_subject,
                duplicate_window=streams.duplicate_window,
            )
            self.broker.ensure_stream(
                subjects.history_stream,
                [subjects.history_all],
                max_age=streams.history_max_age,
                duplicate_window=streams.duplicate_window,
            )
            self.broker.ensure_stream(
                subjects.kv_stream,
                [subjects.kv_all],
                max_age=streams.kv_max_age,
                duplicate_window=streams.duplicate_window,
            )
            self.broker.ensure_bucket(subjects.kv_bucket)
        self._connected = True

    async def close(self) -> None:
        if not self._connected:
            return
        for service in list(self._services):
            await service.stop()
        for feed in list(self._feeds):
            await feed.aclose()
        self._connected = False

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _check(self) -> None:
        if not self._connected:
            raise NotConnected("memory bus is not connected")

    # -- durable log -------------------------------------------------------------
    def _store(self, subject: str, data: bytes, headers: dict[str, str]) -> Position | None:
        stream = self.broker.capturing_stream(subject)
        if stream is None:
            return None
        return stream.store(subject, data, headers, self.broker.clock())

    async def append(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Position:
        self._check()
        validate_subject(subject)
        all_headers = dict(headers) if headers else {}
        all_headers[MSG_ID_HEADER] = msg_id or f"memory-{next(_msg_ids)}"
        position = self._store(subject, bytes(data), all_headers)
        if position is None:
            raise StreamNotFound(f"no stream captures subject {subject!r}")
        self.broker.deliver(subject, bytes(data), all_headers)
        return position

    async def _submit(
        self, subject: str, data: bytes, msg_id: str | None, headers: Mapping[str, str] | None, timeout: float
    ) -> asyncio.Future[Position]:
        future: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
        try:
            future.set_result(await self.append(subject, data, msg_id=msg_id, headers=headers))
        except NotConnected:
            raise
        except Exception as exc:
            future.set_exception(exc)
        return future

    def appender(self, *, max_in_flight: int = 256, timeout: float | None = None) -> Pipeline:
        return Pipeline(
            self._submit, max_in_flight=max_in_flight, timeout=timeout or self._config.append_timeout
        )

    def _track(self, feed: Feed[StoredMessage]) -> Feed[StoredMessage]:
        self._feeds.add(feed)
        return feed

    def replay(
        self,
        stream: str,
        *,
        from_seq: int = 1,
        until_seq: int | None = None,
        subjects: Sequence[str] | None = None,
    ) -> Feed[StoredMessage]:
        self._check()
        filters = _filters(subjects)

        async def open_replay() -> None:
            source = self.broker.stream(stream)
            last = source.last_seq if until_seq is None else until_seq
            for message in source.scan(from_seq, last):
                if filters is None or any(subject_matches(p, message.subject) for p in filters):
                    feed.push(message)
            feed.finish()

        feed: Feed[StoredMessage] = Feed(opener=open_replay, closer=lambda: self._untrack(feed))
        return self._track(feed)

    def tail(
        self, stream: str, *, from_seq: int | None = None, subjects: Sequence[str] | None = None
    ) -> Feed[StoredMessage]:
        self._check()
        filters = _filters(subjects)

        def listener(message: StoredMessage) -> None:
            if filters is None or any(subject_matches(p, message.subject) for p in filters):
                feed.push(message)

        async def open_tail() -> None:
            source = self.broker.stream(stream)
            if from_seq is not None:
                for message in source.scan(from_seq, source.last_seq):
                    listener(message)
            source.listeners.append(listener)

        async def close_tail() -> None:
            source = self.broker._streams.get(stream)
            if source is not None and listener in source.listeners:
                source.listeners.remove(listener)
            await self._untrack(feed)

        feed: Feed[StoredMessage] = Feed(opener=open_tail, closer=close_tail)
        return self._track(feed)

    async def _untrack(self, feed: Feed[StoredMessage] | Feed[KvChange] | CoreSubscription) -> None:
        self._feeds.discard(feed)

    async def last_seq(self, stream: str) -> int:
        self._check()
        return self.broker.stream(stream).last_seq

    async def seq_at_time(self, stream: str, at: float) -> int | None:
        self._check()
        source = self.broker.stream(stream)
        return next((m.position.seq for m in source.scan(1, source.last_seq) if m.time >= at), None)

    # -- core NATS -----------------------------------------------------------------
    async def publish(self, subject: str, data: bytes, *, headers: Mapping[str, str] | None = None) -> None:
        self._check()
        validate_subject(subject)
        all_headers = dict(headers) if headers else {}
        self._store(subject, bytes(data), all_headers)
        self.broker.deliver(subject, bytes(data), all_headers)

    async def subscribe(self, subject: str, *, queue: str | None = None) -> CoreSubscription:
        self._check()
        validate_subject(subject, wildcards=True)
        remove: Callable[[], None] = lambda: None  # noqa: E731

        async def close_subscription() -> None:
            remove()
            await self._untrack(subscription)

        subscription = CoreSubscription(
            subject, closer=close_subscription, max_buffered=self._config.subscription_buffer
        )
        remove = self.broker.add_subscriber(_CoreSubscriber(subject, queue or "", subscription.push))
        self._feeds.add(subscription)
        return subscription

    async def request(
        self, subject: str, data: bytes, *, timeout: float, headers: Mapping[str, str] | None = None
    ) -> BusMessage:
        self._check()
        validate_subject(subject)
        inbox = self.broker.new_inbox()
        future: asyncio.Future[BusMessage] = asyncio.get_running_loop().create_future()

        def on_reply(message: BusMessage) -> None:
            if not future.done():
                future.set_result(message)

        remove = self.broker.add_subscriber(_CoreSubscriber(inbox, "", on_reply))
        try:
            if not self.broker.deliver(subject, bytes(data), dict(headers) if headers else {}, inbox):
                raise NoResponders(f"no responders on {subject!r}")
            try:
                async with asyncio.timeout(timeout):
                    reply = await future
            except TimeoutError as exc:
                raise RequestTimeout(f"no reply on {subject!r} within {timeout}s") from exc
        finally:
            remove()
        if ERROR_HEADER in reply.headers:
            raise HandlerFailed(subject, reply.headers[ERROR_HEADER])
        return reply

    async def serve(self, subject: str, handler: Handler, *, queue: str | None = None) -> RequestService:
        self._check()
        validate_subject(subject, wildcards=True)

        async def reply(to: str, data: bytes, headers: Mapping[str, str] | None) -> None:
            self.broker.deliver(to, data, dict(headers) if headers else {})

        service = RequestService(subject, handler, reply)
        remove = self.broker.add_subscriber(_CoreSubscriber(subject, queue or "", service.dispatch))

        async def stop() -> None:
            remove()
            self._services.discard(service)

        service.bind_stopper(stop)
        self._services.add(service)
        return service

    # -- key-value -----------------------------------------------------------------
    def _bucket(self) -> _Bucket:
        self._check()
        return self.broker.bucket(self._config.subjects.kv_bucket)

    async def kv_get(self, key: str) -> KvEntry | None:
        validate_key(key)
        value, revision = self._bucket().entries.get(key, (None, 0))
        return None if value is None else KvEntry(value, revision)

    async def kv_put(self, key: str, value: bytes) -> int:
        validate_key(key)
        return self._bucket().write(key, bytes(value))

    async def kv_create(self, key: str, value: bytes) -> int:
        validate_key(key)
        bucket = self._bucket()
        if bucket.entries.get(key, (None, 0))[0] is not None:
            raise KeyConflict(key, "key exists")
        return bucket.write(key, bytes(value))

    async def kv_update(self, key: str, value: bytes, *, last_revision: int) -> int:
        validate_key(key)
        bucket = self._bucket()
        current, revision = bucket.entries.get(key, (None, 0))
        if revision != last_revision:
            if current is None:
                raise KeyNotFound(key, f"expected revision {last_revision}, key does not exist")
            raise KeyConflict(key, f"expected revision {last_revision}, found {revision}")
        return bucket.write(key, bytes(value))

    async def kv_delete(self, key: str) -> None:
        validate_key(key)
        self._bucket().write(key, None)

    async def kv_bucket(self, name: str, *, max_age: float) -> KvBucket:
        if max_age <= 0:
            raise ValueError("a bucket's max_age must be positive")
        self._check()
        self.broker.ensure_bucket(name)
        self.broker.bucket(name).max_age = max_age
        return _MemoryKvBucket(self, name, max_age)

    def kv_watch(self, pattern: str = ">") -> Feed[KvChange]:
        validate_key_pattern(pattern)
        self._check()

        async def open_watch() -> None:
            bucket = self._bucket()
            current = [
                KvChange(key, value, revision)
                for key, (value, revision) in bucket.entries.items()
                if value is not None and subject_matches(pattern, key)
            ]
            for change in sorted(current, key=lambda change: change.revision):
                feed.push(change)
            bucket.watchers.append(watcher)

        async def close_watch() -> None:
            bucket = self.broker._buckets.get(self._config.subjects.kv_bucket)
            if bucket is not None and watcher in bucket.watchers:
                bucket.watchers.remove(watcher)
            await self._untrack(feed)

        feed: Feed[KvChange] = Feed(opener=open_watch, closer=close_watch)
        watcher = (pattern, feed)
        self._feeds.add(feed)
        return feed


_msg_ids = itertools.count(1)


def _filters(subjects: Sequence[str] | None) -> tuple[str, ...] | None:
    if not subjects:
        return None
    return tuple(validate_subject(subject, wildcards=True) for subject in subjects)


class _MemoryKvBucket:
    """A :class:`bus.protocol.KvBucket` in a :class:`MemoryBroker`: ages by the broker's clock."""

    def __init__(self, bus: MemoryBus, name: str, max_age: float) -> None:
        self._bus = bus
        self._name = name
        self._max_age = max_age

    @property
    def name(self) -> str:
        return self._name

    @property
    def max_age(self) -> float:
        return self._max_age

    def _bucket(self) -> _Bucket:
        self._bus._check()
        return self._bus.broker.bucket(self._name)

    async def get(self, key: str) -> KvEntry | None:
        validate_key(key)
        bucket = self._bucket()
        value, revision = bucket.entries.get(key, (None, 0))
        age = self._bus.broker.clock() - bucket.written.get(key, 0.0)
        if value is None or (bucket.max_age is not None and age > bucket.max_age):
            return None
        return KvEntry(value, revision)

    async def put(self, key: str, value: bytes) -> int:
        validate_key(key)
        bucket = self._bucket()
        bucket.written[key] = self._bus.broker.clock()
        return bucket.write(key, bytes(value))

    async def delete(self, key: str) -> None:
        validate_key(key)
        self._bucket().write(key, None)

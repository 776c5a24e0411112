"""The real :class:`bus.protocol.Bus`: NATS and JetStream through nats-py.

:class:`JetStreamBus` connects with reconnection that never gives up,
provisions the two file-backed streams (events by age; loads by age and a
per-instance count) and the KV bucket idempotently, and implements the port:
appends through :class:`bus.acks.AckTracker` (resends with the same message
id until a deadline), replay/tail/watch through
:class:`bus.ordered.OrderedConsumer`, core publish/subscribe/request/serve,
and KV on nats-py's ``KeyValue``. Every nats-py exception is translated into
:mod:`bus.errors` here; nothing above this module imports ``nats``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue
from nats.js.manager import JetStreamManager

from bus.acks import AckTracker
from bus.auth import redact_url
from bus.errors import (
    BusError,
    HandlerFailed,
    KeyConflict,
    KeyNotFound,
    NoResponders,
    NotConnected,
    RequestTimeout,
    StreamNotFound,
)
from bus.flow import CoreSubscription, Feed, Pipeline, RequestService
from bus.ordered import Convert, OrderedConsumer
from bus.protocol import (
    ERROR_HEADER,
    BusConfig,
    BusMessage,
    Handler,
    KvBucket,
    KvChange,
    KvEntry,
    Position,
    StoredMessage,
)
from bus.seam import translate, translated
from bus.wildcards import validate_key, validate_key_pattern, validate_subject

__all__ = ["JetStreamBus", "permission_violation"]

log = logging.getLogger(__name__)
R = TypeVar("R")

_STREAM_NAME_IN_USE = 10058
#: "no suitable peers for placement": a replicated stream asked of a cluster whose meta leader does not
#: yet count enough of its nodes as up (just started, or one restarting). Provisioning waits for them.
_NO_SUITABLE_PEERS = 10005
#: Seconds provisioning waits for a cluster to have the peers a replicated stream needs.
PLACEMENT_WAIT_S = 20.0


def _stored_message(stream: str) -> Convert[StoredMessage]:
    def convert(msg: Msg, seq: int, stamp: float, num_pending: int, live: bool) -> StoredMessage:
        return StoredMessage(msg.subject, msg.data, msg.headers or {}, Position(stream, seq), stamp)

    return convert


def _kv_change(prefix: str) -> Convert[KvChange]:
    cut = len(prefix)

    def convert(msg: Msg, seq: int, stamp: float, num_pending: int, live: bool) -> KvChange | None:
        operation = (msg.headers or {}).get(KV_OP)
        if operation in (KV_DEL, KV_PURGE):
            return KvChange(msg.subject[cut:], None, seq) if live else None
        return KvChange(msg.subject[cut:], msg.data, seq)

    return convert


async def _placed(create: Callable[[], Awaitable[R]]) -> R:
    """``create()``, called again while the cluster answers that it has no peers to place it on,
    for up to :data:`PLACEMENT_WAIT_S` (a component started with its NATS cluster waits for the
    cluster's nodes to know each other, rather than failing)."""
    deadline = time.monotonic() + PLACEMENT_WAIT_S
    while True:
        try:
            return await create()
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _NO_SUITABLE_PEERS or time.monotonic() >= deadline:
                raise
            log.info("NATS cluster: no peers for a replicated stream yet (%s), retrying", exc.description)
        await asyncio.sleep(0.25)


class JetStreamBus:
    """A :class:`bus.protocol.Bus` on a NATS server with JetStream."""

    def __init__(self, config: BusConfig | None = None) -> None:
        self._config = config or BusConfig()
        self._nc: NatsClient | None = None
        self._jsm: JetStreamManager | None = None
        self._kv: KeyValue | None = None
        self._acks: AckTracker | None = None
        self._readers: set[OrderedConsumer[Any]] = set()
        self._subscriptions: set[CoreSubscription] = set()
        self._services: set[RequestService] = set()
        self.num_disconnects = 0
        self.num_reconnects = 0
        #: permission violations the server reported, by operation ("publish" / "subscribe")
        self.permission_violations: dict[str, int] = {}

    @property
    def config(self) -> BusConfig:
        return self._config

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    @property
    def client(self) -> NatsClient:
        """The underlying nats-py client (benchmarks and diagnostics only)."""
        if self._nc is None or self._nc.is_closed:
            raise NotConnected("bus is not connected")
        return self._nc

    def _parts(self) -> tuple[NatsClient, JetStreamManager]:
        if self._nc is None or self._jsm is None or self._nc.is_closed:
            raise NotConnected("bus is not connected")
        return self._nc, self._jsm

    # -- lifecycle ---------------------------------------------------------------------
    async def connect(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            return
        cfg = self._config
        options: dict[str, Any] = {
            "servers": cfg.servers,
            "name": cfg.name,
            "connect_timeout": cfg.connect_timeout,
            "reconnect_time_wait": cfg.reconnect_time_wait,
            "max_reconnect_attempts": cfg.connect_attempts,
            "allow_reconnect": True,
            "pending_size": cfg.reconnect_buffer_bytes,
            "ping_interval": cfg.ping_interval,
            "max_outstanding_pings": cfg.max_outstanding_pings,
            "error_cb": self._on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
            **cfg.auth.connect_options(),
        }
        client = NatsClient()
        # nats-py never returns when the server's certificate fails verification: bound the wait
        limit = None
        if cfg.connect_attempts > 0:
            per_server = cfg.connect_timeout + cfg.reconnect_time_wait
            limit = cfg.connect_attempts * len(cfg.servers) * per_server + 1.0
        try:
            async with asyncio.timeout(limit):
                await client.connect(**options)
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            if not client.is_closed:
                with contextlib.suppress(Exception):
                    await client.close()
            why = (
                "timed out (unreachable, or a failed TLS handshake)"
                if isinstance(exc, TimeoutError)
                else repr(exc)
            )
            raise NotConnected(
                f"cannot connect to {redact_url(cfg.url)} as {cfg.auth.method}: {why}"
            ) from exc
        self._nc = client
        # nats-py uses one limit for the first connect and for reconnects; once in, never give up.
        self._nc.options["max_reconnect_attempts"] = cfg.max_reconnect_attempts
        self._jsm = self._nc.jsm(timeout=cfg.api_timeout)
        try:
            if cfg.provision:
                await self._provision()
            self._kv = await translated(
                self._nc.jetstream(timeout=cfg.api_timeout).key_value(cfg.subjects.kv_bucket), "kv bucket"
            )
            names = cfg.subjects
            captured = (f"{names.prefix}.ev.", f"{names.prefix}.load.")
            self._acks = AckTracker(
                self._nc, ack_timeout=cfg.ack_timeout, provisioned=lambda name: name.startswith(captured)
            )
            await self._acks.start()
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            await self._nc.close()
            raise translate(exc, f"provision streams on {redact_url(cfg.url)}") from exc
        except BaseException:
            await self._nc.close()
            raise

    async def _provision(self) -> None:
        cfg, names, streams = self._config, self._config.subjects, self._config.streams
        common: dict[str, Any] = {
            "storage": api.StorageType.FILE,
            "retention": api.RetentionPolicy.LIMITS,
            "discard": api.DiscardPolicy.OLD,
            "duplicate_window": streams.duplicate_window,
            "num_replicas": streams.replicas,
            "allow_direct": True,
        }
        await self._ensure_stream(
            api.StreamConfig(
                name=names.events_stream,
                subjects=[names.events_all],
                max_age=streams.events_max_age,
                **common,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=names.loads_stream,
                subjects=[names.loads_all],
                max_age=streams.loads_max_age,
                max_msgs_per_subject=streams.loads_max_msgs_per_subject,
                **common,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=names.history_stream,
                subjects=[names.history_all],
                max_age=streams.history_max_age,
                **common,
            )
        )
        await self._ensure_stream(
            api.StreamConfig(
                name=names.kv_stream,
                subjects=[names.kv_all],
                max_age=streams.kv_max_age,
                max_bytes=streams.kv_max_bytes,
                **common,
            )
        )
        js = self._parts()[0].jetstream(timeout=cfg.api_timeout)
        try:
            await js.key_value(names.kv_bucket)
            return  # exists: used as it is (a user without stream-admin rights may not create one)
        except nats.js.errors.BucketNotFoundError:
            pass
        try:
            await _placed(
                lambda: js.create_key_value(
                    bucket=names.kv_bucket,
                    history=streams.kv_history,
                    storage=api.StorageType.FILE,
                    replicas=streams.replicas,
                )
            )
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _STREAM_NAME_IN_USE:  # exists with another config: use it as it is
                raise BusError(f"cannot create KV bucket {names.kv_bucket!r}: {exc}") from exc

    async def _ensure_stream(self, config: api.StreamConfig) -> None:
        """Create the stream, or update it to ``config`` if it exists with another one.

        A stream that already has ``config`` is left alone without a create or update call, so
        components whose NATS user may only read stream information (``shoal up --secure``) connect.
        """
        jsm = self._parts()[1]
        try:
            existing = await jsm.stream_info(config.name or "")
        except nats.js.errors.NotFoundError:
            existing = None
        if existing is not None and _same_stream(existing.config, config):
            return
        try:
            await translated(_placed(lambda: jsm.add_stream(config)), f"create stream {config.name}")
        except BusError as exc:
            cause = exc.__cause__
            if not isinstance(cause, nats.js.errors.BadRequestError) or cause.err_code != _STREAM_NAME_IN_USE:
                raise
            await translated(jsm.update_stream(config), f"update stream {config.name}")

    async def close(self) -> None:
        """Stop services and readers, give unacknowledged appends ``ack_timeout`` to settle, disconnect."""
        nc = self._nc
        if nc is None:
            return
        for service in list(self._services):
            await service.stop()
        for reader in list(self._readers):
            await reader.feed.aclose()
        for subscription in list(self._subscriptions):
            await subscription.aclose()
        if self._acks is not None:
            await self._acks.stop(grace=self._config.ack_timeout)
            self._acks = None
        self._nc = self._jsm = self._kv = None
        if not nc.is_closed:
            try:
                await nc.close()
            except (RuntimeError, OSError) as exc:
                # the server went first: nats-py flushes what is still buffered into the dead socket
                # (uvloop raises there), after it has stopped its own tasks; nothing more can be sent
                log.warning("NATS connection already lost at close; unsent data dropped (%s)", exc)

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _on_error(self, exc: Exception) -> None:
        operation = permission_violation(exc)
        if operation is None:
            log.debug("nats: %r", exc)
            return
        # a refused publish is dropped by the server; a refused JetStream API call then times out
        self.permission_violations[operation] = self.permission_violations.get(operation, 0) + 1
        log.warning("bus %s refused by the NATS server: %s", self._config.name, exc)

    async def _on_disconnected(self) -> None:
        self.num_disconnects += 1
        log.info("bus disconnected from %s", redact_url(self._config.url))

    async def _on_reconnected(self) -> None:
        self.num_reconnects += 1
        log.info("bus reconnected to %s", redact_url(self._config.url))
        if self._acks is not None:
            self._acks.reconnected()
        for reader in list(self._readers):
            reader.request_reset()

    # -- durable log --------------------------------------------------------------------
    def _tracker(self) -> AckTracker:
        if self._acks is None:
            raise NotConnected("bus is not connected")
        return self._acks

    async def append(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Position:
        future = await self._tracker().submit(
            subject, data, msg_id, headers, self._config.append_timeout if timeout is None else timeout
        )
        return await future

    async def _submit(
        self, subject: str, data: bytes, msg_id: str | None, headers: Mapping[str, str] | None, timeout: float
    ) -> asyncio.Future[Position]:
        return await self._tracker().submit(subject, data, msg_id, headers, timeout)

    def appender(self, *, max_in_flight: int = 256, timeout: float | None = None) -> Pipeline:
        return Pipeline(
            self._submit,
            max_in_flight=max_in_flight,
            timeout=self._config.append_timeout if timeout is None else timeout,
        )

    def _reader(self, stream: str, convert: Convert[R], **options: Any) -> Feed[R]:
        nc, jsm = self._parts()
        reader = OrderedConsumer(
            nc,
            jsm,
            stream=stream,
            convert=convert,
            heartbeat=self._config.heartbeat,
            api_timeout=self._config.api_timeout,
            on_close=self._readers.discard,
            **options,
        )
        self._readers.add(reader)
        return reader.feed

    def replay(
        self,
        stream: str,
        *,
        from_seq: int = 1,
        until_seq: int | None = None,
        subjects: Sequence[str] | None = None,
    ) -> Feed[StoredMessage]:
        return self._reader(
            stream,
            _stored_message(stream),
            filters=_filters(subjects),
            start_seq=max(1, from_seq),
            until_seq=until_seq,
            stop_at_end=True,
        )

    def tail(
        self, stream: str, *, from_seq: int | None = None, subjects: Sequence[str] | None = None
    ) -> Feed[StoredMessage]:
        return self._reader(stream, _stored_message(stream), filters=_filters(subjects), start_seq=from_seq)

    async def last_seq(self, stream: str) -> int:
        info = await translated(self._parts()[1].stream_info(stream), f"stream {stream!r}")
        return int(info.state.last_seq)

    async def seq_at_time(self, stream: str, at: float) -> int | None:
        """A direct get by start time (the streams allow direct gets): one request to the server."""
        nc = self._parts()[0]
        when = dt.datetime.fromtimestamp(at, dt.UTC).isoformat().replace("+00:00", "Z")
        request = json.dumps({"start_time": when}).encode()
        reply = await translated(
            nc.request(f"$JS.API.DIRECT.GET.{stream}", request, timeout=self._config.api_timeout),
            f"find the first message of {stream!r} at {when}",
        )
        headers = reply.headers or {}
        status = headers.get("Status", "")
        if status == "404":
            return None
        if status or "Nats-Sequence" not in headers:
            detail = f"{status} {headers.get('Description', '')}"
            raise BusError(f"stream {stream!r}: direct get by time answered {detail}")
        return int(headers["Nats-Sequence"])

    # -- core NATS ------------------------------------------------------------------------
    async def publish(self, subject: str, data: bytes, *, headers: Mapping[str, str] | None = None) -> None:
        validate_subject(subject)
        nc = self._parts()[0]
        await translated(nc.publish(subject, data, headers=dict(headers) if headers else None), "publish")

    async def subscribe(self, subject: str, *, queue: str | None = None) -> CoreSubscription:
        validate_subject(subject, wildcards=True)
        nc = self._parts()[0]

        async def on_message(msg: Msg) -> None:
            subscription.push(BusMessage(msg.subject, msg.data, msg.headers or {}, msg.reply))

        nats_sub = await translated(
            nc.subscribe(subject, queue=queue or "", cb=on_message, pending_msgs_limit=0), "subscribe"
        )
        await self._settle(nc)

        async def close() -> None:
            # no round trip: what the server still sends is dropped by the closed feed
            self._subscriptions.discard(subscription)
            try:
                await nats_sub.unsubscribe()
            except nats.errors.Error:
                pass

        subscription = CoreSubscription(subject, closer=close, max_buffered=self._config.subscription_buffer)
        self._subscriptions.add(subscription)
        return subscription

    async def _settle(self, nc: NatsClient) -> None:
        """Round-trip to the server so a new (or ended) subscription is in place when the call returns.

        nats-py's ``flush()`` writes its PING straight to the socket, ahead of the commands still
        queued for its flusher task (the SUB or UNSUB just sent): its PONG alone does not prove
        the server has the subscription, and a request from another client right after could get
        "no responders". So the queued commands go to the socket first, then the PING.
        """
        if nc.is_connected:
            timeout = max(1, int(self._config.api_timeout))
            try:
                async with asyncio.timeout(timeout):
                    await nc._flush_pending(force_flush=True)
                await nc.flush(timeout=timeout)
            except (nats.errors.Error, TimeoutError):
                pass  # it is registered on (re)connect anyway

    async def request(
        self, subject: str, data: bytes, *, timeout: float, headers: Mapping[str, str] | None = None
    ) -> BusMessage:
        validate_subject(subject)
        nc = self._parts()[0]
        try:
            msg = await nc.request(subject, data, timeout=timeout, headers=dict(headers) if headers else None)
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(f"no responders on {subject!r}") from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise RequestTimeout(f"no reply on {subject!r} within {timeout}s") from exc
        except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError) as exc:
            raise NotConnected(f"request on {subject!r}: {exc}") from exc
        reply_headers = msg.headers or {}
        if ERROR_HEADER in reply_headers:
            raise HandlerFailed(subject, reply_headers[ERROR_HEADER])
        return BusMessage(msg.subject, msg.data, reply_headers, "")

    async def serve(self, subject: str, handler: Handler, *, queue: str | None = None) -> RequestService:
        validate_subject(subject, wildcards=True)
        nc = self._parts()[0]

        async def reply(to: str, data: bytes, headers: Mapping[str, str] | None) -> None:
            await nc.publish(to, data, headers=dict(headers) if headers else None)

        service = RequestService(subject, handler, reply)

        async def on_request(msg: Msg) -> None:
            await service.handle(BusMessage(msg.subject, msg.data, msg.headers or {}, msg.reply))

        nats_sub = await translated(
            nc.subscribe(subject, queue=queue or "", cb=on_request, pending_msgs_limit=0), "serve"
        )
        await self._settle(nc)

        async def stop() -> None:
            self._services.discard(service)
            try:
                await nats_sub.unsubscribe()
            except nats.errors.Error:
                pass
            await self._settle(nc)

        service.bind_stopper(stop)
        self._services.add(service)
        return service

    # -- key-value --------------------------------------------------------------------------
    def _bucket(self) -> KeyValue:
        if self._kv is None:
            raise NotConnected("bus is not connected")
        return self._kv

    async def kv_get(self, key: str) -> KvEntry | None:
        validate_key(key)
        try:
            entry = await translated(self._bucket().get(key), f"kv get {key!r}")
        except StreamNotFound as exc:
            if isinstance(exc.__cause__, nats.js.errors.KeyNotFoundError):
                return None
            raise
        return KvEntry(entry.value or b"", int(entry.revision or 0))

    async def kv_put(self, key: str, value: bytes) -> int:
        validate_key(key)
        return int(await translated(self._bucket().put(key, value), f"kv put {key!r}"))

    async def kv_create(self, key: str, value: bytes) -> int:
        validate_key(key)
        try:
            return int(await self._bucket().create(key, value))
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise KeyConflict(key, "key exists") from exc
        except nats.errors.Error as exc:
            raise translate(exc, f"kv create {key!r}") from exc

    async def kv_update(self, key: str, value: bytes, *, last_revision: int) -> int:
        validate_key(key)
        try:
            return int(await self._bucket().update(key, value, last=last_revision))
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            if await self.kv_get(key) is None:
                raise KeyNotFound(key, f"expected revision {last_revision}, key does not exist") from exc
            raise KeyConflict(key, f"expected revision {last_revision}: {exc.description}") from exc
        except nats.errors.Error as exc:
            raise translate(exc, f"kv update {key!r}") from exc

    async def kv_delete(self, key: str) -> None:
        validate_key(key)
        await translated(self._bucket().delete(key), f"kv delete {key!r}")

    def kv_watch(self, pattern: str = ">") -> Feed[KvChange]:
        validate_key_pattern(pattern)
        bucket = self._config.subjects.kv_bucket
        prefix = f"$KV.{bucket}."
        return self._reader(
            f"KV_{bucket}", _kv_change(prefix), filters=[prefix + pattern], last_per_subject=True
        )

    async def kv_bucket(self, name: str, *, max_age: float) -> KvBucket:
        if max_age <= 0:
            raise ValueError("a bucket's max_age must be positive")
        nc, jsm = self._parts()
        cfg = self._config
        js = nc.jetstream(timeout=cfg.api_timeout)
        what = f"open KV bucket {name!r}"
        try:
            try:
                kv = await js.key_value(name)
            except nats.js.errors.BucketNotFoundError:
                try:
                    kv = await _placed(lambda: js.create_key_value(
                        bucket=name, history=1, ttl=max_age, storage=api.StorageType.FILE,
                        replicas=cfg.streams.replicas,
                    ))
                except nats.js.errors.BadRequestError as exc:
                    if exc.err_code != _STREAM_NAME_IN_USE:
                        raise
                    kv = await js.key_value(name)  # another process created it first
            info = await jsm.stream_info(f"KV_{name}")
            if abs((info.config.max_age or 0.0) - max_age) >= 1e-3:
                info.config.max_age = max_age
                await jsm.update_stream(info.config)
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            raise translate(exc, what) from exc
        return _JetStreamBucket(name, max_age, kv)


class _JetStreamBucket:
    """A :class:`bus.protocol.KvBucket` on nats-py's ``KeyValue``."""

    def __init__(self, name: str, max_age: float, kv: KeyValue) -> None:
        self._name = name
        self._max_age = max_age
        self._kv = kv

    @property
    def name(self) -> str:
        return self._name

    @property
    def max_age(self) -> float:
        return self._max_age

    async def get(self, key: str) -> KvEntry | None:
        validate_key(key)
        try:
            entry = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError:  # never written, deleted, or expired
            return None
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            raise translate(exc, f"kv get {key!r} in {self._name!r}") from exc
        return KvEntry(entry.value or b"", int(entry.revision or 0))

    async def put(self, key: str, value: bytes) -> int:
        validate_key(key)
        return int(await translated(self._kv.put(key, value), f"kv put {key!r} in {self._name!r}"))

    async def delete(self, key: str) -> None:
        validate_key(key)
        await translated(self._kv.delete(key), f"kv delete {key!r} in {self._name!r}")


def _same_stream(existing: api.StreamConfig, wanted: api.StreamConfig) -> bool:
    """Whether a stream's configuration already has everything shoal sets."""

    def close(a: float | None, b: float | None) -> bool:
        return abs((a or 0.0) - (b or 0.0)) < 1e-3

    return (
        sorted(existing.subjects or []) == sorted(wanted.subjects or [])
        and existing.num_replicas == wanted.num_replicas
        and existing.storage == wanted.storage
        and existing.discard == wanted.discard
        and bool(existing.allow_direct) == bool(wanted.allow_direct)
        and (existing.max_msgs_per_subject or -1) == (wanted.max_msgs_per_subject or -1)
        and close(existing.max_age, wanted.max_age)
        and close(existing.duplicate_window, wanted.duplicate_window)
    )


def permission_violation(exc: BaseException) -> str | None:
    """Return "publish" or "subscribe" if ``exc`` is the server's permissions-violation error, else None.

    nats-py has no class for it: the server's ``-ERR 'Permissions Violation for Publish to "x"'``
    reaches the error callback as a plain ``nats.errors.Error`` carrying that text.
    """
    text = str(exc).lower()  # nats-py lowercases the server's text
    if "permissions violation" not in text:
        return None
    return "subscribe" if "for subscription" in text else "publish"


def _filters(subjects: Sequence[str] | None) -> list[str]:
    return [validate_subject(subject, wildcards=True) for subject in subjects or ()]

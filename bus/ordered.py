"""An ordered push consumer: read one stream in sequence order, surviving restarts.

:class:`OrderedConsumer` creates an ephemeral JetStream consumer (no acks,
memory storage, flow control, idle heartbeats) that pushes to a private inbox,
and feeds what arrives into a :class:`bus.flow.Feed`. It is what replay, tail
and KV watch are made of. It tracks the consumer sequence carried in each
message's reply subject: a skipped delivery, a heartbeat that reports more
deliveries than arrived, three silent heartbeat intervals, or a reconnect make
it recreate the consumer from the stream sequence after the last one it saw.
Flow-control requests are answered once the reader has taken the messages that
preceded them, so a slow reader bounds the buffer. Stream provisioning and the
bus API live in :mod:`bus.jetstream`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js import api
from nats.js.manager import JetStreamManager

from bus.event_loop import wait_event
from bus.flow import Feed
from bus.seam import translate

__all__ = ["Convert", "OrderedConsumer"]

T = TypeVar("T")
log = logging.getLogger(__name__)

#: ``convert(msg, stream_seq, time, num_pending, live)`` → item to yield, or None to skip it.
#: ``live`` is False while the consumer is still delivering what the stream held when it started.
Convert = Callable[[Msg, int, float, int, bool], T | None]

_ACK_PREFIX = "$JS.ACK."
_SILENT_HEARTBEATS = 3


class OrderedConsumer(Generic[T]):
    """One logical reader of ``stream``; iterate :attr:`feed`.

    ``start_seq`` starts at a stream sequence; None with ``last_per_subject``
    starts at the last message of each subject (KV watch), None otherwise at
    the next message appended (the stream's last sequence is read on open, so
    a reset never skips what arrived meanwhile). With ``stop_at_end`` the feed
    finishes once it has delivered everything up to ``until_seq`` (None: the
    stream's last sequence when the feed opens) or caught up with the stream.
    ``on_close`` runs when the feed closes.
    """

    def __init__(
        self,
        nc: NatsClient,
        jsm: JetStreamManager,
        *,
        stream: str,
        convert: Convert[T],
        filters: Sequence[str] = (),
        start_seq: int | None = None,
        last_per_subject: bool = False,
        until_seq: int | None = None,
        stop_at_end: bool = False,
        heartbeat: float = 2.0,
        api_timeout: float = 5.0,
        on_close: Callable[[OrderedConsumer[T]], None] | None = None,
    ) -> None:
        self._nc = nc
        self._jsm = jsm
        self._stream = stream
        self._convert = convert
        self._filters = list(filters)
        self._start_seq = start_seq
        self._last_per_subject = last_per_subject
        self._until_seq = until_seq
        self._stop_at_end = stop_at_end
        self._heartbeat = heartbeat
        self._api_timeout = api_timeout
        self._on_close = on_close
        self.feed: Feed[T] = Feed(opener=self._open, closer=self._close)
        self._sub: NatsSubscription | None = None
        self._sid = -1
        self._consumer: str | None = None
        self._next_dseq = 1
        self._last_sseq = 0
        self._live = False
        self._ended = False
        self._closed = False
        self._activity = 0
        self._reset_wanted = asyncio.Event()
        self._watchdog: asyncio.Task[None] | None = None
        self._flow_replies: deque[tuple[int, str]] = deque()
        self.num_resets = 0

    # -- lifecycle -------------------------------------------------------------------
    async def _open(self) -> None:
        try:
            await self._open_consumer()
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            raise translate(exc, f"read stream {self._stream!r}") from exc
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _open_consumer(self) -> None:
        needs_start = self._start_seq is None and not self._last_per_subject
        needs_until = self._stop_at_end and self._until_seq is None
        if needs_start or needs_until:
            info = await self._jsm.stream_info(self._stream)
            last_seq = int(info.state.last_seq)
            if needs_start:
                self._start_seq = last_seq + 1
            if needs_until:
                self._until_seq = last_seq
        if self._stop_at_end and self._until_seq is not None and self._until_seq < (self._start_seq or 1):
            self._end()
            return
        await self._create(first=True)

    async def _close(self) -> None:
        self._closed = True
        self._ended = True
        if self._on_close is not None:
            self._on_close(self)
        if self._watchdog is not None and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        await self._drop_consumer()

    def request_reset(self) -> None:
        """Recreate the consumer from where it left off (called on reconnect and on gaps)."""
        if not self._ended:
            self._reset_wanted.set()

    def _end(self) -> None:
        self._ended = True
        self.feed.finish()

    async def _drop_consumer(self) -> None:
        sub, self._sub = self._sub, None
        consumer, self._consumer = self._consumer, None
        self._sid = -1
        if sub is not None:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass
        if consumer is not None and self._nc.is_connected:
            try:
                await self._jsm.delete_consumer(self._stream, consumer)
            except (TimeoutError, nats.errors.Error):
                pass  # its inactive threshold removes it anyway

    async def _create(self, *, first: bool) -> None:
        """(Re)create the subscription and the consumer after the last sequence seen."""
        await self._drop_consumer()
        self._next_dseq = 1
        inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(inbox, cb=self._on_msg, pending_msgs_limit=0)
        self._sid = self._sub._id
        config = api.ConsumerConfig(
            deliver_subject=inbox,
            ack_policy=api.AckPolicy.NONE,
            max_deliver=1,
            flow_control=True,
            idle_heartbeat=self._heartbeat,
            inactive_threshold=max(30.0, 10 * self._heartbeat),
            mem_storage=True,
            num_replicas=1,
        )
        if len(self._filters) == 1:
            config.filter_subject = self._filters[0]
        elif self._filters:
            config.filter_subjects = list(self._filters)
        if self._last_sseq:
            config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self._last_sseq + 1
        elif self._start_seq is not None:
            config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = max(1, self._start_seq)
        else:
            config.deliver_policy = api.DeliverPolicy.LAST_PER_SUBJECT
        try:
            info = await self._jsm.add_consumer(self._stream, config=config, timeout=self._api_timeout)
        except BaseException:
            await self._drop_consumer()
            raise
        self._consumer = info.name
        if first and not info.num_pending:
            self._live = True
        if self._stop_at_end and not info.num_pending and self._next_dseq == 1:
            self._end()

    async def _watch(self) -> None:
        """Recreate the consumer when asked, or when it has been silent too long."""
        silent = 0
        seen = self._activity
        while not self._ended:
            await wait_event(self._reset_wanted, self._heartbeat)
            if self._ended:
                return
            if self._activity != seen:
                seen, silent = self._activity, 0
            elif not self._reset_wanted.is_set():
                silent += 1
            if not self._reset_wanted.is_set() and silent < _SILENT_HEARTBEATS:
                continue
            self._reset_wanted.clear()
            silent = 0
            try:
                self.num_resets += 1
                await self._create(first=False)
            except nats.js.errors.NotFoundError as exc:
                self._ended = True
                self.feed.finish(translate(exc, f"read stream {self._stream!r}"))
                return
            except (TimeoutError, nats.errors.Error, OSError) as exc:
                log.debug("recreating consumer on %s failed (%s); retrying", self._stream, exc)
                await asyncio.sleep(min(self._heartbeat, 0.5))
                self._reset_wanted.set()

    # -- delivery --------------------------------------------------------------------
    async def _on_msg(self, msg: Msg) -> None:
        if msg._sid != self._sid or self._ended:
            return  # from a consumer this reader has already replaced
        self._activity += 1
        reply = msg.reply
        if not reply.startswith(_ACK_PREFIX):
            await self._on_control(msg)
            return
        tokens = reply.split(".")
        offset = 0 if len(tokens) == 9 else 2  # v1 or v2 (domain, account hash) reply subjects
        stream_seq = int(tokens[5 + offset])
        delivery_seq = int(tokens[6 + offset])
        if delivery_seq != self._next_dseq:
            self.request_reset()
            return
        self._next_dseq += 1
        until = self._until_seq
        if until is not None and stream_seq > until:
            self._end()
            return
        self._last_sseq = stream_seq
        num_pending = int(tokens[8 + offset])
        item = self._convert(msg, stream_seq, int(tokens[7 + offset]) / 1e9, num_pending, self._live)
        if item is not None:
            self.feed.push(item)
        if not num_pending:
            self._live = True
            if self._stop_at_end:
                self._end()
        elif until is not None and stream_seq >= until and self._stop_at_end:
            self._end()

    async def _on_control(self, msg: Msg) -> None:
        headers = msg.headers or {}
        status = headers.get("Status")
        if status != "100":
            if status == "409":  # consumer deleted or similar: start over where we were
                self.request_reset()
            return
        description = headers.get("Description", "")
        if description.startswith("Flow") and msg.reply:
            self._flow_replies.append((self.feed.num_pushed, msg.reply))
            await self._answer_flow_control()
        elif description.startswith("Idle"):
            stalled = headers.get("Nats-Consumer-Stalled")
            if stalled and not self._flow_replies:  # our answer was lost; else the reader is just behind
                try:
                    await self._nc.publish(stalled)
                except nats.errors.Error:
                    pass
            last_delivered = headers.get("Nats-Last-Consumer")
            if last_delivered is not None and int(last_delivered) != self._next_dseq - 1:
                self.request_reset()

    async def _answer_flow_control(self) -> None:
        """Reply to every flow-control request whose preceding messages the reader has taken."""
        taken = self.feed.num_taken
        while self._flow_replies and self._flow_replies[0][0] <= taken:
            _, reply = self._flow_replies.popleft()
            try:
                await self._nc.publish(reply)
            except nats.errors.Error:
                pass  # the heartbeat's stalled header or a reset recovers
        if self._flow_replies:
            self.feed.notify_when_taken(self._flow_replies[0][0], self._answer_flow_control)
        else:
            self.feed.notify_when_taken(0, None)

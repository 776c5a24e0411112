"""Appends with acknowledgements, resends and deadlines, on one nats-py connection.

:class:`AckTracker` publishes each append with a reply subject under one
wildcard inbox, matches the JetStream acks that come back, and resolves a
future per append. Every ``ack_timeout`` without an ack it publishes the same
message again (same ``Nats-Msg-Id``, so JetStream stores it once); while the
connection is down it waits, and after a reconnect it resends everything still
unacknowledged. An append still unacknowledged at its deadline fails with
:class:`bus.errors.AppendTimeout`. Both ``JetStreamBus.append`` and the
pipelined appender go through here. Stream provisioning, replay and KV live in
:mod:`bus.jetstream`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.nuid import NUID

from bus.errors import AppendFailed, AppendTimeout, InvalidName, NotConnected, StreamNotFound
from bus.event_loop import cancel_and_wait
from bus.protocol import MSG_ID_HEADER, Position

__all__ = ["AckTracker"]

log = logging.getLogger(__name__)

_NO_RESPONDERS = "503"


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None


_decode_ack = msgspec.json.Decoder(_PubAck).decode


class _PendingAppend:
    __slots__ = ("data", "deadline", "future", "headers", "reply", "resend_at", "subject")

    def __init__(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str],
        reply: str,
        future: asyncio.Future[Position],
        deadline: float,
        resend_at: float,
    ) -> None:
        self.subject = subject
        self.data = data
        self.headers = headers
        self.reply = reply
        self.future = future
        self.deadline = deadline
        self.resend_at = resend_at


class AckTracker:
    """Tracks unacknowledged appends on ``nc``; ``start()`` before use, ``stop()`` to fail the rest."""

    def __init__(
        self,
        nc: NatsClient,
        *,
        ack_timeout: float,
        tick: float = 0.05,
        provisioned: Callable[[str], bool] = lambda subject: False,
    ) -> None:
        """``provisioned(subject)``: a stream is known to capture ``subject``, so "no responders" on it
        means the stream has no leader for the moment (a NATS cluster electing one): resend, as for 503."""
        self._nc = nc
        self._provisioned = provisioned
        self._ack_timeout = ack_timeout
        self._tick = min(tick, ack_timeout / 4)
        # Insertion order is resend order: an entry is re-inserted whenever its resend time moves.
        self._pending: dict[str, _PendingAppend] = {}
        self._tokens = itertools.count(1)
        self._nuid = NUID()
        self._prefix = ""
        self._sub: NatsSubscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._resend_all = False

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        inbox = self._nc.new_inbox()
        self._prefix = inbox + "."
        self._sub = await self._nc.subscribe(inbox + ".*", cb=self._on_ack, pending_msgs_limit=0)
        self._task = asyncio.get_running_loop().create_task(self._resend_loop())

    async def stop(self, *, grace: float = 0.0) -> None:
        """Wait up to ``grace`` seconds for outstanding acks, then fail what is left with NotConnected."""
        deadline = time.monotonic() + grace
        while self._pending and time.monotonic() < deadline and self._nc.is_connected:
            await asyncio.sleep(self._tick)
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass
            self._sub = None
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            if not entry.future.done():
                entry.future.set_exception(NotConnected("bus closed before the append was acknowledged"))

    def reconnected(self) -> None:
        """Resend everything unacknowledged at the next tick (acks in flight at a disconnect are lost)."""
        self._resend_all = True

    async def submit(
        self,
        subject: str,
        data: bytes,
        msg_id: str | None,
        headers: Mapping[str, str] | None,
        timeout: float,
    ) -> asyncio.Future[Position]:
        """Publish one append and return the future of its position (resolved by an ack)."""
        if self._sub is None or self._nc.is_closed:
            raise NotConnected("bus is not connected")
        all_headers = dict(headers) if headers else {}
        all_headers[MSG_ID_HEADER] = msg_id or self._nuid.next().decode()
        token = f"{next(self._tokens):x}"
        future: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
        now = time.monotonic()
        entry = _PendingAppend(
            subject,
            data,
            all_headers,
            self._prefix + token,
            future,
            now + timeout,
            now + min(self._ack_timeout, timeout),
        )
        self._pending[token] = entry
        try:
            await self._nc.publish(subject, data, reply=entry.reply, headers=all_headers)
        except nats.errors.OutboundBufferLimitError:
            pass  # disconnected with a full buffer: the resend loop publishes it after reconnecting
        except nats.errors.ConnectionClosedError as exc:
            self._pending.pop(token, None)
            raise NotConnected("connection closed") from exc
        except (nats.errors.BadSubjectError, nats.errors.MaxPayloadError, nats.errors.Error) as exc:
            self._pending.pop(token, None)
            if isinstance(exc, nats.errors.BadSubjectError):
                raise InvalidName(f"invalid subject {subject!r}") from exc
            raise AppendFailed(f"append to {subject!r} refused by the client: {exc}") from exc
        return future

    async def _on_ack(self, msg: Msg) -> None:
        token = msg.subject[len(self._prefix) :]
        entry = self._pending.pop(token, None)
        if entry is None or entry.future.done():
            return
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            if self._provisioned(entry.subject):  # leaderless for now: resend until the deadline
                entry.resend_at = time.monotonic() + self._ack_timeout
                self._pending[token] = entry
                return
            entry.future.set_exception(StreamNotFound(f"no stream captures subject {entry.subject!r}"))
            return
        try:
            ack = _decode_ack(msg.data)
        except msgspec.DecodeError as exc:
            entry.future.set_exception(AppendFailed(f"undecodable ack for {entry.subject!r}: {exc}"))
            return
        error = ack.error
        if error is None:
            entry.future.set_result(Position(ack.stream, ack.seq))
        elif error.code == 503:  # JetStream temporarily unavailable: try again shortly
            entry.resend_at = time.monotonic() + self._tick
            self._pending[token] = entry
        else:
            entry.future.set_exception(
                AppendFailed(
                    f"append to {entry.subject!r} refused: {error.description}",
                    code=error.code,
                    err_code=error.err_code,
                )
            )

    async def _resend_loop(self) -> None:
        while True:
            await asyncio.sleep(self._tick)
            try:
                await self._resend_due()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the loop die: appends would hang until close
                log.exception("append resend loop failed; continuing")

    async def _resend_due(self) -> None:
        now = time.monotonic()
        connected = self._nc.is_connected
        if self._resend_all and connected:
            self._resend_all = False
            for entry in self._pending.values():
                entry.resend_at = now
        due: list[tuple[str, _PendingAppend]] = []
        for token, entry in self._pending.items():
            if entry.resend_at > now:
                break
            due.append((token, entry))
        for token, entry in due:
            # An ack may have popped it while an earlier resend was being written.
            if self._pending.pop(token, None) is None or entry.future.done():
                continue
            if now >= entry.deadline:
                entry.future.set_exception(
                    AppendTimeout(f"append to {entry.subject!r} not acknowledged before its deadline")
                )
                continue
            entry.resend_at = min(now + self._ack_timeout, entry.deadline)
            self._pending[token] = entry
            if connected:
                try:
                    await self._nc.publish(
                        entry.subject, entry.data, reply=entry.reply, headers=entry.headers
                    )
                except nats.errors.Error as exc:
                    log.debug("resend of %s failed: %s", entry.subject, exc)

"""The scheduler's pipelined appender: decisions are queued synchronously, appended in order,
and confirmed by reading them back from the log.

The dispatch path must not wait for the log: :meth:`Outbox.put` only queues
the encoded event (so a decision and everything decided before it keep their
order), and one task publishes the queue in order with the decision's message
id (``Nats-Msg-Id``), many in flight. An append is confirmed when the
scheduler's own reader of the events stream delivers a message with that id
(:meth:`Outbox.confirm`), not by a JetStream publish acknowledgement: the
scheduler reads every event it appends anyway, so the acknowledgement was one
more message per decision to receive and parse. What is not read back within
``ack_timeout`` is published again with the same id (the stream stores it
once); what is still not read back at ``append_timeout`` fails. ``num_acked`` /
``num_failed`` count outcomes since the last :meth:`reset`; :meth:`wait_acked`
lets a snapshot wait until the fold point it names is in the log.

A refusal by the stream (no stream, a permission, a size limit) is therefore
seen as a timeout, not at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from bus.errors import BusError
from bus.protocol import MSG_ID_HEADER, Bus

__all__ = ["Outbox"]

log = logging.getLogger(__name__)


class _Unconfirmed:
    __slots__ = ("data", "deadline", "headers", "queued_at", "resend_at", "subject")

    def __init__(
        self, subject: str, data: bytes, headers: dict[str, str], queued_at: float, resend_at: float,
        deadline: float,
    ) -> None:
        self.subject = subject
        self.data = data
        self.headers = headers
        self.queued_at = queued_at
        self.resend_at = resend_at
        self.deadline = deadline


class Outbox:
    """An ordered queue of appends drained by :meth:`run` (start it as a task); confirm each append
    by calling :meth:`confirm` with the message id of every event read from the log."""

    def __init__(
        self,
        bus: Bus,
        *,
        max_in_flight: int = 1024,
        observe_append: Callable[[float], None] | None = None,
        ack_timeout: float | None = None,
        append_timeout: float | None = None,
    ) -> None:
        """``observe_append`` gets each confirmed append's latency (queued to read back, seconds);
        ``ack_timeout`` / ``append_timeout`` default to the bus configuration's."""
        self.bus = bus
        self.max_in_flight = max_in_flight
        self.observe_append = observe_append
        self.ack_timeout = bus.config.ack_timeout if ack_timeout is None else ack_timeout
        self.append_timeout = bus.config.append_timeout if append_timeout is None else append_timeout
        self._queue: deque[tuple[str, bytes, str, float]] = deque()
        #: published, not read back yet, by message id; insertion order is resend order
        self._unconfirmed: dict[str, _Unconfirmed] = {}
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self.num_queued = 0
        self.num_acked = 0
        self.num_failed = 0
        self.total_acked = 0
        self.total_failed = 0
        self.total_resent = 0

    @property
    def num_unconfirmed(self) -> int:
        return len(self._unconfirmed)

    def put(self, subject: str, data: bytes, msg_id: str) -> None:
        self._queue.append((subject, data, msg_id, time.perf_counter()))
        self.num_queued += 1
        self._ready.set()

    def confirm(self, msg_id: str) -> None:
        """The events stream delivered a message with ``msg_id``: if it is one of ours, it is stored."""
        entry = self._unconfirmed.pop(msg_id, None)
        if entry is None:
            return
        self.num_acked += 1
        self.total_acked += 1
        if self.observe_append is not None:
            self.observe_append(time.perf_counter() - entry.queued_at)
        self._room.set()

    def reset(self) -> None:
        """Forget what is queued or unconfirmed (a crash or a step-down loses it); restart the counts."""
        self._queue.clear()
        self._unconfirmed.clear()
        self.num_queued = self.num_acked = self.num_failed = 0
        self._room.set()

    async def run(self) -> None:
        resender = asyncio.get_running_loop().create_task(self._resend_loop())
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                while self._queue:
                    while len(self._unconfirmed) >= self.max_in_flight:
                        self._room.clear()
                        await self._room.wait()
                    subject, data, msg_id, queued_at = self._queue.popleft()
                    now = time.monotonic()
                    entry = _Unconfirmed(
                        subject, data, {MSG_ID_HEADER: msg_id}, queued_at,
                        now + min(self.ack_timeout, self.append_timeout), now + self.append_timeout,
                    )
                    self._unconfirmed[msg_id] = entry
                    await self._publish(entry)
        finally:
            resender.cancel()

    async def _publish(self, entry: _Unconfirmed) -> None:
        try:
            await self.bus.publish(entry.subject, entry.data, headers=entry.headers)
        except BusError as exc:  # not connected, say: the resend loop tries again
            log.debug("decision publish to %s failed: %s", entry.subject, exc)

    async def _resend_loop(self) -> None:
        tick = max(0.01, min(0.05, self.ack_timeout / 4))
        while True:
            await asyncio.sleep(tick)
            if not self._unconfirmed:
                continue
            now = time.monotonic()
            due: list[tuple[str, _Unconfirmed]] = []
            for msg_id, entry in self._unconfirmed.items():
                if entry.resend_at > now:
                    break
                due.append((msg_id, entry))
            for msg_id, entry in due:
                if self._unconfirmed.pop(msg_id, None) is None:
                    continue  # read back meanwhile
                if now >= entry.deadline:
                    self.num_failed += 1
                    self.total_failed += 1
                    self._room.set()
                    log.warning("decision append to %s not read back from the log in %.1fs",
                                entry.subject, self.append_timeout)
                    continue
                entry.resend_at = min(now + self.ack_timeout, entry.deadline)
                self._unconfirmed[msg_id] = entry  # to the end: resend order follows resend time
                self.total_resent += 1
                await self._publish(entry)

    async def wait_acked(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` appends since the last reset are settled; True if all were stored."""
        deadline = time.monotonic() + timeout
        while self.num_acked + self.num_failed < count and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return self.num_failed == 0 and self.num_acked >= count

    async def drain(self, timeout: float = 2.0) -> None:
        """Wait (up to ``timeout``) until everything queued has been published."""
        deadline = time.monotonic() + timeout
        while self._queue and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

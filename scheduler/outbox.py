"""The scheduler's pipelined appender: decisions are queued synchronously and appended in order.

The dispatch path must not wait for the log: :meth:`Outbox.put` only queues
the encoded event (so a decision and everything decided before it keep their
order), and one task feeds the queue into the bus's pipelined appender, many
appends in flight. ``num_acked`` / ``num_failed`` count outcomes since the
last :meth:`reset`; :meth:`wait_acked` lets a snapshot wait until the fold
point it names is in the log.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from bus.protocol import Bus

__all__ = ["Outbox"]

log = logging.getLogger(__name__)


class Outbox:
    """An ordered queue of appends drained by :meth:`run` (start it as a task)."""

    def __init__(
        self, bus: Bus, *, max_in_flight: int = 1024, observe_append: Callable[[float], None] | None = None
    ) -> None:
        """``observe_append`` gets each stored append's latency (queued to acknowledged, seconds)."""
        self.bus = bus
        self.max_in_flight = max_in_flight
        self.observe_append = observe_append
        self._queue: deque[tuple[str, bytes, str, float]] = deque()
        self._ready = asyncio.Event()
        self.num_queued = 0
        self.num_acked = 0
        self.num_failed = 0
        self.total_acked = 0
        self.total_failed = 0

    def put(self, subject: str, data: bytes, msg_id: str) -> None:
        self._queue.append((subject, data, msg_id, time.perf_counter()))
        self.num_queued += 1
        self._ready.set()

    def reset(self) -> None:
        """Forget what is queued (a crash or a step-down loses it) and restart the counts."""
        self._queue.clear()
        self.num_queued = self.num_acked = self.num_failed = 0

    async def run(self) -> None:
        pipe = self.bus.appender(max_in_flight=self.max_in_flight)
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._queue:
                subject, data, msg_id, queued_at = self._queue.popleft()
                future = asyncio.ensure_future(await pipe.append(subject, data, msg_id=msg_id))
                future.add_done_callback(functools.partial(self._done, queued_at))

    def _done(self, queued_at: float, future: asyncio.Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None:
            self.num_failed += 1
            self.total_failed += 1
            log.warning("decision append failed: %s", None if future.cancelled() else future.exception())
        else:
            self.num_acked += 1
            self.total_acked += 1
            if self.observe_append is not None:
                self.observe_append(time.perf_counter() - queued_at)

    async def wait_acked(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` appends since the last reset are settled; True if all were stored."""
        deadline = time.monotonic() + timeout
        while self.num_acked + self.num_failed < count and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return self.num_failed == 0 and self.num_acked >= count

    async def drain(self, timeout: float = 2.0) -> None:
        """Wait (up to ``timeout``) until everything queued has been handed to the appender."""
        deadline = time.monotonic() + timeout
        while self._queue and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

"""Request lifecycle events, appended by the frontend on ``<prefix>.ev.req.<request_id>``.

arrived, placed, first token, finished, rescued, aborted — so ``shoal replay``
can show a request's life. Appends are pipelined and never delay the client:
:class:`LifecycleLog` queues them on the bus's appender and a background task
flushes it, logging (not raising) failures. Each append carries a message id
of request id and event kind, so a retry is stored once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from bus import Appender, Bus
from bus.event_loop import cancel_and_wait
from schemas import Codec
from schemas.requests import RequestEvent, RequestRescued

__all__ = ["LifecycleLog"]

log = logging.getLogger(__name__)


class LifecycleLog:
    """Fire-and-forget appends of request events. ``start()`` / ``close()`` bracket its life."""

    def __init__(self, bus: Bus, codec: Codec, *, flush_interval: float = 0.5) -> None:
        self._bus = bus
        self._codec = codec
        self._subjects = bus.config.subjects
        self._flush_interval = flush_interval
        self._appender: Appender | None = None
        self._queue: asyncio.Queue[RequestEvent] = asyncio.Queue(maxsize=100_000)
        self._task: asyncio.Task[None] | None = None
        self.num_dropped = 0
        self.num_failed = 0

    async def start(self) -> None:
        self._appender = self._bus.appender(max_in_flight=1024)
        self._task = asyncio.create_task(self._run(), name="lifecycle-log")

    def emit(self, event: RequestEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.num_dropped += 1

    async def _run(self) -> None:
        assert self._appender is not None
        appender = self._appender
        while True:
            try:
                async with asyncio.timeout(self._flush_interval):
                    event = await self._queue.get()
            except TimeoutError:
                await self._flush(appender)
                continue
            await self._append(appender, event)

    async def _append(self, appender: Appender, event: RequestEvent) -> None:
        data = self._codec.encode(event, time=time.time())
        msg_id = f"req:{event.request_id}:{type(event).__name__}"
        if isinstance(event, RequestRescued):
            msg_id += f":{event.new_instance_id}:{event.num_tokens_kept}"
        try:
            await appender.append(self._subjects.req(event.request_id), data, msg_id=msg_id)
        except Exception as exc:  # the bus is down: the client must not notice
            self.num_failed += 1
            log.debug("lifecycle append failed: %s", exc)

    async def _flush(self, appender: Appender) -> None:
        try:
            await appender.flush()
        except Exception as exc:
            self.num_failed += 1
            log.debug("lifecycle flush failed: %s", exc)

    async def close(self) -> None:
        """Append what is queued (briefly), then stop."""
        if self._task is None or self._appender is None:
            return
        deadline = time.monotonic() + 2.0
        while not self._queue.empty() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await cancel_and_wait([self._task])
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self._appender.flush()
        self._task = None

"""Asyncio plumbing shared by both bus implementations; no NATS here.

* :class:`Feed` — a buffered async iterator that a producer pushes into (a
  consumer callback, the in-memory broker) and a caller iterates; it opens
  lazily on first read and releases its source on ``aclose()``.
* :class:`CoreSubscription` — a :class:`Feed` of core messages with ``unsubscribe()``.
* :class:`Pipeline` — the pipelined appender over a ``submit`` function.
* :class:`RequestService` — runs a request handler per message and replies
  (a handler that answers at once without a task of its own), turning a
  handler exception into an error header.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

from bus.errors import AppendFailed
from bus.protocol import ERROR_HEADER, BusMessage, Handler, Position

__all__ = ["CoreSubscription", "Feed", "Pipeline", "RequestService", "Submit", "error_header_value"]

T = TypeVar("T")
log = logging.getLogger(__name__)

Opener = Callable[[], Awaitable[None]]
Closer = Callable[[], Awaitable[None]]
#: ``submit(subject, data, msg_id, headers, timeout)`` starts one append and returns its future.
Submit = Callable[
    [str, bytes, str | None, Mapping[str, str] | None, float], Awaitable["asyncio.Future[Position]"]
]


class Feed(Generic[T]):
    """An async iterator fed by ``push()``; ends after ``finish()`` or ``aclose()``.

    ``opener`` runs on the first ``__anext__`` (so creating a feed does no I/O);
    ``closer`` runs once when the feed closes, including when it ends by itself.
    ``max_buffered`` > 0 bounds the buffer: pushes beyond it are dropped and
    counted in ``num_dropped`` (core subscriptions; JetStream consumers use
    flow control instead). A producer that needs to know how far the reader has
    got sets :meth:`notify_when_taken`.
    """

    def __init__(self, *, opener: Opener | None = None, closer: Closer | None = None, max_buffered: int = 0):
        self._items: deque[T] = deque()
        self._opener = opener
        self._closer = closer
        self._max_buffered = max_buffered
        self._waiter: asyncio.Future[None] | None = None
        self._finished = False
        self._closed = False
        self._error: BaseException | None = None
        self._notify_at = math.inf
        self._on_taken: Callable[[], Awaitable[None]] | None = None
        self.num_pushed = 0
        self.num_taken = 0
        self.num_dropped = 0

    # -- producer side -------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed or self._finished

    def push(self, item: T) -> bool:
        """Buffer one item; False if the feed is finished, closed or full."""
        if self._finished or self._closed:
            return False
        if self._max_buffered and len(self._items) >= self._max_buffered:
            self.num_dropped += 1
            return False
        self._items.append(item)
        self.num_pushed += 1
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    def finish(self, error: BaseException | None = None) -> None:
        """No more items; the reader drains the buffer, then stops (or raises ``error``)."""
        if self._finished:
            return
        self._finished = True
        self._error = error
        self._wake()

    def notify_when_taken(self, count: int, callback: Callable[[], Awaitable[None]] | None) -> None:
        """Await ``callback()`` once the reader has taken ``count`` items in total (None clears)."""
        self._notify_at = math.inf if callback is None else count
        self._on_taken = callback

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- reader side ---------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        if self._opener is not None:
            opener, self._opener = self._opener, None
            try:
                await opener()
            except BaseException:
                await self.aclose()
                raise
        while True:
            if self._items:
                item = self._items.popleft()
                self.num_taken += 1
                if self.num_taken >= self._notify_at and self._on_taken is not None:
                    self._notify_at = math.inf
                    await self._on_taken()
                return item
            if self._closed:
                raise StopAsyncIteration
            if self._finished:
                error, self._error = self._error, None
                await self.aclose()
                if error is not None:
                    raise error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def aclose(self) -> None:
        """Stop iterating and release the source; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._opener = None
        self._items.clear()
        self._wake()
        if self._closer is not None:
            closer, self._closer = self._closer, None
            await closer()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class CoreSubscription(Feed[BusMessage]):
    """A core-NATS subscription: iterate for messages, ``unsubscribe()`` to stop."""

    def __init__(self, subject: str, *, closer: Closer | None = None, max_buffered: int = 0) -> None:
        super().__init__(closer=closer, max_buffered=max_buffered)
        self._subject = subject

    @property
    def subject(self) -> str:
        return self._subject

    async def unsubscribe(self) -> None:
        await self.aclose()


class Pipeline:
    """Keeps up to ``max_in_flight`` appends unacknowledged; see :class:`bus.protocol.Appender`."""

    def __init__(self, submit: Submit, *, max_in_flight: int, timeout: float) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self._submit = submit
        self._timeout = timeout
        self._slots = asyncio.Semaphore(max_in_flight)
        self._in_flight: set[asyncio.Future[Position]] = set()
        self._failures: list[BaseException] = []

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def append(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> asyncio.Future[Position]:
        await self._slots.acquire()
        try:
            future = await self._submit(subject, data, msg_id, headers, self._timeout)
        except BaseException:
            self._slots.release()
            raise
        self._in_flight.add(future)
        future.add_done_callback(self._on_done)
        return future

    def _on_done(self, future: asyncio.Future[Position]) -> None:
        self._in_flight.discard(future)
        self._slots.release()
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            self._failures.append(error)

    async def flush(self) -> None:
        """Wait for every append so far; raise :class:`AppendFailed` if any failed since the last flush."""
        while self._in_flight:
            await asyncio.wait(list(self._in_flight))
        if self._failures:
            failures, self._failures = self._failures, []
            raise AppendFailed(f"{len(failures)} pipelined append(s) failed; first: {failures[0]}") from (
                failures[0]
            )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            await self.flush()
            return
        # The body failed: let what is in flight settle (it may be stored) but keep the body's error.
        while self._in_flight:
            await asyncio.wait(list(self._in_flight))
        self._failures.clear()


def error_header_value(exc: BaseException) -> str:
    """``"Type: message"`` on one line, short enough for a header."""
    text = f"{type(exc).__name__}: {exc}".replace("\r", " ").replace("\n", " ")
    return text[:500]


Reply = Callable[[str, bytes, Mapping[str, str] | None], Awaitable[None]]


class RequestService:
    """Runs ``handler`` for each request and publishes the reply.

    A handler that answers at once (a plain function returning the reply) is run
    where the request is delivered and its reply sent there, with no task of its
    own; an async handler runs in its own task, so requests overlap. A handler
    exception becomes an empty reply with the :data:`ERROR_HEADER`, so the
    requester fails fast with :class:`bus.errors.HandlerFailed` instead of
    waiting for its timeout.
    """

    def __init__(self, subject: str, handler: Handler, reply: Reply) -> None:
        self._subject = subject
        self._handler = handler
        self._reply = reply
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopper: Closer | None = None
        self._stopped = False
        self.num_handled = 0
        self.num_failed = 0

    @property
    def subject(self) -> str:
        return self._subject

    def bind_stopper(self, stopper: Closer) -> None:
        self._stopper = stopper

    def dispatch(self, message: BusMessage) -> None:
        """Handle ``message`` in a task of its own (for a producer that cannot wait)."""
        if self._stopped:
            return
        self._spawn(self.handle(message))

    async def handle(self, message: BusMessage) -> None:
        """Handle ``message``: answer it here if the handler answers at once, else in a task."""
        if self._stopped:
            return
        try:
            result = self._handler(message.data, message.headers)
        except Exception as exc:
            await self._failed(message, exc)
            return
        if isinstance(result, bytes):
            self.num_handled += 1
            if message.reply:
                await self._safe_reply(message.reply, result, None)
            return
        self._spawn(self._finish(message, result))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish(self, message: BusMessage, pending: Awaitable[bytes]) -> None:
        try:
            result = await pending
        except Exception as exc:
            await self._failed(message, exc)
            return
        self.num_handled += 1
        if message.reply:
            await self._safe_reply(message.reply, result, None)

    async def _failed(self, message: BusMessage, exc: Exception) -> None:
        self.num_failed += 1
        log.warning("handler for %s failed: %s", self._subject, exc, exc_info=exc)
        if message.reply:
            await self._safe_reply(message.reply, b"", {ERROR_HEADER: error_header_value(exc)})

    async def _safe_reply(self, reply: str, data: bytes, headers: Mapping[str, str] | None) -> None:
        try:
            await self._reply(reply, data, headers)
        except Exception as exc:  # the requester will time out; nothing else to do here
            log.warning("could not reply on %s: %s", reply, exc)

    async def stop(self) -> None:
        """Stop receiving, then wait for the handlers already running."""
        if self._stopped:
            return
        self._stopped = True
        if self._stopper is not None:
            await self._stopper()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

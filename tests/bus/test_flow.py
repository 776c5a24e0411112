"""The asyncio plumbing under both buses: feeds and the pipelined appender (no NATS)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from bus import AppendFailed, Position, StreamNotFound
from bus.flow import Feed, Pipeline


async def test_a_feed_yields_what_was_pushed_then_ends_or_raises() -> None:
    feed: Feed[int] = Feed()
    for i in range(3):
        feed.push(i)
    feed.finish()
    assert [i async for i in feed] == [0, 1, 2]
    assert not feed.push(4)

    failing: Feed[int] = Feed()
    failing.push(1)
    failing.finish(StreamNotFound("gone"))
    assert await anext(failing) == 1
    with pytest.raises(StreamNotFound):
        await anext(failing)


async def test_a_feed_opens_lazily_and_closes_its_source_once() -> None:
    calls: list[str] = []

    async def opener() -> None:
        calls.append("open")

    async def closer() -> None:
        calls.append("close")

    feed: Feed[int] = Feed(opener=opener, closer=closer)
    assert calls == []
    waiting = asyncio.create_task(anext(feed))
    await asyncio.sleep(0)
    assert calls == ["open"]
    await feed.aclose()  # from another task: the waiting reader stops
    with pytest.raises(StopAsyncIteration):
        await waiting
    await feed.aclose()
    assert calls == ["open", "close"]


async def test_a_bounded_feed_drops_and_counts_overflow() -> None:
    feed: Feed[int] = Feed(max_buffered=2)
    assert [feed.push(i) for i in range(4)] == [True, True, False, False]
    assert feed.num_dropped == 2


async def test_a_feed_tells_its_producer_when_the_reader_has_caught_up() -> None:
    feed: Feed[int] = Feed()
    reached: list[int] = []

    async def on_taken() -> None:
        reached.append(feed.num_taken)

    for i in range(5):
        feed.push(i)
    feed.notify_when_taken(3, on_taken)
    assert [await anext(feed) for _ in range(4)] == [0, 1, 2, 3]
    assert reached == [3]


async def test_the_pipeline_bounds_appends_in_flight_and_reports_failures() -> None:
    pending: list[asyncio.Future[Position]] = []

    async def submit(
        subject: str, data: bytes, msg_id: str | None, headers: Mapping[str, str] | None, timeout: float
    ) -> asyncio.Future[Position]:
        future: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
        pending.append(future)
        return future

    pipe = Pipeline(submit, max_in_flight=2, timeout=1.0)
    await pipe.append("s", b"1")
    await pipe.append("s", b"2")
    third = asyncio.create_task(pipe.append("s", b"3"))
    await asyncio.sleep(0.01)
    assert not third.done() and pipe.num_in_flight == 2  # waits for a free slot
    pending[0].set_result(Position("events", 1))
    await third
    pending[1].set_exception(StreamNotFound("no stream"))
    pending[2].set_result(Position("events", 2))
    with pytest.raises(AppendFailed, match="1 pipelined append"):
        await pipe.flush()
    await pipe.flush()
    assert pipe.num_in_flight == 0

"""The scheduler's appender on a real nats-server: confirmed by reading back, resent, failed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from bus import MSG_ID_HEADER, JetStreamBus
from scheduler.outbox import Outbox
from tests.scheduler.service_helpers import connected, delete_streams, new_prefix


@contextlib.asynccontextmanager
async def _outbox(
    bus: JetStreamBus, *, read_back: bool, ack_timeout: float | None = None,
    append_timeout: float | None = None,
) -> AsyncIterator[Outbox]:
    """A running outbox; with ``read_back`` a reader of the events stream confirms what it delivers,
    as the scheduler's events reader does."""
    outbox = Outbox(bus, ack_timeout=ack_timeout, append_timeout=append_timeout)
    tasks = [asyncio.create_task(outbox.run())]

    async def confirm() -> None:
        async with bus.tail(bus.config.subjects.events_stream, from_seq=1) as feed:
            async for message in feed:
                outbox.confirm(message.headers.get(MSG_ID_HEADER, ""))

    if read_back:
        tasks.append(asyncio.create_task(confirm()))
    try:
        yield outbox
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stored(bus: JetStreamBus) -> list[bytes]:
    stored = []
    async with bus.replay(bus.config.subjects.events_stream) as feed:
        async for message in feed:
            stored.append(message.data)
    return stored


async def test_decisions_are_stored_once_in_order_and_confirmed_when_read_back(nats_url: str) -> None:
    prefix = new_prefix()
    try:
        async with connected(nats_url, prefix) as bus, _outbox(bus, read_back=True) as outbox:
            subject = bus.config.subjects.sched("dispatch")
            for k in range(50):
                outbox.put(subject, f"d{k}".encode(), f"s:1:{k}")
            assert await outbox.wait_acked(50, timeout=10)
            assert (outbox.num_acked, outbox.num_failed, outbox.num_unconfirmed) == (50, 0, 0)
            assert await _stored(bus) == [f"d{k}".encode() for k in range(50)]
    finally:
        await delete_streams(nats_url, prefix)


async def test_a_decision_not_read_back_is_published_again_and_stored_once(nats_url: str) -> None:
    prefix = new_prefix()
    try:
        async with connected(nats_url, prefix) as bus:
            subject = bus.config.subjects.sched("dispatch")
            # nobody reads it back for a while: it is published again every ack_timeout
            async with _outbox(bus, read_back=False, ack_timeout=0.1, append_timeout=5.0) as outbox:
                outbox.put(subject, b"decision", "s:1:1")
                while outbox.total_resent < 2:
                    await asyncio.sleep(0.02)
                outbox.confirm("s:1:1")  # now read back
                assert await outbox.wait_acked(1, timeout=1)
            assert await _stored(bus) == [b"decision"]  # the stream kept one copy (same message id)
    finally:
        await delete_streams(nats_url, prefix)


async def test_a_decision_no_stream_stores_fails_at_its_deadline(nats_url: str) -> None:
    prefix = new_prefix()
    try:
        async with connected(nats_url, prefix) as bus, _outbox(
            bus, read_back=True, ack_timeout=0.1, append_timeout=0.5
        ) as outbox:
            outbox.put(f"{prefix}.nowhere.dispatch", b"lost", "s:1:1")
            outbox.put(bus.config.subjects.sched("dispatch"), b"kept", "s:1:2")
            assert not await outbox.wait_acked(2, timeout=5)
            assert (outbox.num_acked, outbox.num_failed) == (1, 1)
    finally:
        await delete_streams(nats_url, prefix)

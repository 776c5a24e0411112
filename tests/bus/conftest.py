"""Fixtures for the bus tests: the same contract runs on JetStream and in memory.

``make_bus`` (parametrized over both implementations) returns connected buses
that share one backend — the session nats-server, or one ``MemoryBroker`` —
under a prefix unique to the test, so streams never collide. JetStream
streams are deleted when the test ends.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from bus import Bus, JetStreamBus, MemoryBroker, MemoryBus
from schemas import Subjects
from tests.bus.helpers import short_config

MakeBus = Callable[..., Awaitable[Bus]]


@pytest.fixture
def subjects() -> Subjects:
    return Subjects(f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture(params=["jetstream", "memory"])
async def make_bus(request: pytest.FixtureRequest, subjects: Subjects) -> AsyncIterator[MakeBus]:
    kind = request.param
    url = request.getfixturevalue("nats_url") if kind == "jetstream" else "nats://unused:4222"
    broker = MemoryBroker()
    made: list[Bus] = []

    async def make(**changes: Any) -> Bus:
        config = short_config(url, subjects, **changes)
        bus: Bus = JetStreamBus(config) if kind == "jetstream" else MemoryBus(config, broker=broker)
        await bus.connect()
        made.append(bus)
        return bus

    yield make
    for bus in made:
        await bus.close()
    if kind == "jetstream":
        cleaner = JetStreamBus(short_config(url, subjects, provision=False))
        await cleaner.connect()
        jsm = cleaner.client.jsm()
        streams = (subjects.events_stream, subjects.loads_stream, subjects.history_stream, subjects.kv_stream)
        for stream in (*streams, f"KV_{subjects.kv_bucket}", f"KV_{subjects.responses_bucket}"):
            try:
                await jsm.delete_stream(stream)
            except Exception:  # already gone
                pass
        await cleaner.close()


@pytest.fixture
async def bus(make_bus: MakeBus) -> Bus:
    return await make_bus()

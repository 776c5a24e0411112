"""In-memory-only behaviour: ages and the duplicate window follow the broker's (virtual) clock."""

from __future__ import annotations

from bus import MSG_ID_HEADER, BusConfig, MemoryBroker, MemoryBus, StreamConfig
from schemas import Subjects
from tests.bus.helpers import collect


class VirtualClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _bus(clock: VirtualClock) -> MemoryBus:
    streams = StreamConfig(events_max_age=600.0, loads_max_age=60.0, duplicate_window=30.0)
    config = BusConfig(subjects=Subjects("sim"), streams=streams, append_timeout=10.0)
    return MemoryBus(config, broker=MemoryBroker(clock=clock))


async def test_messages_older_than_max_age_are_dropped_but_sequences_continue() -> None:
    clock = VirtualClock()
    async with _bus(clock) as bus:
        names = bus.config.subjects
        await bus.append(names.load("i1"), b"old")
        clock.now += 45
        await bus.append(names.load("i1"), b"newer")
        clock.now += 30  # the first report is now 75 s old, past the 60 s max age
        kept = await collect(bus.replay(names.loads_stream))
        assert [(m.data, m.position.seq, m.time) for m in kept] == [(b"newer", 2, 1_045.0)]
        assert (await bus.append(names.load("i1"), b"next")).seq == 3


async def test_a_message_id_is_forgotten_after_the_duplicate_window() -> None:
    clock = VirtualClock()
    async with _bus(clock) as bus:
        names = bus.config.subjects
        first = await bus.append(names.req("r1"), b"x", msg_id="same")
        clock.now += 29
        assert await bus.append(names.req("r1"), b"x", msg_id="same") == first
        clock.now += 2
        assert (await bus.append(names.req("r1"), b"x", msg_id="same")).seq == first.seq + 1
        stored = await collect(bus.replay(names.events_stream))
        assert [m.headers[MSG_ID_HEADER] for m in stored] == ["same", "same"]


async def test_buses_on_one_broker_share_streams_and_subscriptions() -> None:
    broker = MemoryBroker()
    config = BusConfig(subjects=Subjects("shared"))
    async with MemoryBus(config, broker=broker) as agent, MemoryBus(config, broker=broker) as scheduler:
        subscription = await scheduler.subscribe("shared.ev.>")
        position = await agent.append(config.subjects.instance("i1"), b"joined")
        assert await scheduler.last_seq(config.subjects.events_stream) == position.seq
        message = await anext(subscription)  # appends are also seen by core subscribers, as on NATS
        assert (message.subject, message.data) == (config.subjects.instance("i1"), b"joined")

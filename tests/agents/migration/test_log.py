"""The migration log's first-outcome-wins claim, on JetStream and on the in-memory bus."""

from __future__ import annotations

import uuid

import pytest

from agents.migration.log import MigrationLog
from bus import Bus, JetStreamBus, MemoryBroker, MemoryBus
from schemas import Abort, Codec, CommitAck, MigrationAbortReason, PreAllocate, Subjects
from tests.agents.agent_cluster import bus_config


@pytest.mark.parametrize("kind", ["jetstream", "memory"])
async def test_first_outcome_wins_and_both_sides_read_it(nats_url: str, kind: str) -> None:
    subjects = Subjects(f"t{uuid.uuid4().hex[:12]}")
    broker = MemoryBroker()

    async def connect(name: str) -> Bus:
        config = bus_config(nats_url, subjects, name)
        bus: Bus = JetStreamBus(config) if kind == "jetstream" else MemoryBus(config, broker=broker)
        await bus.connect()
        return bus

    source_bus, destination_bus = await connect("src"), await connect("dst")
    try:
        source = MigrationLog(source_bus, Codec(producer="src"))
        destination = MigrationLog(destination_bus, Codec(producer="dst"))
        ack = CommitAck(
            migration_id="m1", request_id="r", destination_id="dst", owner_epoch=1, resumed_at=1.0
        )
        abort = Abort(migration_id="m1", reason=MigrationAbortReason.COMMIT_TIMEOUT, sender_id="src")
        assert await destination.claim(ack) is True
        assert await source.claim(abort) is True  # too late: the log holds the commit
        assert await destination.claim(ack) is True  # a retry reads the same answer
        other = Abort(migration_id="m2", reason=MigrationAbortReason.COMMIT_TIMEOUT, sender_id="src")
        assert await source.claim(other) is False
        late = CommitAck(
            migration_id="m2", request_id="r", destination_id="dst", owner_epoch=1, resumed_at=2.0
        )
        assert await destination.claim(late) is False  # the source aborted first: never run twice

        source.record(
            PreAllocate(
                migration_id="m1",
                request_id="r",
                source_id="src",
                destination_id="dst",
                stage=0,
                num_blocks=3,
            )
        )
        await source.flush()
        codec = Codec()
        async with source_bus.replay(subjects.events_stream, subjects=[subjects.mig("m1")]) as feed:
            logged = [codec.decode(m.data) async for m in feed]
        assert [type(e.body) for e in logged] == [PreAllocate] and logged[0].producer == "src"
        assert logged[0].time > 0
    finally:
        await source_bus.close()
        await destination_bus.close()
        if kind == "jetstream":
            cleaner = JetStreamBus(bus_config(nats_url, subjects, "cleaner"))
            await cleaner.connect()
            for stream in (subjects.events_stream, subjects.loads_stream):
                try:
                    await cleaner.client.jsm().delete_stream(stream)
                except Exception:  # already gone
                    pass
            await cleaner.close()

"""The agent's prefix-cache events: merged per step, numbered, full at start and when asked."""

from __future__ import annotations

import asyncio

from agents.cache_events import CacheEventPublisher, CacheEventsConfig, PendingBatch
from agents.engines.sim import SimEngine
from bus.errors import NoResponders
from schemas import Codec, GenerateRequest
from schemas.block_hash import block_hashes
from schemas.kv_events import KVCacheEvents, KVCacheSync, KVCacheSyncAck, KVSyncReason
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, greedy

PROMPT = tuple(range(100, 133))  # 33 tokens: 8 full blocks of 4, the last token never cached


def test_pending_batch_merges_in_order() -> None:
    pending = PendingBatch()
    assert not pending
    pending.add([1, 2], [])
    pending.add([3], [2, 9])
    assert pending.take() == (False, (1, 3), (2, 9))
    assert not pending
    pending.add([5], [])
    pending.replace([7, 8])  # a full set makes the earlier deltas moot
    pending.add([10], [8, 11])
    assert pending.take() == (True, (7, 10), ())


async def test_publisher_numbers_batches_and_answers_a_sync() -> None:
    codec = Codec(producer="test")
    engine = SimEngine("tiny-test", num_blocks=64, time_scale=100.0, prefix_cache=True)
    stored: list[KVCacheEvents] = []

    async def append(subject: str, data: bytes, msg_id: str, timeout: float) -> None:
        body = codec.decode(data).body
        assert isinstance(body, KVCacheEvents) and subject == "c.kv.a1" and msg_id.endswith(f":{body.seq}")
        stored.append(body)

    publisher = CacheEventPublisher(
        engine,
        instance_id="a1",
        block_size=4,
        subject="c.kv.a1",
        append=append,
        codec=codec,
        config=CacheEventsConfig(full_every_s=3600.0),
    )
    first = publisher.take_batch()
    assert first is not None and first.full and first.seq == 1 and first.stored == ()
    assert publisher.take_batch() is None  # nothing changed
    engine.add_request("r1", PROMPT, greedy(2))
    while engine.has_unfinished():
        engine.step()
        publisher.after_step()
    second = publisher.take_batch()
    assert second is not None and not second.full and second.seq == 2
    assert set(block_hashes(PROMPT, 4)) <= set(second.stored)

    ask = codec.encode(KVCacheSync(instance_id="a1", reason=KVSyncReason.GAP), time=0.0)
    ack = codec.decode(await publisher.serve_sync(ask, {})).body
    assert isinstance(ack, KVCacheSyncAck) and ack.seq == 2 and ack.incarnation == publisher.incarnation
    task = asyncio.create_task(publisher.run())
    try:
        async with asyncio.timeout(5.0):
            while not stored:
                await asyncio.sleep(0.001)
    finally:
        task.cancel()
    assert stored[0].full and stored[0].seq == 3
    assert set(stored[0].stored) == set(engine.cached_block_hashes())
    # a malformed request still gets an answer and changes nothing
    assert isinstance(codec.decode(await publisher.serve_sync(b"junk", {})).body, KVCacheSyncAck)
    assert publisher.num_syncs == 1


async def test_agent_publishes_cache_batches_to_the_kv_stream(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        engine = SimEngine("tiny-test", num_blocks=64, time_scale=10.0, prefix_cache=True)
        await cluster.add(engine, fast_agent_config("a1"))
        for n in range(2):  # the same prompt twice: the second finds its blocks cached
            watcher = await cluster.watch(f"r{n}")
            request = GenerateRequest(request_id=f"r{n}", token_ids=PROMPT, sampling=greedy(3))
            assert (await cluster.generate("a1", request)).accepted
            await watcher.wait_finished()
            await watcher.close()
        assert engine.stats().prefix_cache_hits >= 32

        async def batches() -> list[KVCacheEvents]:
            stored = await cluster.stored(cluster.subjects.kv("a1"), cluster.subjects.kv_stream)
            return [env.body for _, env in stored]

        async with asyncio.timeout(5.0):
            while not set(block_hashes(PROMPT, 4)) <= {h for b in await batches() for h in b.stored}:
                await asyncio.sleep(0.02)
        found = await batches()
        assert found[0].full and [b.seq for b in found] == list(range(1, len(found) + 1))
        assert len({b.incarnation for b in found}) == 1

        reply = await cluster.bus.request(
            cluster.subjects.kv_sync("a1"),
            cluster.codec.encode(KVCacheSync(instance_id="a1"), time=0.0),
            timeout=5.0,
        )
        ack = cluster.codec.decode(reply.data).body
        assert isinstance(ack, KVCacheSyncAck)
        async with asyncio.timeout(5.0):
            while len(found := await batches()) <= ack.seq:
                await asyncio.sleep(0.02)
        full = found[ack.seq]
        assert full.full and full.seq == ack.seq + 1
        assert set(full.stored) == set(engine.cached_block_hashes())


async def test_a_batch_the_stream_would_not_take_is_given_up_and_the_next_goes_out() -> None:
    codec = Codec(producer="test")
    engine = SimEngine("tiny-test", num_blocks=64, prefix_cache=True)
    tries: list[str] = []
    down = True

    async def append(subject: str, data: bytes, msg_id: str, timeout: float) -> None:
        tries.append(msg_id)
        if down:
            raise NoResponders("no stream captures it")

    publisher = CacheEventPublisher(
        engine,
        instance_id="a1",
        block_size=4,
        subject="c.kv.a1",
        append=append,
        codec=codec,
        config=CacheEventsConfig(append_attempts=2, failure_pause_s=0.0),
    )
    first = publisher.take_batch()
    assert first is not None
    assert not await publisher.publish(first)
    assert tries == [f"{publisher.incarnation}:1"] * 2 and publisher.num_failed == 1
    down = False
    publisher.request_full()
    second = publisher.take_batch()
    assert second is not None and second.seq == 2 and second.full
    assert await publisher.publish(second) and publisher.num_published == 1

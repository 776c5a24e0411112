"""The scheduler's prefix index on a real nats-server with real agents (sim engine, prefix cache on).

An agent serving a repeated prompt publishes cache batches; the active scheduler's index lists
the prompt's blocks and a dispatch of that prompt records which instance held how many of them;
a lost batch (the agent skips a ``seq``) is noticed and re-synced; the standby's index equals the
active one's after a kill -9, and a scheduler restarted from the log (the kv stream alone, or a
snapshot plus its tail) rebuilds the same index.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from click.testing import CliRunner

from agents.engines.sim import SimEngine
from bus import JetStreamBus
from frontend.cli import cli
from scheduler.logfile import read_bus_log
from scheduler.prefix_index import decode_index, encode_index
from scheduler.service import SchedulerConfig, SchedulerService
from scheduler.snapshots import SnapshotStore
from schemas import Codec, GenerateRequest
from schemas.block_hash import block_hashes
from schemas.decisions import Dispatched
from schemas.rpc import DispatchReply, DispatchRequest
from tests.agents.agent_cluster import AgentCluster, agent_cluster, bus_config, fast_agent_config, greedy
from tests.scheduler.service_helpers import connected


def config(scheduler_id: str, *, standby: bool = False, use_snapshot: bool = True) -> SchedulerConfig:
    return SchedulerConfig(
        scheduler_id=scheduler_id,
        standby=standby,
        use_snapshot=use_snapshot,
        lease_ttl_s=1.0,
        pairing_interval_s=0.1,
        failure_timeout_s=5.0,
        snapshot_every_s=0.3,
        archive_loads=False,
    )


PROMPT = tuple(range(100, 133))  # 33 tokens: 8 full blocks of 4
CHAIN = tuple(block_hashes(PROMPT, 4))


@contextlib.asynccontextmanager
async def running(service: SchedulerService) -> AsyncIterator[SchedulerService]:
    task = asyncio.create_task(service.run())
    try:
        yield service
    finally:
        if not task.done():
            await service.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.01)


async def serve(cluster: AgentCluster, request_id: str, prompt: tuple[int, ...]) -> None:
    watcher = await cluster.watch(request_id)
    request = GenerateRequest(request_id=request_id, token_ids=prompt, sampling=greedy(3))
    assert (await cluster.generate("a1", request)).accepted
    await watcher.wait_finished()
    await watcher.close()


async def dispatch_chain(bus: JetStreamBus, request_id: str) -> DispatchReply:
    codec = Codec(producer="test-frontend")
    request = DispatchRequest(
        request_id=request_id, num_prompt_tokens=len(PROMPT), block_size=4, block_hashes=CHAIN
    )
    message = await bus.request(
        bus.config.subjects.rpc_dispatch, codec.encode(request, time=0.0), timeout=5.0
    )
    reply = codec.decode(message.data).body
    assert isinstance(reply, DispatchReply)
    return reply


async def shoal(*args: str) -> str:
    result = await asyncio.to_thread(CliRunner().invoke, cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


async def test_index_follows_agents_resyncs_a_gap_and_survives_kill_9_and_restart(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        prefix = cluster.subjects.prefix
        engine = SimEngine("tiny-test", num_blocks=64, time_scale=10.0, prefix_cache=True)
        agent = await cluster.add(engine, fast_agent_config("a1"))
        other = SimEngine("tiny-test", num_blocks=64, time_scale=10.0, prefix_cache=True)
        await cluster.add(other, fast_agent_config("a2"))
        async with (
            connected(nats_url, prefix) as primary_bus,
            connected(nats_url, prefix) as standby_bus,
            running(SchedulerService(primary_bus, config("primary"))) as primary,
        ):
            await primary.wait_active(10)
            async with running(SchedulerService(standby_bus, config("standby", standby=True))) as standby:
                for n in range(2):  # the same prompt twice: the second is a cache hit
                    await serve(cluster, f"r{n}", PROMPT)
                index = primary.prefix
                await until(
                    lambda: set(CHAIN) <= index.hashes_of("a1"), "the index lists the prompt's blocks"
                )
                assert index.overlap(CHAIN, block_size=4) == {"a1": 8}
                assert index.instance_ids() == ["a1", "a2"]
                assert index.hashes_of("a2") == set(other.cached_block_hashes())  # its warm-up's

                reply = await dispatch_chain(primary_bus, "d1")
                assert reply.instance_id is not None
                log = await read_bus_log(primary_bus)
                decisions = [Codec().decode(e.data).body for e in log.events]
                placed = [d for d in decisions if isinstance(d, Dispatched) and d.request_id == "d1"]
                assert placed[0].cached_blocks == (("a1", 8),) and placed[0].num_chain_blocks == 8
                assert placed[0].kv_seq > 0

                # a batch is lost: the agent's next batch skips a number
                publisher = agent.cache_events
                assert publisher is not None
                publisher.seq += 1
                await serve(cluster, "r2", tuple(range(500, 517)))
                await until(
                    lambda: publisher.num_syncs == 1, "the scheduler asked the agent for a full batch"
                )
                await until(
                    lambda: (
                        not index.is_stale("a1")
                        and index.hashes_of("a1") == set(engine.cached_block_hashes())
                    ),
                    "the full batch replaced the instance's set",
                )
                assert index.num_gaps == 1
                await until(
                    lambda: b"shoal_scheduler_prefix_index_gaps_total 1.0" in primary.metrics.render(),
                    "the gap counted in the scheduler's metrics",
                )
                scraped = primary.metrics.render().decode()
                assert "shoal_scheduler_prefix_index_resyncs_total 1.0" in scraped
                assert "shoal_scheduler_prefix_index_instances 2.0" in scraped

                await until(lambda: standby.prefix.kv_seq == index.kv_seq, "the standby read the kv stream")
                # the standby recomputed the dispatch from what it recorded of the index
                assert standby.shadow is not None and standby.shadow.stats.verified >= 1
                assert not standby.shadow.mismatches
                before = encode_index(index)
                assert encode_index(standby.prefix) == before
                primary.crash()  # kill -9: the standby takes over with the same index, asking no agent
                await primary_bus.close()  # and its connection goes with the process
                await standby.wait_active(10)
                assert encode_index(standby.prefix) == before
                assert publisher.num_syncs == 1
                await asyncio.sleep(0.5)  # a snapshot of the new active scheduler
                reply = await dispatch_chain(standby_bus, "d2")
                assert reply.instance_id is not None

        # restarted from the log alone (the kv stream from its start), and from a snapshot plus its tail
        for use_snapshot in (False, True):
            async with connected(nats_url, prefix) as bus:
                record = await SnapshotStore(bus).load()
                assert record is not None and encode_index(decode_index(record.prefix_index)) == before
                restart = config(f"restart-{use_snapshot}", use_snapshot=use_snapshot)
                async with running(SchedulerService(bus, restart)) as restarted:
                    await until(
                        lambda: restarted.prefix.kv_seq == index.kv_seq, "the restart read the kv stream"
                    )
                    assert encode_index(restarted.prefix) == before

        # what the index held at d1's dispatch, rebuilt from the kv stream, and the decision as listed
        source = ["--nats", nats_url, "--prefix", prefix]
        shown = await shoal("events", "prefix-index", *source, "--request", "d1")
        assert (
            f"dispatch of d1 to {placed[0].instance_id} at kv seq {placed[0].kv_seq}: a1 held 8 of 8" in shown
        )
        assert "  a1  incarnation" in shown and "  a2  incarnation" in shown
        rows = [
            json.loads(line)
            for line in (
                await shoal("events", "list", "--json", *source, "--request", "d1", "--type", "dispatched")
            ).splitlines()
        ]
        assert rows[0]["body"]["cached_blocks"] == {"a1": 8}
        timeline = await shoal("replay", *source, "--request", "d1")
        assert "prefix index (kv seq" in timeline and "of its 8 blocks: a1 held 8" in timeline


async def test_under_the_secure_deployment_agents_publish_the_scheduler_resyncs_and_drops_a_leaver(
    secure_nats: Any,
) -> None:
    async with agent_cluster(secure_nats.url, secure_nats) as cluster:
        engine = SimEngine("tiny-test", num_blocks=64, time_scale=10.0, prefix_cache=True)
        agent = await cluster.add(engine, fast_agent_config("a1"))
        bus = JetStreamBus(
            bus_config(secure_nats.url, cluster.subjects, "scheduler", secure_nats.auth("scheduler"))
        )
        await bus.connect()
        try:
            async with running(SchedulerService(bus, config("secure"))) as service:
                await service.wait_active(10)
                await serve(cluster, "s1", PROMPT)
                await until(
                    lambda: set(CHAIN) <= service.prefix.hashes_of("a1"), "the index lists the blocks"
                )
                publisher = agent.cache_events
                assert publisher is not None and publisher.num_failed == 0
                publisher.seq += 1  # a lost batch: the scheduler's user may ask the agent's for a full one
                await serve(cluster, "s2", tuple(range(500, 517)))
                await until(lambda: publisher.num_syncs == 1, "the agent was asked for a full batch")
                await until(lambda: not service.prefix.is_stale("a1"), "the full batch arrived")
                await agent.stop()  # it leaves: its blocks leave the index
                await until(lambda: service.prefix.instance_ids() == [], "the index dropped the instance")
                assert service.prefix.num_hashes == 0
        finally:
            await bus.close()

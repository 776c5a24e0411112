"""The prefix index when the network loses an agent's cache batch: the drill's chaos proxy in between.

The agent's NATS connection goes through a :class:`~frontend.drill.proxy.ChaosProxy`; the
scheduler's does not. While a request decodes (its generated tokens fill blocks, so the cache
changes), the proxy blackholes the agent's connection long enough that the agent gives a batch
up (every try timed out). What happens to that batch then depends on how the outage ends:

* **it heals**: TCP kept what was sent, so the held appends reach the stream once the proxy
  forwards again and JetStream stores one copy of the batch (same message id): no ``seq`` is
  missing, the index follows without a re-sync;
* **the connection is reset** while blackholed (a NAT or a peer dropping the connection): the
  appends held on it die with it, and the agent's tracker resends nothing (the batch's deadline
  has passed). The batch is lost: the next batch after the reconnect skips its ``seq``, the
  scheduler asks the agent for a full batch, and its index equals the engine's cache again.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest

from agents.agent import Agent
from agents.cache_events import CacheEventsConfig
from agents.config import FaultPlan, StepPace
from agents.engines.sim import SimEngine
from bus import JetStreamBus
from frontend.drill.proxy import ChaosProxy
from scheduler.service import SchedulerService
from schemas import GenerateRequest
from schemas.kv_events import KVCacheEvents
from tests.agents.agent_cluster import AgentCluster, agent_cluster, bus_config, fast_agent_config, greedy
from tests.scheduler.service_helpers import connected
from tests.scheduler.test_prefix_index_service import CHAIN, PROMPT, config, running, serve, until

pytestmark = pytest.mark.integration

#: a batch is given up after two tries of 0.3 s each (the default is three of 2 s, then a 5 s pause)
CACHE_EVENTS = CacheEventsConfig(append_timeout_s=0.3, append_attempts=2, failure_pause_s=0.1)
#: each engine step lasts at least this long, so a request of 60 tokens decodes for 3 s
STEP_S = 0.05


@contextlib.asynccontextmanager
async def agent_behind_proxy(
    cluster: AgentCluster, proxy: ChaosProxy, engine: SimEngine, pace: StepPace
) -> AsyncIterator[Agent]:
    """Agent ``a1`` whose NATS connection goes through ``proxy`` (pinged every 10 s: a blackhole
    of about a second goes unnoticed by its client, as a short outage does)."""
    host, port = proxy.address
    bus = JetStreamBus(bus_config(f"nats://{host}:{port}", cluster.subjects, "a1"))
    await bus.connect()
    agent_config = fast_agent_config(
        "a1", faults=FaultPlan(pace=pace), cache_events=CACHE_EVENTS, orphan_check_interval_s=0.0
    )
    agent = Agent(engine, bus, agent_config)
    try:
        await agent.start()
    except BaseException:
        await bus.close()
        raise
    cluster.agents["a1"] = agent  # the cluster stops it (through the proxy, healed by then)
    yield agent


async def stored_seqs(cluster: AgentCluster, incarnation: str) -> list[int]:
    """The ``seq`` of every batch of ``incarnation`` the kv stream holds, in stream order."""
    stored = await cluster.stored(cluster.subjects.kv_all, stream=cluster.subjects.kv_stream)
    bodies = [envelope.body for _subject, envelope in stored]
    return [b.seq for b in bodies if isinstance(b, KVCacheEvents) and b.incarnation == incarnation]


@pytest.mark.parametrize("reset", [False, True], ids=["blackhole-heals", "blackhole-then-reset"])
async def test_a_batch_the_agent_gave_up_in_an_outage_is_stored_late_or_lost_and_resynced(
    nats_url: str, reset: bool
) -> None:
    upstream = urlsplit(nats_url)
    assert upstream.hostname is not None and upstream.port is not None
    pace = StepPace(STEP_S)
    engine = SimEngine("tiny-test", num_blocks=64, prefix_cache=True)
    async with (
        ChaosProxy((upstream.hostname, upstream.port), name="a1-nats") as proxy,
        agent_cluster(nats_url) as cluster,
        agent_behind_proxy(cluster, proxy, engine, pace) as agent,
        connected(nats_url, cluster.subjects.prefix) as scheduler_bus,
        running(SchedulerService(scheduler_bus, config("primary"))) as scheduler,
    ):
        await scheduler.wait_active(10)
        index = scheduler.prefix
        publisher, agent_bus = agent.cache_events, agent.bus
        assert publisher is not None and isinstance(agent_bus, JetStreamBus)
        await serve(cluster, "warm", PROMPT)
        await until(lambda: set(CHAIN) <= index.hashes_of("a1"), "the index lists the prompt's blocks")

        # a request decoding for 3 s: every 4 tokens a block joins the cache, and a batch follows
        watcher = await cluster.watch("long")
        long = GenerateRequest(request_id="long", token_ids=tuple(range(500, 517)), sampling=greedy(60))
        assert (await cluster.generate("a1", long)).accepted
        await watcher.wait_tokens(4)

        proxy.blackhole()
        await until(lambda: publisher.num_failed >= 1, "the agent gave a cache batch up in the blackhole")
        assert proxy.stats.chunks_held > 0  # its appends are held by the proxy, not refused
        if reset:
            assert proxy.reset_all() >= 1  # what the proxy held for the agent dies with the connection
        proxy.heal()
        if reset:
            await until(lambda: agent_bus.num_reconnects >= 1, "the agent reconnected")
        await agent_bus.client.flush(timeout=5)  # its subscriptions are back on the server

        # a new prompt after the outage: its blocks go out in a batch numbered after the given-up one
        await serve(cluster, "after", tuple(range(700, 717)))
        pace.release()
        await watcher.close()
        await until(lambda: not engine.has_unfinished(), "the long request finished")
        await until(
            lambda: (
                not index.is_stale("a1")
                and publisher.num_syncs == (1 if reset else 0)
                and index.hashes_of("a1") == set(engine.cached_block_hashes())
            ),
            "the index equals the engine's cache",
        )
        seqs = await stored_seqs(cluster, publisher.incarnation)
        missing = sorted(set(range(1, max(seqs) + 1)) - set(seqs))
        assert len(seqs) == len(set(seqs))  # a batch tried twice is stored once
        if reset:
            assert missing, f"no batch was lost: stream holds seqs {seqs}"
            assert index.num_gaps == 1
            assert b"shoal_scheduler_prefix_index_resyncs_total 1.0" in scheduler.metrics.render()
        else:
            assert not missing, f"seqs {missing} never reached the stream"
            assert index.num_gaps == 0
        assert index.hashes_of("a1") == set(engine.cached_block_hashes())

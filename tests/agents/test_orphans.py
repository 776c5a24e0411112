"""Requests whose frontend is gone end on the agent within a bounded time (real nats-server).

A "frontend" here is a subscription on the request's token subject, as the
real one holds while it streams a request; when it goes away (the frontend
died), the agent's probes get *no responders* and the agent aborts the request:
its blocks are free again and it generates nothing more. A request whose
listener stays is never touched.
"""

from __future__ import annotations

import asyncio
import time

from schemas import GenerateRequest
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, greedy, sim_engine


async def test_a_request_nobody_listens_to_is_aborted_and_frees_its_blocks(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        engine = sim_engine(num_blocks=256, time_scale=20.0)  # ~20-40 ms a step: 4000 tokens take minutes
        agent = await cluster.add(engine, fast_agent_config("orphans", orphan_check_interval_s=0.3))
        kept = await cluster.watch("kept")
        dropped = await cluster.watch("dropped")
        for request_id in ("kept", "dropped"):
            reply = await cluster.generate(
                "orphans",
                GenerateRequest(request_id=request_id, token_ids=tuple(range(1, 9)), sampling=greedy(4000)),
            )
            assert reply.accepted
        await asyncio.sleep(1.0)  # three probe rounds with both listeners present: nothing aborted
        assert agent.num_orphans_aborted == 0 and sorted(agent.deltas.live_ids()) == ["dropped", "kept"]
        await dropped.close()  # the frontend of "dropped" is gone
        gone_at = time.monotonic()
        while agent.deltas.live("dropped") is not None:
            assert time.monotonic() - gone_at < 3.0, "the orphaned request still runs"
            await asyncio.sleep(0.05)
        assert agent.num_orphans_aborted == 1
        await asyncio.sleep(0.3)
        stats = engine.stats()
        assert stats.num_running + stats.num_waiting == 1  # only "kept" runs
        assert agent.deltas.live("kept") is not None
        await kept.close()
        while engine.has_unfinished():
            assert time.monotonic() - gone_at < 6.0
            await asyncio.sleep(0.05)
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks  # nothing held for the void

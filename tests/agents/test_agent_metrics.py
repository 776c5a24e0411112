"""An agent's Prometheus endpoint over real HTTP: engine gauges, step histograms and migrations move.

Two sim agents on a real nats-server; the source's registry is served by
prometheus_client's own HTTP server (what ``shoal agent --metrics-port``
starts) and scraped before traffic, after it, after a forced live migration
and after a migration refused for an unknown destination.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from agents.engines.sim import SimEngine
from schemas import GenerateRequest, MigrationAbortReason
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, greedy, sim_engine
from tests.scrape import scrape, serving, value


async def test_agent_metrics_move_with_traffic_and_a_forced_migration(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=3.0), fast_agent_config("a1"))
        await cluster.add(sim_engine(time_scale=3.0), fast_agent_config("a2"))
        with serving(a1.metrics.registry) as url:
            await asyncio.sleep(0.1)  # a load-report round took the engine's stats
            idle = await scrape(url)
            assert value(idle, "shoal_agent_kv_blocks") == 64
            assert value(idle, "shoal_agent_kv_blocks_free") == 64
            assert value(idle, "shoal_agent_step_duration_seconds_count") == 0
            reasons = {labels for name, labels in idle if name == "shoal_agent_migration_aborts_total"}
            assert reasons == {(("reason", r.value),) for r in MigrationAbortReason}  # every reason, at 0

            watcher = await cluster.watch("r1")
            prompt = tuple(range(1, 41))
            reply = await cluster.generate(
                "a1", GenerateRequest(request_id="r1", token_ids=prompt, sampling=greedy(120))
            )
            assert reply.accepted
            while len(watcher.tokens()) < 20:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            busy = await scrape(url)
            assert value(busy, "shoal_agent_num_requests_running") == 1
            assert value(busy, "shoal_agent_kv_blocks_used") >= 3  # 40 prompt + 20 tokens, 16 per block
            assert value(busy, "shoal_agent_kv_blocks_free") == 64 - value(busy, "shoal_agent_kv_blocks_used")
            assert value(busy, "shoal_agent_step_duration_seconds_count") >= 20
            assert value(busy, "shoal_agent_step_duration_seconds_sum") > 0
            assert value(busy, "shoal_agent_batch_size_count") >= 20

            outcome = await a1.migrate("r1", "a2")
            assert outcome.migrated, outcome.reason
            refused = await a1.migrate("r1", "nobody")
            assert refused.reason is MigrationAbortReason.UNKNOWN_DESTINATION
            await watcher.wait_finished()
            await watcher.close()
            await asyncio.sleep(0.1)
            moved = await scrape(url)
            assert value(moved, "shoal_agent_migrations_total", outcome="migrated") == 1
            assert value(moved, "shoal_agent_migrations_total", outcome="aborted") == 1
            assert value(moved, "shoal_agent_migration_aborts_total", reason="unknown_destination") == 1
            assert value(moved, "shoal_agent_migration_downtime_seconds_count") == 1
            assert value(moved, "shoal_agent_migration_stage_duration_seconds_count") == outcome.num_stages
            moved_bytes = sum(stage.num_bytes for stage in outcome.stages)
            assert value(moved, "shoal_agent_migration_bytes_total") == moved_bytes > 0
            assert value(moved, "shoal_agent_num_requests_running") == 0
            assert value(moved, "shoal_agent_kv_blocks_free") == 64  # the request left with its blocks


async def test_a_repeated_prompt_shows_as_prefix_cache_hits(nats_url: str) -> None:
    """The same 40-token prompt twice: the second finds all its full blocks but the last token's."""

    async def counters(url: str, queries: float | None = None) -> tuple[float, float]:
        """(queries, hits) once a load report shows the prefix cache (with ``queries`` if given)."""
        deadline = time.monotonic() + 5.0
        while True:
            samples = await scrape(url)
            seen = samples.get(("shoal_prefix_cache_queries_total", ()))
            if seen is not None and queries in (None, seen):
                return seen, value(samples, "shoal_prefix_cache_hits_total")
            assert time.monotonic() < deadline, f"no load report showed {queries} prefix-cache queries in 5 s"
            await asyncio.sleep(0.05)

    async with agent_cluster(nats_url) as cluster:
        engine = SimEngine("tiny-test", num_blocks=64, prefix_cache=True)
        agent = await cluster.add(engine, fast_agent_config("a1"))
        block_size = engine.info.block_size
        prompt = tuple(range(10, 50))  # not the warm-up's prompt (1, 2, 3, 4), whose block is cached too
        with serving(agent.metrics.registry) as url:
            queries, hits = await counters(url)  # the warm-up request's
            for request_id in ("first", "again"):
                watcher = await cluster.watch(request_id)
                reply = await cluster.generate(
                    "a1", GenerateRequest(request_id=request_id, token_ids=prompt, sampling=greedy(4))
                )
                assert reply.accepted
                await watcher.wait_finished()
                await watcher.close()
            _, after = await counters(url, queries + 2 * len(prompt))
            assert after - hits == (len(prompt) - 1) // block_size * block_size > 0
            samples = await scrape(url)
            assert value(samples, "shoal_prefix_cache_evictions_total") == 0
            assert value(samples, "shoal_prefix_cache_blocks") >= len(prompt) // block_size


async def test_a_blocked_event_loop_is_measured_and_logged(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """While the agent's loop is blocked nothing it serves answers; the lag histogram and a warning say so."""
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(sim_engine(), fast_agent_config("a1"))
        with serving(a1.metrics.registry) as url:
            await asyncio.sleep(0.3)
            before = await scrape(url)
            assert value(before, "shoal_agent_loop_lag_seconds_count") >= 1
            assert value(before, "shoal_agent_loop_lag_seconds_bucket", le="1.0") == value(
                before, "shoal_agent_loop_lag_seconds_count")
            with caplog.at_level(logging.WARNING, logger="agents.service"):
                time.sleep(1.3)  # what a blocking call on the agent's loop does
                await asyncio.sleep(0.3)
            after = await scrape(url)
        late = value(after, "shoal_agent_loop_lag_seconds_count") - value(
            after, "shoal_agent_loop_lag_seconds_bucket", le="1.0")
        assert late == 1
        assert any("a1: event loop blocked for 1." in record.getMessage() for record in caplog.records)

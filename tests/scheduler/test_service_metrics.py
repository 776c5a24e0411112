"""The scheduler's Prometheus endpoint over real HTTP: decisions, their latency, appends, lease and role.

A scheduler service and fake agents on a real nats-server; its registry is
served by prometheus_client's HTTP server (what ``shoal scheduler
--metrics-port`` starts) and scraped before it is active and after dispatches.
"""

from __future__ import annotations

import asyncio

from scheduler.service import SchedulerConfig, SchedulerService
from tests.scheduler.service_helpers import FakeAgent, connected, delete_streams, new_prefix, place
from tests.scheduler.test_service_dispatch import FAST, running
from tests.scrape import scrape, serving, value


async def test_scheduler_metrics_move_with_dispatches(nats_url: str) -> None:
    prefix = new_prefix()
    try:
        async with connected(nats_url, prefix) as agent_bus, connected(nats_url, prefix) as sched_bus:
            agents = [FakeAgent(agent_bus, "i0"), FakeAgent(agent_bus, "i1")]
            for agent in agents:
                await agent.start()
            service = SchedulerService(sched_bus, SchedulerConfig(**FAST))  # type: ignore[arg-type]
            with serving(service.metrics.registry) as url:
                before = await scrape(url)
                assert value(before, "shoal_scheduler_role", role="starting") == 1
                assert value(before, "shoal_scheduler_role", role="active") == 0
                assert value(before, "shoal_scheduler_decisions_total", kind="dispatched") == 0
                async with running(service):
                    await service.wait_active(10)
                    replies = [await place(agent_bus, f"r{k}") for k in range(5)]
                    assert all(reply.instance_id is not None for reply in replies)
                    await asyncio.sleep(0.3)
                    after = await scrape(url)
                assert value(after, "shoal_scheduler_role", role="active") == 1
                assert value(after, "shoal_scheduler_role", role="standby") == 0
                assert value(after, "shoal_scheduler_lease_epoch") == service.epoch >= 1
                assert value(after, "shoal_scheduler_decisions_total", kind="dispatched") == 5
                assert value(after, "shoal_scheduler_decisions_total", kind="tick") >= 1  # the takeover's
                assert value(after, "shoal_scheduler_dispatch_decision_seconds_count") == 5
                assert 0 < value(after, "shoal_scheduler_dispatch_decision_seconds_sum") < 5
                assert value(after, "shoal_scheduler_event_log_append_seconds_count") >= 6
                # its own dispatch decisions come back through the events stream it follows
                assert value(after, "shoal_scheduler_event_log_read_lag_seconds_count", stream="events") >= 5
                assert value(after, "shoal_scheduler_event_log_read_lag_seconds_count", stream="loads") >= 1
                assert value(after, "shoal_scheduler_dispatch_failures_total", reason="no_instance") == 0
            for agent in agents:
                await agent.stop()
    finally:
        await delete_streams(nats_url, prefix)

"""The event log on a 3-node NATS cluster with R3 streams survives losing the leader of the event stream.

Under a steady load of appends (request lifecycle events, each with a message
id) and dispatches served by a real scheduler, the node leading the event
stream is killed with SIGKILL and restarted on its store a few seconds later.
Every acknowledged append is in the log afterwards with its data (sequences
compared one by one; no gap, no duplicate), the scheduler holds the lease
again (same or higher epoch) and places requests, and the longest time
without an acknowledgement is measured and printed (see README, "Security
and replication", for the figure and what shoal's resends do with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bus import BusError, JetStreamBus
from bus.cluster import EmbeddedCluster
from scheduler.service import SchedulerConfig, SchedulerService
from tests.scheduler.service_helpers import FakeAgent, bus_config, new_prefix, place
from tests.scheduler.test_service_dispatch import FAST, running

pytestmark = pytest.mark.slow

RATE_HZ = 100
BEFORE_KILL_S, DOWN_S, AFTER_RESTART_S = 2.0, 4.0, 3.0


def _r3(url: str, prefix: str) -> JetStreamBus:
    base = bus_config(url, prefix)
    # appends resend every ack_timeout until acknowledged or append_timeout passes (inside the dedup window)
    streams = replace(base.streams, replicas=3, duplicate_window=60.0)
    return JetStreamBus(replace(base, streams=streams, append_timeout=30.0, api_timeout=3.0))


async def test_r3_log_loses_no_acknowledged_event_when_the_stream_leader_is_killed(tmp_path: Path) -> None:
    prefix = new_prefix()
    with EmbeddedCluster(tmp_path / "nats", size=3) as cluster:
        writer, sched_bus, agent_bus = (
            _r3(cluster.url, prefix),
            _r3(cluster.url, prefix),
            _r3(cluster.url, prefix),
        )
        for bus in (writer, sched_bus, agent_bus):
            await bus.connect()
        subjects = writer.config.subjects
        info = await writer.client.jsm().stream_info(subjects.events_stream)
        assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2
        agents = [FakeAgent(agent_bus, f"i{k}", answers_probes=True) for k in range(2)]
        for agent in agents:
            await agent.start()
        # the default failure timeout (3 s), shorter than the outage: load reports pause while a stream has no
        # leader, and the scheduler must ask the agents before it calls them failed
        config = SchedulerConfig(**{**FAST, "lease_ttl_s": 3.0, "failure_timeout_s": 3.0})  # type: ignore[arg-type]
        service = SchedulerService(sched_bus, config)
        acked: dict[int, bytes] = {}
        ack_times: list[float] = []
        failures: list[str] = []
        placed: list[str] = []
        unplaced: list[str] = []
        stop = asyncio.Event()

        async def one(n: int) -> None:
            data = f"event {n}".encode()
            try:
                position = await writer.append(subjects.req(f"r{n}"), data, msg_id=f"{prefix}-{n}")
            except BusError as exc:
                failures.append(f"{n}: {exc!r}")
                return
            acked[position.seq] = data
            ack_times.append(time.monotonic())

        async def load() -> None:
            tasks, n = [], 0
            while not stop.is_set():
                tasks.append(asyncio.create_task(one(n)))
                n += 1
                await asyncio.sleep(1 / RATE_HZ)
            await asyncio.gather(*tasks)

        async def dispatches() -> None:
            k = 0
            while not stop.is_set():
                try:
                    reply = await place(agent_bus, f"d{k}")
                    (placed if reply.instance_id else unplaced).append(f"d{k}")
                except BusError:
                    unplaced.append(f"d{k}")  # a frontend would place it itself (bypass)
                k += 1
                await asyncio.sleep(0.1)

        async with running(service):
            await service.wait_active(20)
            epoch_before = service.epoch
            started = time.monotonic()
            workers = [asyncio.create_task(load()), asyncio.create_task(dispatches())]
            await asyncio.sleep(BEFORE_KILL_S)
            leader = (await writer.client.jsm().stream_info(subjects.events_stream)).cluster.leader
            assert leader is not None
            killed_at = time.monotonic()
            cluster.node(leader).kill()
            await asyncio.sleep(DOWN_S)
            await asyncio.to_thread(cluster.restart, leader)
            await asyncio.sleep(AFTER_RESTART_S)
            stop.set()
            await asyncio.gather(*workers)
            await service.wait_active(30)
            # dispatch works again once the log has a leader: within a few report intervals on a loaded
            # machine (the agents' reports, paused by the outage, must reach the scheduler first)
            deadline, reasons = time.monotonic() + 10.0, list[object]()
            while (after := await place(agent_bus, f"after{len(reasons)}")).instance_id is None:
                reasons.append(after.reason)
                assert time.monotonic() < deadline, reasons
                await asyncio.sleep(0.2)
            epoch_after = service.epoch

        gaps = [b - a for a, b in zip([started, *ack_times], ack_times, strict=False)]
        longest = max(gaps)
        new_leader = (await writer.client.jsm().stream_info(subjects.events_stream)).cluster.leader
        reader = _r3(cluster.url, prefix)
        await reader.connect()
        stored: dict[int, bytes] = {}
        async with reader.replay(subjects.events_stream, subjects=[f"{prefix}.ev.req.>"]) as feed:
            async for message in feed:
                assert message.position.seq not in stored
                stored[message.position.seq] = message.data
        for bus in (reader, writer, sched_bus, agent_bus):
            with contextlib.suppress(Exception):
                await bus.close()
    print(
        f"\nR3 leader kill: {len(acked)} appends acknowledged, {len(failures)} failed, "
        f"longest time without an ack {longest:.2f} s (kill at +{killed_at - started:.1f} s, "
        f"leader {leader} -> {new_leader}); dispatches placed {len(placed)}, not placed {len(unplaced)}; "
        f"scheduler epoch {epoch_before} -> {epoch_after}, bus restarts {service.stats.bus_restarts}; "
        f"agents failed {service.stats.failures_detected}, failures averted by a probe "
        f"{service.stats.failures_averted}"
    )
    assert service.stats.failures_detected == 0  # both agents lived throughout
    assert not failures, failures[:5]
    assert acked and all(stored.get(seq) == data for seq, data in acked.items())  # nothing acknowledged lost
    assert len({data for data in stored.values()}) == len(stored)  # resends stored once (message ids)
    assert epoch_after >= epoch_before
    assert placed


async def test_an_r3_bus_started_with_its_cluster_waits_for_the_third_node(tmp_path: Path) -> None:
    """Components started alongside their NATS cluster (``shoal up --nats-cluster 3``, a rollout)
    wait for the nodes an R3 stream needs, instead of failing with "no suitable peers"."""
    cluster = EmbeddedCluster(tmp_path / "nats", size=3, die_with_parent=True)
    late: asyncio.TimerHandle | None = None
    try:
        for node in cluster.nodes[:2]:  # two of three: a meta leader, too few peers for R3
            node.start()
        cluster.wait_healthy()
        late = asyncio.get_running_loop().call_later(1.5, cluster.nodes[2].start)
        bus = _r3(cluster.nodes[0].url, new_prefix())
        started = time.monotonic()
        await bus.connect()
        waited = time.monotonic() - started
        info = await bus.client.jsm().stream_info(bus.config.subjects.events_stream)
        await bus.close()
        assert info.config.num_replicas == 3
        assert waited >= 1.0  # it was created once the third node was up, not before
    finally:
        if late is not None:
            late.cancel()  # a failed connect must not leave the third node to start after the stop
        cluster.stop()

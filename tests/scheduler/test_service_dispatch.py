"""The scheduler service on a real nats-server: dispatch, pairing, failures, and replay of what it did."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from bus.errors import BusError
from scheduler.cluster_state import InstanceStatus, encode_snapshot
from scheduler.config import PairingConfig, PolicyConfig, ScalingConfig
from scheduler.instances import RecordingManager
from scheduler.lease import LEASE_KEY, LeaseRecord
from scheduler.logfile import read_bus_log
from scheduler.replay import replay_log
from scheduler.service import LEASE_POLL_MIN_S, SchedulerConfig, SchedulerService
from schemas import Codec
from schemas.decisions import Dispatched, Paired, ScaleDown, ScaleUp, SchedulerTick
from schemas.instance import InstanceFailed
from schemas.reasons import DispatchFailReason, FailureReason
from schemas.rpc import DispatchRequest
from tests.scheduler.service_helpers import FakeAgent, connected, delete_streams, dispatch, new_prefix, place

FAST = dict(lease_ttl_s=1.0, pairing_interval_s=0.1, failure_timeout_s=1.0, snapshot_every_s=0.5)


@contextlib.asynccontextmanager
async def running(service: SchedulerService) -> AsyncIterator[SchedulerService]:
    task = asyncio.create_task(service.run())
    try:
        yield service
    finally:
        await service.stop()
        await asyncio.wait_for(task, 10)


@pytest.fixture
async def cluster(nats_url: str) -> AsyncIterator[tuple[str, str]]:
    prefix = new_prefix()
    yield nats_url, prefix
    await delete_streams(nats_url, prefix)


async def _decisions(bus: object) -> list[object]:
    log = await read_bus_log(bus)  # type: ignore[arg-type]
    codec = Codec()
    return [codec.decode(entry.data).body for entry in log.events]


async def test_dispatch_spreads_load_and_every_decision_replays_exactly(cluster: tuple[str, str]) -> None:
    url, prefix = cluster
    async with connected(url, prefix) as agent_bus, connected(url, prefix) as sched_bus:
        agents = [
            FakeAgent(agent_bus, "i0", hog_blocks=398),
            FakeAgent(agent_bus, "i1"),
            FakeAgent(agent_bus, "i2"),
        ]
        for agent in agents:
            await agent.start()
        service = SchedulerService(sched_bus, SchedulerConfig(**FAST))  # type: ignore[arg-type]
        async with running(service):
            await service.wait_active(10)
            replies = []
            for wave in range(6):
                replies += await asyncio.gather(*(place(agent_bus, f"r{wave}-{k}") for k in range(25)))
                await asyncio.sleep(0.07)
            await asyncio.sleep(0.5)
        assert all(reply.instance_id is not None for reply in replies)
        placed = {reply.instance_id for reply in replies}
        assert placed == {"i1", "i2"}  # the hogged instance is never the freest
        bodies = await _decisions(agent_bus)
        dispatched = [b for b in bodies if isinstance(b, Dispatched)]
        assert {d.request_id for d in dispatched} == {r.request_id for r in replies}
        assert all(d.events_seq > 0 and d.loads_seq > 0 for d in dispatched)
        assert any(isinstance(b, Paired) and b.source_id == "i0" for b in bodies)

        log = await read_bus_log(agent_bus)
        first, second = replay_log(log), replay_log(log)
        assert encode_snapshot(first.state) == encode_snapshot(second.state)
        assert first.mismatches == []
        recomputed = [row for row in first.decisions if isinstance(row.decision, (Dispatched, Paired))]
        assert len(recomputed) >= len(dispatched)
        assert first.state.num_dispatched == len(dispatched)
        for agent in agents:
            await agent.stop()


async def test_silent_instance_is_marked_failed_and_no_longer_chosen(cluster: tuple[str, str]) -> None:
    url, prefix = cluster
    async with connected(url, prefix) as agent_bus, connected(url, prefix) as sched_bus:
        alive, dying = FakeAgent(agent_bus, "a"), FakeAgent(agent_bus, "b", num_blocks=4000)
        await alive.start()
        await dying.start()
        service = SchedulerService(sched_bus, SchedulerConfig(**FAST))  # type: ignore[arg-type]
        async with running(service):
            await service.wait_active(10)
            await asyncio.sleep(0.3)
            assert (await dispatch(agent_bus, "before")).instance_id == "b"  # the bigger one is freer
            await dying.stop()
            for _ in range(60):
                await asyncio.sleep(0.1)
                record = service.view().instances.get("b")
                if record is not None and record.status is InstanceStatus.FAILED:
                    break
            assert (await dispatch(agent_bus, "after")).instance_id == "a"
        bodies = await _decisions(agent_bus)
        failed = [b for b in bodies if isinstance(b, InstanceFailed)]
        assert [f.instance_id for f in failed] == ["b"] and failed[0].epoch == service.epoch
        assert failed[0].reason is FailureReason.NO_LOAD_REPORT and "no load report" in failed[0].detail
        await alive.stop()


async def test_an_instance_whose_reports_stall_on_the_bus_is_not_failed(cluster: tuple[str, str]) -> None:
    """Reports lost on the way for 3 failure timeouts (a loads stream without a leader): the scheduler
    asks the instance, it says it is still sending them, so it stays live. Once its report loop stops
    while it still answers (an agent stuck in its shutdown), the answer no longer saves it."""
    url, prefix = cluster
    async with connected(url, prefix) as agent_bus, connected(url, prefix) as sched_bus:
        alive, stalled = FakeAgent(agent_bus, "a"), FakeAgent(agent_bus, "b", answers_probes=True)
        await alive.start()
        await stalled.start()
        service = SchedulerService(sched_bus, SchedulerConfig(**FAST))  # type: ignore[arg-type]
        async with running(service):
            await service.wait_active(10)
            await asyncio.sleep(0.3)
            stalled.reports_land = False
            await asyncio.sleep(3.5 * FAST["failure_timeout_s"])
            assert service.view().instances["b"].status is not InstanceStatus.FAILED
            assert service.stats.failures_averted >= 2
            metrics = service.metrics.render().decode()
            assert 'shoal_scheduler_failure_probes_total{result="alive"} 0.0' not in metrics
            stalled.reports_land = True
            await asyncio.sleep(0.5)
            assert service.view().instances["b"].status is not InstanceStatus.FAILED
            await stalled.pause_reports()  # answers probes, sends nothing: not doing its job
            for _ in range(60):
                await asyncio.sleep(0.1)
                if service.view().instances["b"].status is InstanceStatus.FAILED:
                    break
            assert service.view().instances["b"].status is InstanceStatus.FAILED
            metrics = service.metrics.render().decode()
            assert 'shoal_scheduler_failure_probes_total{result="not_reporting"} 1.0' in metrics
            assert service.view().instances["a"].status is not InstanceStatus.FAILED
        bodies = await _decisions(agent_bus)
        assert [b.instance_id for b in bodies if isinstance(b, InstanceFailed)] == ["b"]
        await alive.stop()
        await stalled.stop()


async def test_only_the_lease_holder_decides_and_a_standby_takes_over(cluster: tuple[str, str]) -> None:
    url, prefix = cluster
    async with (
        connected(url, prefix) as agent_bus,
        connected(url, prefix) as bus_a,
        connected(url, prefix) as bus_b,
    ):
        agent = FakeAgent(agent_bus, "x")
        await agent.start()
        first = SchedulerService(bus_a, SchedulerConfig(scheduler_id="A", **FAST))  # type: ignore[arg-type]
        second = SchedulerService(bus_b, SchedulerConfig(scheduler_id="B", standby=True, **FAST))  # type: ignore[arg-type]
        task_a = asyncio.create_task(first.run())
        await first.wait_active(10)
        async with running(second):
            await asyncio.sleep(0.5)
            assert second.role.value == "standby"
            # a standby folds every decision, but reads the lease at its own pace, not per message
            attempts, started = second.lease.attempts, time.monotonic()
            for i in range(100):
                await dispatch(agent_bus, f"paced{i}")
                await asyncio.sleep(0.01)
            polls = second.lease.attempts - attempts
            assert polls <= (time.monotonic() - started) / LEASE_POLL_MIN_S + 2, polls
            refused = second.dispatch(DispatchRequest(request_id="z", num_prompt_tokens=3))
            assert refused.instance_id is None and refused.reason is DispatchFailReason.NOT_ACTIVE
            assert (await dispatch(agent_bus, "one")).epoch == first.epoch
            await first.stop()  # a clean stop releases the lease at once
            await asyncio.wait_for(task_a, 10)
            await second.wait_active(5)
            reply = await dispatch(agent_bus, "two")
            assert reply.instance_id == "x" and reply.epoch == second.epoch > first.epoch
            assert second.shadow is not None and second.shadow.mismatches == []
        ticks = [b for b in await _decisions(agent_bus) if isinstance(b, SchedulerTick) and b.takeover]
        assert [t.epoch for t in ticks] == [first.epoch, second.epoch]
        await agent.stop()


async def _steady_load(bus: object, prefix: str, count: int, rate: float, placed: dict[str, str]) -> None:
    """Place ``count`` requests at ``rate``/s; a request retries until some scheduler places it."""

    async def one(request_id: str) -> None:
        while True:
            try:
                reply = await dispatch(bus, request_id, timeout=0.5)  # type: ignore[arg-type]
            except Exception:  # no responders / timeout while no scheduler is active
                reply = None
            if reply is not None and reply.instance_id is not None:
                placed[request_id] = reply.instance_id
                return
            await asyncio.sleep(0.05)

    tasks = []
    for k in range(count):
        tasks.append(asyncio.create_task(one(f"{prefix}-{k}")))
        await asyncio.sleep(1 / rate)
    await asyncio.gather(*tasks)


async def test_crash_recovery_by_standby_and_by_restart_matches_recomputation(
    cluster: tuple[str, str],
) -> None:
    url, prefix = cluster
    async with (
        connected(url, prefix) as agent_bus,
        connected(url, prefix) as bus_a,
        connected(url, prefix) as bus_b,
        connected(url, prefix) as bus_c,
    ):
        agents = [FakeAgent(agent_bus, f"s{k}", hog_blocks=398 if k == 0 else 0) for k in range(4)]
        for agent in agents:
            await agent.start()
        config = dict(FAST, snapshot_every_events=200)
        first = SchedulerService(bus_a, SchedulerConfig(scheduler_id="A", **config))  # type: ignore[arg-type]
        task_a = asyncio.create_task(first.run())
        await first.wait_active(10)
        standby = SchedulerService(bus_b, SchedulerConfig(scheduler_id="B", standby=True, **config))  # type: ignore[arg-type]
        task_b = asyncio.create_task(standby.run())
        placed: dict[str, str] = {}
        load = asyncio.create_task(_steady_load(agent_bus, "req", 600, 150.0, placed))
        await asyncio.sleep(0.8)
        assert first.stats.snapshots >= 1
        first.crash()  # kill -9: no lease release, outbox lost
        await asyncio.wait_for(task_a, 10)
        await standby.wait_active(10)
        assert standby.epoch == first.epoch + 1
        await asyncio.sleep(0.3)
        restarted = SchedulerService(bus_c, SchedulerConfig(scheduler_id="C", **config))  # type: ignore[arg-type]
        task_c = asyncio.create_task(restarted.run())
        await asyncio.sleep(0.5)
        standby.crash()
        await asyncio.wait_for(task_b, 10)
        await restarted.wait_active(10)
        await asyncio.wait_for(load, 60)
        await asyncio.sleep(0.3)
        await restarted.stop()
        await asyncio.wait_for(task_c, 10)

        assert len(placed) == 600  # no dispatch lost: each was answered by some scheduler
        assert standby.shadow is not None
        assert restarted.stats.dispatched > 0 and standby.stats.dispatched > 0
        result = replay_log(await read_bus_log(agent_bus))
        assert result.mismatches == []
        epochs = {row.decision.epoch for row in result.decisions if row.matches}  # type: ignore[union-attr]
        assert {first.epoch, standby.epoch, restarted.epoch} <= epochs
        for agent in agents:
            await agent.stop()


async def test_a_scheduler_whose_lease_is_taken_stops_deciding_and_rejoins_under_a_new_epoch(
    cluster: tuple[str, str],
) -> None:
    url, prefix = cluster
    async with connected(url, prefix) as agent_bus, connected(url, prefix) as sched_bus:
        agent = FakeAgent(agent_bus, "only")
        await agent.start()
        service = SchedulerService(sched_bus, SchedulerConfig(scheduler_id="A", **FAST))  # type: ignore[arg-type]
        async with running(service):
            await service.wait_active(10)
            first_epoch = service.epoch
            entry = await agent_bus.kv_get(LEASE_KEY)
            assert entry is not None
            usurper = LeaseRecord(holder="partitioned-peer", epoch=first_epoch + 5, ttl_s=1.0)
            await agent_bus.kv_update(
                LEASE_KEY, msgspec.msgpack.encode(usurper), last_revision=entry.revision
            )
            for _ in range(50):
                await asyncio.sleep(0.1)
                if service.stats.step_downs:
                    break
            assert service.stats.step_downs == 1
            with pytest.raises(BusError):  # deposed: it no longer answers (the usurper's lease runs 1 s)
                await dispatch(agent_bus, "while-deposed", timeout=0.3)
            await service.wait_active(10)  # the usurper never renews: A takes the lease back
            assert service.epoch == first_epoch + 6
            reply = await dispatch(agent_bus, "after")
            assert reply.instance_id == "only" and reply.epoch == first_epoch + 6
        result = replay_log(await read_bus_log(agent_bus))
        assert result.mismatches == [] and result.state.epoch == first_epoch + 6
        await agent.stop()


async def test_scaling_decisions_are_logged_and_carried_out_by_the_instance_manager(
    cluster: tuple[str, str],
) -> None:
    url, prefix = cluster
    async with connected(url, prefix) as agent_bus, connected(url, prefix) as sched_bus:
        busy = FakeAgent(agent_bus, "busy", hog_blocks=398)
        await busy.start()
        manager = RecordingManager()
        policy = PolicyConfig(scaling=ScalingConfig(sustain_s=0.2, min_instances=1, max_instances=3))
        config = SchedulerConfig(policy=policy, **FAST)  # type: ignore[arg-type]
        service = SchedulerService(sched_bus, config, instance_manager=manager)
        async with running(service):
            await service.wait_active(10)
            for _ in range(50):
                await asyncio.sleep(0.1)
                if manager.started:
                    break
            assert manager.started == ["scaled-0"]  # one at a time: the launched one has not joined
            idle = [FakeAgent(agent_bus, f"idle{k}") for k in range(2)]
            for agent in idle:
                await agent.start()  # the cluster is now mostly free: scale down the emptiest
            for _ in range(50):
                await asyncio.sleep(0.1)
                if any(r.status is InstanceStatus.TERMINATING for r in service.view().instances.values()):
                    break
            terminating = [
                k for k, r in service.view().instances.items() if r.status is InstanceStatus.TERMINATING
            ]
            assert terminating == ["idle0"]  # fewest running, then id
            assert (await dispatch(agent_bus, "after-scale-down")).instance_id == "idle1"
        bodies = await _decisions(agent_bus)
        assert [b.num_instances for b in bodies if isinstance(b, ScaleUp)] == [1]
        assert [b.instance_id for b in bodies if isinstance(b, ScaleDown)] == ["idle0"]
        for agent in [busy, *idle]:
            await agent.stop()


async def test_a_new_scheduler_waits_for_the_instances_started_beside_it(cluster: tuple[str, str]) -> None:
    """`shoal up --autoscale` starts the scheduler before its agents: the scheduler does not start
    agents of its own in their place while they join; with none joined by the grace's end, it does."""
    url, prefix = cluster
    async with connected(url, prefix) as agent_bus, connected(url, prefix) as sched_bus:
        manager = RecordingManager()
        scaling = ScalingConfig(sustain_s=0.2, min_instances=1, max_instances=3, startup_grace_s=1.5)
        config = SchedulerConfig(policy=PolicyConfig(scaling=scaling), **FAST)  # type: ignore[arg-type]
        service = SchedulerService(sched_bus, config, instance_manager=manager)
        async with running(service):
            await service.wait_active(10)
            await asyncio.sleep(0.8)  # ticks every 0.1 s with no instance, inside the grace
            assert manager.started == []
            for _ in range(50):
                await asyncio.sleep(0.1)
                if manager.started:
                    break
            assert manager.started == ["scaled-0"]  # the grace ran out: min_instances at once

    prefix = new_prefix()  # a new cluster (the log above holds a launch that never joined)
    async with connected(url, prefix) as agent_bus, connected(url, prefix) as sched_bus:
        manager = RecordingManager()
        scaling = ScalingConfig(sustain_s=0.2, min_instances=1, max_instances=3, startup_grace_s=30)
        config = SchedulerConfig(policy=PolicyConfig(scaling=scaling), **FAST)  # type: ignore[arg-type]
        service = SchedulerService(sched_bus, config, instance_manager=manager)
        async with running(service):
            await service.wait_active(10)
            await asyncio.sleep(0.5)
            beside = FakeAgent(agent_bus, "beside")  # joins late, as an agent of `shoal up` may
            await beside.start()
            for _ in range(30):
                await asyncio.sleep(0.1)
                if "beside" in service.view().instances:
                    break
            await asyncio.sleep(1.0)
            assert manager.started == []
            await beside.stop()
    await delete_streams(url, prefix)


async def test_a_standby_recovered_from_a_snapshot_verifies_with_the_active_s_recorded_policy(
    cluster: tuple[str, str],
) -> None:
    """The takeover tick precedes the snapshot; the snapshot carries the policy, so pairings still verify."""
    url, prefix = cluster
    policy = PolicyConfig(pairing=PairingConfig(target_freeness=7.0))  # the standby runs the defaults
    async with (
        connected(url, prefix) as agent_bus,
        connected(url, prefix) as bus_a,
        connected(url, prefix) as bus_b,
    ):
        cold = FakeAgent(agent_bus, "cold")
        await cold.start()
        active = SchedulerService(bus_a, SchedulerConfig(scheduler_id="A", policy=policy, **FAST))  # type: ignore[arg-type]
        async with running(active):
            await active.wait_active(10)
            async with asyncio.timeout(10):  # TimeoutError: the active scheduler wrote no snapshot
                while active.stats.snapshots < 1:
                    await asyncio.sleep(0.1)
            standby = SchedulerService(bus_b, SchedulerConfig(scheduler_id="B", standby=True, **FAST))  # type: ignore[arg-type]
            async with running(standby):
                async with asyncio.timeout(10):  # TimeoutError: the second scheduler did not stand by
                    while standby.role.value != "standby":
                        await asyncio.sleep(0.05)
                hot = FakeAgent(agent_bus, "hot", hog_blocks=398)  # joins now: a pairing the standby sees
                await hot.start()
                assert standby.shadow is not None
                for _ in range(100):
                    if standby.shadow.stats.verified or standby.shadow.mismatches:
                        break
                    await asyncio.sleep(0.1)
                assert standby.shadow.mismatches == []
                assert standby.shadow.stats.verified >= 1
                assert standby.shadow.policies[active.epoch] == policy
                await hot.stop()
        paired = [b for b in await _decisions(agent_bus) if isinstance(b, Paired)]
        assert paired and {p.target_freeness for p in paired} == {7.0}
        await cold.stop()

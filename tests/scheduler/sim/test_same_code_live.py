"""Same code: a live run's recorded reports and decisions, fed to the simulator's policy layer.

A cluster of in-process ``sim`` agents and the scheduler service runs on a
real nats-server under a burst of requests tight enough that instances leave
the freeness band and are paired for migration. Both recorded streams are read
back and given to :func:`scheduler.sim.policy_layer.replay_recorded_log`,
which drives the simulator's :class:`~scheduler.sim.policy_layer.PolicyLayer`
at the fold points the log records: every dispatch and pairing decision it
makes equals the recorded one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import msgspec
import pytest

from agents.agent import Agent
from agents.engines.sim import SimEngine
from bus.protocol import Bus
from scheduler.config import DispatchPolicy, PairingConfig, PolicyConfig, shoal_pairing
from scheduler.logfile import RecordedLog, read_bus_log
from scheduler.replay import ReplayOptions, replay_log
from scheduler.service import SchedulerConfig, SchedulerService
from scheduler.sim.policy_layer import replay_recorded_log
from schemas import Codec
from schemas.decisions import Dispatched, Paired, Unpaired
from schemas.envelope import Body
from schemas.load import LoadReport
from schemas.rpc import DispatchReply, DispatchRequest, GenerateRequest, SamplingParams
from schemas.tokens import TokenDelta
from tests.scheduler.service_helpers import connected, delete_streams, live_agent_config, new_prefix

pytestmark = pytest.mark.slow

AGENT = live_agent_config()
POLICY = PolicyConfig(pairing=PairingConfig(low_freeness=35, high_freeness=70))
#: shoal's default policy (queue-aware dispatch, pairing with the room check) on the same band.
SHOAL_POLICY = PolicyConfig(
    dispatch_policy=DispatchPolicy.BLOCKS_AHEAD, pairing=shoal_pairing(low_freeness=35, high_freeness=70)
)
#: shoal's policy with the running requests' expected decode growth (learned by each agent from the
#: requests it finished) taken off every instance's room.
GROWTH_POLICY = PolicyConfig(
    dispatch_policy=DispatchPolicy.BLOCKS_AHEAD_GROWTH,
    pairing=shoal_pairing(low_freeness=35, high_freeness=70),
)
#: shoal's policy with the prompts admitted but not yet prefilled counted as work ahead.
PREFILL_POLICY = PolicyConfig(
    dispatch_policy=DispatchPolicy.PREFILL_AHEAD,
    pairing=shoal_pairing(low_freeness=35, high_freeness=70),
)
NUM_REQUESTS = 48


async def _request(bus: Bus, request_id: str, finished: list[str]) -> DispatchReply:
    """What a frontend does: dispatch through the scheduler, send to the chosen agent, await the end."""
    codec = Codec(producer="test-frontend")
    subjects = bus.config.subjects
    subscription = await bus.subscribe(subjects.tok(request_id))
    message = await bus.request(
        subjects.rpc_dispatch,
        codec.encode(DispatchRequest(request_id=request_id, num_prompt_tokens=96), time=time.time()),
        timeout=2.0,
    )
    reply = codec.decode(message.data).body
    assert isinstance(reply, DispatchReply) and reply.instance_id is not None, reply
    generate = GenerateRequest(
        request_id=request_id,
        token_ids=tuple(range(1, 97)),
        stream=False,
        sampling=SamplingParams(max_tokens=96, ignore_eos=True),
    )
    await bus.request(
        subjects.rpc_agent(reply.instance_id, "generate"),
        codec.encode(generate, time=time.time()),
        timeout=2.0,
    )
    async with subscription:
        async for delta_message in subscription:
            delta = codec.decode(delta_message.data).body
            if isinstance(delta, TokenDelta) and delta.finish_reason is not None:
                finished.append(request_id)
                break
    return reply


def _decoded(log: RecordedLog) -> tuple[list[tuple[int, Body]], list[tuple[int, LoadReport]]]:
    codec = Codec()
    events = [(entry.seq, codec.decode(entry.data).body) for entry in log.events]
    loads = []
    for entry in log.loads:
        body = codec.decode(entry.data).body
        assert isinstance(body, LoadReport)
        loads.append((entry.seq, body))
    return events, loads


async def _start_agent(bus: Bus, instance_id: str) -> Agent:
    engine = SimEngine("llama-7b-a10", num_blocks=120, time_scale=0.3)
    agent = Agent(engine, bus, replace(AGENT, instance_id=instance_id))
    await agent.start()
    return agent


async def _live_run(
    url: str, prefix: str, policy: PolicyConfig
) -> tuple[RecordedLog, list[DispatchReply], list[str]]:
    """Two agents filled by a concurrent burst, then a third joins (a pair forms), then more waves."""
    agents: list[Agent] = []
    async with connected(url, prefix) as client, connected(url, prefix) as sched_bus:
        try:
            agents += [await _start_agent(client, "sim0"), await _start_agent(client, "sim1")]
            service = SchedulerService(
                sched_bus,
                SchedulerConfig(
                    policy=policy,
                    scheduler_id="live",
                    lease_ttl_s=2.0,
                    pairing_interval_s=0.1,
                    snapshot_every_s=1.0,
                    failure_timeout_s=5.0,
                ),
            )
            task = asyncio.create_task(service.run())
            try:
                await service.wait_active(10)
                await asyncio.sleep(0.3)  # both agents have reported
                finished: list[str] = []
                # concurrent dispatches: decided faster than their own events come back (the overlay)
                requests = [asyncio.create_task(_request(client, f"q{k}", finished)) for k in range(16)]
                await asyncio.sleep(0.3)  # both agents are full: freeness below the low threshold
                agents.append(await _start_agent(client, "sim2"))  # a free instance: a destination
                await asyncio.sleep(0.3)
                for wave in range(4):
                    requests += [
                        asyncio.create_task(_request(client, f"q{16 + 8 * wave + k}", finished))
                        for k in range(8)
                    ]
                    await asyncio.sleep(0.15)
                replies = await asyncio.wait_for(asyncio.gather(*requests), 30)
                await asyncio.sleep(0.5)  # the last decisions are appended, the last pairs end
            finally:
                await service.stop()
                await asyncio.wait_for(task, 10)
            log = await read_bus_log(client)
        finally:
            for agent in agents:
                with contextlib.suppress(Exception):
                    await agent.stop()
    return log, replies, finished


@pytest.mark.parametrize(
    "policy",
    [POLICY, SHOAL_POLICY, GROWTH_POLICY, PREFILL_POLICY],
    ids=["paper-rules", "shoal", "shoal-growth", "shoal-prefill"],
)
async def test_live_recorded_log_through_the_simulators_policy_layer_gives_identical_decisions(
    nats_url: str, policy: PolicyConfig
) -> None:
    prefix = new_prefix()
    try:
        log, replies, finished = await _live_run(nats_url, prefix, policy)
    finally:
        await delete_streams(nats_url, prefix)
    assert sorted(finished) == sorted(f"q{k}" for k in range(NUM_REQUESTS))
    events, loads = _decoded(log)
    recorded_dispatches = [b for _, b in events if isinstance(b, Dispatched)]
    recorded_pairings = [b for _, b in events if isinstance(b, Paired | Unpaired)]
    # the log holds what the live scheduler answered, with the fold points it decided at
    assert {d.request_id: d.instance_id for d in recorded_dispatches} == {
        r.request_id: r.instance_id for r in replies
    }
    assert all(d.events_seq > 0 and d.loads_seq > 0 for d in recorded_dispatches)
    assert len({d.instance_id for d in recorded_dispatches}) > 1
    assert any(isinstance(b, Paired) for b in recorded_pairings)  # the burst formed at least one pair

    # shoal's pairs carry the destination's room (recomputed below with the rest of the decision)
    rooms = [b.destination_room_blocks for b in recorded_pairings if isinstance(b, Paired)]
    assert all(r >= 1 for r in rooms) if policy.pairing.room_check else all(r == -1 for r in rooms)
    assert {d.policy for d in recorded_dispatches} == {policy.dispatch_policy.value}
    # the agents learned an output length from finished requests and report the growth it implies
    assert any(report.expected_growth_blocks > 0 for _, report in loads)
    # reports made while a step prefills carry its prompts (what prefill_ahead ranks by)
    assert any(report.prefill_blocks > 0 for _, report in loads)
    replayed = replay_recorded_log(events, loads, policy)

    mismatches = [row for row in replayed if not row.matches]
    assert mismatches == []
    assert [row.recorded for row in replayed] == recorded_dispatches_and_pairings(events)
    dispatch_rows = [row for row in replayed if isinstance(row.recorded, Dispatched)]
    pairing_rows = [row for row in replayed if isinstance(row.recorded, Paired | Unpaired)]
    assert len(dispatch_rows) == len(recorded_dispatches) == NUM_REQUESTS
    assert len(pairing_rows) == len(recorded_pairings) > 0
    # same instance per request, same pairs and targets
    assert [(r.recomputed.request_id, r.recomputed.instance_id) for r in dispatch_rows] == [  # type: ignore[union-attr]
        (d.request_id, d.instance_id) for d in recorded_dispatches
    ]
    assert [_pair_of(r.recomputed) for r in pairing_rows] == [_pair_of(b) for b in recorded_pairings]
    # the scheduler's own replay agrees on the same log (two implementations, one answer)
    own = replay_log(log, ReplayOptions(policy=policy))
    assert own.mismatches == []
    # the comparison is real: a recorded dispatch moved to another instance is not reproduced
    index, moved = next((i, b) for i, (_, b) in enumerate(events) if isinstance(b, Dispatched))
    assert isinstance(moved, Dispatched)
    other = next(i for i in sorted({d.instance_id for d in recorded_dispatches}) if i != moved.instance_id)
    tampered = list(events)
    tampered[index] = (events[index][0], msgspec.structs.replace(moved, instance_id=other))
    assert [row.seq for row in replay_recorded_log(tampered, loads, policy) if not row.matches][:1] == [
        events[index][0]
    ]
    kinds = [type(row.recorded).__name__ for row in pairing_rows]
    print(f"same-code live: {len(dispatch_rows)} dispatches, {len(pairing_rows)} pairings match: {kinds}")


def recorded_dispatches_and_pairings(events: list[tuple[int, Body]]) -> list[Body]:
    return [b for _, b in events if isinstance(b, Dispatched | Paired | Unpaired)]


def _pair_of(body: Body | None) -> tuple[str, str, str, float | str]:
    assert isinstance(body, Paired | Unpaired)
    target = body.target_freeness if isinstance(body, Paired) else body.reason
    return (type(body).__name__, body.source_id, body.destination_id, target)

"""Helpers for the scheduler-service tests: a bus per test prefix and a tiny fake agent.

The fake agent appends ``InstanceJoined``, serves ``generate`` (each accepted
request holds its prompt's blocks for ``lifetime_reports`` reports, then
finishes) and appends a ``LoadReport`` every ``report_interval`` seconds.
Enough to drive the scheduler's dispatch, pairing and failure detection on a
real nats-server without an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from bus import BusConfig, BusError, JetStreamBus
from bus.protocol import StreamConfig
from scheduler.logfile import RecordedLog
from schemas import Codec, Subjects
from schemas.instance import InstanceJoined, KVLayout, ModelIdentity
from schemas.load import LoadReport, PriorityLoad, QueuedRequest
from schemas.rpc import DispatchReply, DispatchRequest, GenerateReply, GenerateRequest, Liveness

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")


def bus_config(url: str, prefix: str, loads_max_msgs_per_subject: int = 100_000) -> BusConfig:
    return BusConfig(
        url=url,
        subjects=Subjects(prefix),
        ack_timeout=0.5,
        append_timeout=5.0,
        heartbeat=0.5,
        streams=StreamConfig(duplicate_window=10.0, loads_max_msgs_per_subject=loads_max_msgs_per_subject),
    )


def live_agent_config(instance_id: str = "x", heartbeat_interval_s: float = 0.5) -> Any:
    """A real agent's config for the scheduler's live tests: quick reports, short migration timeouts."""
    from agents.agent import AgentConfig
    from agents.migration.fsm.config import MigrationConfig

    return AgentConfig(
        instance_id=instance_id,
        report_interval_s=0.05,
        heartbeat_interval_s=heartbeat_interval_s,
        tick_interval_s=0.02,
        migration=MigrationConfig(
            ack_timeout_s=0.5,
            copy_timeout_s=2.0,
            suspend_timeout_s=1.0,
            commit_timeout_s=0.5,
            claim_retry_s=0.3,
            destination_idle_timeout_s=3.0,
        ),
    )


def new_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@contextlib.asynccontextmanager
async def connected(url: str, prefix: str) -> AsyncIterator[JetStreamBus]:
    bus = JetStreamBus(bus_config(url, prefix))
    await bus.connect()
    try:
        yield bus
    finally:
        await bus.close()


async def delete_streams(url: str, prefix: str) -> None:
    async with connected(url, prefix) as bus:
        jsm = bus.client.jsm()
        subjects = Subjects(prefix)
        for stream in (
            subjects.events_stream, subjects.loads_stream, subjects.history_stream, subjects.kv_stream,
            f"KV_{subjects.kv_bucket}",
        ):
            with contextlib.suppress(Exception):
                await jsm.delete_stream(stream)


class FakeAgent:
    """Joins, accepts generate requests, reports load; no engine."""

    def __init__(
        self,
        bus: JetStreamBus,
        instance_id: str,
        *,
        num_blocks: int = 400,
        report_interval: float = 0.05,
        lifetime_reports: int = 6,
        hog_blocks: int = 0,
        growth_blocks: int = 0,
        prefill_blocks: int = 0,
        queued: QueuedRequest | None = None,
        answers_probes: bool = False,
    ) -> None:
        self.bus = bus
        #: Serve the ``liveness`` RPC the scheduler probes a silent instance with (a real agent does).
        self.answers_probes = answers_probes
        #: False: the report loop runs but its reports never reach the loads stream (a stream without
        #: a leader, as the scheduler sees it).
        self.reports_land = True
        self._attempt_at: float | None = None
        self.instance_id = instance_id
        self.num_blocks = num_blocks
        self.report_interval = report_interval
        self.lifetime_reports = lifetime_reports
        #: Blocks held by one long-running request (makes the instance a migration source).
        self.hog_blocks = hog_blocks
        #: ``LoadReport.expected_growth_blocks``: what its running requests are still expected to take.
        self.growth_blocks = growth_blocks
        #: ``LoadReport.prefill_blocks``: prompts admitted here whose prefill is still in flight.
        self.prefill_blocks = prefill_blocks
        #: One request queued here since the agent started (a stalled queue, reported as the head of
        #: line and the request it may give up); None: nothing queued.
        self.queued = queued
        self._started_at = time.monotonic()
        self.codec = Codec(producer=f"fake:{instance_id}")
        self.subjects: Subjects = bus.config.subjects
        self.running: dict[str, list[int]] = {}  # request -> [blocks, reports left]
        self.accepted: set[str] = set()
        self.seq = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._services: list[Any] = []

    async def start(self) -> None:
        joined = InstanceJoined(
            instance_id=self.instance_id,
            num_blocks=self.num_blocks,
            block_size=16,
            model=ModelIdentity(model_id="tiny"),
            kv_layout=LAYOUT,
            transport_address="inproc://x",
            engine="fake",
        )
        await self.bus.append(
            self.subjects.instance(self.instance_id), self.codec.encode(joined, time=time.time())
        )
        self._services.append(
            await self.bus.serve(self.subjects.rpc_agent(self.instance_id, "generate"), self._generate)
        )
        if self.answers_probes:
            self._services.append(
                await self.bus.serve(self.subjects.rpc_agent(self.instance_id, "liveness"), self._liveness)
            )
        self._tasks.append(asyncio.create_task(self._report_loop()))

    async def _liveness(self, data: bytes, headers: dict[str, str]) -> bytes:
        running = any(not task.done() for task in self._tasks)
        recent = self._attempt_at is not None and time.monotonic() - self._attempt_at < 2.5  # as an agent's
        answer = Liveness(instance_id=self.instance_id, reporting=running and recent)
        return self.codec.encode(answer, time=time.time())

    async def _generate(self, data: bytes, headers: dict[str, str]) -> bytes:
        envelope = self.codec.decode(data)
        request = envelope.body
        assert isinstance(request, GenerateRequest)
        if request.request_id not in self.accepted:
            self.accepted.add(request.request_id)
            self.running[request.request_id] = [-(-len(request.token_ids) // 16), self.lifetime_reports]
        reply = GenerateReply(
            request_id=request.request_id,
            instance_id=self.instance_id,
            accepted=True,
            num_accepted=len(self.accepted),
        )
        return self.codec.encode(reply, time=time.time())

    def report(self) -> LoadReport:
        self.seq += 1
        used = sum(blocks for blocks, _ in self.running.values()) + self.hog_blocks
        count = len(self.running) + (1 if self.hog_blocks else 0)
        freeness = (self.num_blocks - used) / max(count, 1)
        queued = self.queued
        demand = 0 if queued is None else -(-queued.num_prompt_tokens // 16)
        return LoadReport(
            instance_id=self.instance_id,
            seq=self.seq,
            num_total_blocks=self.num_blocks,
            num_free_blocks=self.num_blocks - used,
            num_reserved_blocks=0,
            running=(PriorityLoad(priority=0, num_running=count, num_blocks=used),) if count else (),
            head_of_line_demand=demand,
            num_waiting=0 if queued is None else 1,
            batch_size=count,
            freeness=freeness,
            virtual_usage=float(used),
            num_accepted=len(self.accepted),
            waiting_demand=demand,
            head_of_line_wait_s=0.0 if queued is None else time.monotonic() - self._started_at,
            requeue_candidate=queued,
            expected_growth_blocks=self.growth_blocks,
            prefill_blocks=self.prefill_blocks,
        )

    async def _report_loop(self) -> None:
        while self.bus.is_connected:
            report = self.report()
            self._attempt_at = time.monotonic()
            with contextlib.suppress(BusError):
                if not self.reports_land:
                    raise BusError("simulated: the loads stream has no leader")
                await self.bus.append(
                    self.subjects.load(self.instance_id),
                    self.codec.encode(report, time=time.time()),
                    timeout=1.0,
                )
            for request_id in list(self.running):
                entry = self.running[request_id]
                entry[1] -= 1
                if entry[1] <= 0:
                    del self.running[request_id]
            await asyncio.sleep(self.report_interval)

    async def pause_reports(self) -> None:
        """Stop the report loop but keep serving (an agent whose reporting died)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    def resume_reports(self) -> None:
        self._tasks.append(asyncio.create_task(self._report_loop()))

    async def stop(self) -> None:
        """Stop reporting and serving (looks like a crash to the scheduler)."""
        await self.pause_reports()
        for service in self._services:
            await service.stop()
        self._services.clear()


async def dispatch(
    bus: JetStreamBus, request_id: str, prompt: int = 64, *, timeout: float = 2.0
) -> DispatchReply:
    codec = Codec(producer="test-frontend")
    data = codec.encode(DispatchRequest(request_id=request_id, num_prompt_tokens=prompt), time=time.time())
    message = await bus.request(bus.config.subjects.rpc_dispatch, data, timeout=timeout)
    body = codec.decode(message.data).body
    assert isinstance(body, DispatchReply)
    return body


async def place(bus: JetStreamBus, request_id: str, prompt: int = 64) -> DispatchReply:
    """Dispatch, then send the request to the chosen agent (what a frontend does)."""
    reply = await dispatch(bus, request_id, prompt)
    if reply.instance_id is not None:
        codec = Codec(producer="test-frontend")
        generate = GenerateRequest(request_id=request_id, token_ids=tuple(range(prompt)), sampling=_SAMPLING)
        await bus.request(
            bus.config.subjects.rpc_agent(reply.instance_id, "generate"),
            codec.encode(generate, time=time.time()),
            timeout=2.0,
        )
    return reply


from schemas.rpc import SamplingParams  # noqa: E402

_SAMPLING = SamplingParams(max_tokens=4)


async def _settled(service: Any, agents: list[FakeAgent]) -> None:
    """Every request placed so far has finished on its fake agent, and the scheduler holds a report
    from each agent made after that: the next decision sees none of the last one's load (a fixed
    sleep did not, on a slow machine)."""
    async with asyncio.timeout(10):
        while any(agent.running for agent in agents):
            await asyncio.sleep(0.01)
        targets = {agent.instance_id: agent.seq + 1 for agent in agents}
        while any(
            (record := service.view().instances.get(instance_id)) is None or record.load.report_seq < seq
            for instance_id, seq in targets.items()
        ):
            await asyncio.sleep(0.01)


async def place_under_policy(
    nats_url: str, prefix: str, agents: Callable[[JetStreamBus], list[FakeAgent]], policy: Any, count: int = 4
) -> tuple[list[DispatchReply], RecordedLog]:
    """The fake agents ``agents`` builds report load; a scheduler under dispatch ``policy`` places
    ``count`` requests, each once the last has finished and been reported (:func:`_settled`).
    Returns the replies and the whole log."""
    from scheduler.config import PolicyConfig
    from scheduler.logfile import read_bus_log
    from scheduler.service import SchedulerConfig, SchedulerService

    async with connected(nats_url, prefix) as agent_bus, connected(nats_url, prefix) as sched_bus:
        started = agents(agent_bus)
        for agent in started:
            await agent.start()
        config = SchedulerConfig(
            policy=PolicyConfig(dispatch_policy=policy), lease_ttl_s=1.0, pairing_interval_s=0.1
        )
        service = SchedulerService(sched_bus, config)
        task = asyncio.create_task(service.run())
        try:
            await service.wait_active(10)
            await _settled(service, started)  # every instance reported
            replies = []
            for k in range(count):
                replies.append(await place(agent_bus, f"r{k}"))
                await _settled(service, started)
        finally:
            await service.stop()
            await asyncio.wait_for(task, 10)
        for agent in started:
            await agent.stop()
        return replies, await read_bus_log(agent_bus)


def assert_dispatches_replay_exactly(log: RecordedLog, policy: Any, count: int = 4) -> list[LoadReport]:
    """Every one of the ``count`` dispatches was made under ``policy`` and recomputes equal from the
    log; returns the log's load reports."""
    from scheduler.replay import replay_log
    from schemas.decisions import Dispatched

    codec = Codec()
    dispatched = [b for e in log.events if isinstance(b := codec.decode(e.data).body, Dispatched)]
    assert [d.policy for d in dispatched] == [policy.value] * count
    result = replay_log(log)
    assert result.mismatches == [] and result.num_unverifiable == 0
    recomputed = [row for row in result.decisions if isinstance(row.decision, Dispatched)]
    assert len(recomputed) == count and all(row.matches for row in recomputed)
    return [b for e in log.loads if isinstance(b := codec.decode(e.data).body, LoadReport)]


async def move_under_policy(
    nats_url: str, prefix: str, agents: Callable[[JetStreamBus], list[FakeAgent]], policy: Any
) -> tuple[list[Any], RecordedLog]:
    """The fake agents ``agents`` builds report load, one of them with a stalled queue; a scheduler
    under dispatch ``policy`` moves queued requests after 0.3 s. Runs until the first move and a few
    ticks more; returns the moves (``Dispatched`` with ``requeued_from``), after checking that each
    recomputes equal from the log, and the log."""
    from scheduler.config import PolicyConfig
    from scheduler.logfile import read_bus_log
    from scheduler.replay import replay_log
    from scheduler.service import SchedulerConfig, SchedulerService
    from schemas.decisions import Dispatched

    async with connected(nats_url, prefix) as agent_bus, connected(nats_url, prefix) as sched_bus:
        started = agents(agent_bus)
        for agent in started:
            await agent.start()
        config = SchedulerConfig(
            policy=PolicyConfig(dispatch_policy=policy), lease_ttl_s=1.0, pairing_interval_s=0.05,
            requeue_after_s=0.3,
        )
        service = SchedulerService(sched_bus, config)
        task = asyncio.create_task(service.run())
        try:
            await service.wait_active(10)
            async with asyncio.timeout(10):
                while service.stats.requeues == 0:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # more ticks: the request does not move twice
        finally:
            await service.stop()
            await asyncio.wait_for(task, 10)
        for agent in started:
            await agent.stop()
        log = await read_bus_log(agent_bus)
    codec = Codec()
    bodies = [codec.decode(e.data).body for e in log.events]
    moves = [b for b in bodies if isinstance(b, Dispatched) and b.requeued_from]
    result = replay_log(log)
    assert result.mismatches == [] and result.num_unverifiable == 0
    replayed = [row for row in result.decisions if row.kind == "requeue"]
    assert len(replayed) == len(moves) and all(row.matches for row in replayed)
    return moves, log

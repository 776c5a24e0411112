"""The agent's migration shell: routing handshake messages, faults, ticks and scheduler commands.

:class:`MigrationManager` belongs to one agent (a :class:`~agents.migration.host.MigrationHost`). It
subscribes to the agent's migration subject (``<prefix>.rpc.mig.<id>``) and
routes each handshake message to the machine of its migration (starting a
destination machine for a new one), sends messages to peers (with the trace
context in the headers, each also appended to the migration's log subject),
applies the :class:`~agents.config.FaultPlan` to messages going out and coming
in, feeds every machine a ``Tick`` periodically, follows the peers' lifecycle
events (a failed or departed peer becomes ``PeerFailed``), and carries out the
scheduler's ``MigrateOut`` command: it picks requests with the shared
selection rule and migrates them, at most ``max_concurrent_per_instance`` at a
time, until the freeness target is reached (with a room in the command, only
requests that fit in what is left of it, see :class:`~schemas.MigrateOut`); a destination that refuses for
want of room (:data:`DESTINATION_FULL`) ends the command until the next pairing.
Migration happens only between instances whose model identity and KV layout match.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import msgspec
from opentelemetry import trace
from opentelemetry.trace import Span

from agents.engines.protocol import EngineInfo
from agents.migration.destination import DestinationDriver
from agents.migration.directory import PeerDirectory
from agents.migration.fsm.actions import PeerFailed, RequestGone, Tick
from agents.migration.fsm.config import MigrationConfig, short_of_memory
from agents.migration.fsm.destination import start_destination
from agents.migration.fsm.record import DestinationStart
from agents.migration.host import MigrationHost
from agents.migration.log import MigrationLog
from agents.migration.pacing import StepClock
from agents.migration.source import MigrationOutcome, SourceDriver
from agents.reporting import running_requests
from agents.tracing import headers_for, tracer_from
from bus import BusError, Subscription
from scheduler.policy import select_requests_to_migrate
from schemas import (
    CommandRejectReason,
    CommandReply,
    MigrateOut,
    MigrationCause,
    MigrationStarted,
    MoveQueued,
)
from schemas.instance import InstanceJoined
from schemas.migration import Abort, Ack, CommitAck, HurryCopy, MigrationMessage, PreAllocate, StageWritten
from schemas.reasons import MigrationAbortReason

__all__ = ["DESTINATION_FULL", "MigrationManager", "MigrationOutcome", "incompatibility"]

log = logging.getLogger(__name__)

_FINISHED_KEPT = 1024

#: Abort reasons that mean the destination has no room now: the ``MigrateOut`` command stops
#: there and the source waits for the scheduler's next pairing instead of trying other requests.
DESTINATION_FULL = frozenset({
    MigrationAbortReason.OUT_OF_BLOCKS,
    MigrationAbortReason.TOO_MANY_INCOMING,
    MigrationAbortReason.DESTINATION_TERMINATING,
})


#: How a refused ``MoveQueued`` is answered, by the reason the migration was refused.
_REFUSALS = {
    MigrationAbortReason.NOT_RUNNING: CommandRejectReason.UNKNOWN_REQUEST,
    MigrationAbortReason.UNKNOWN_DESTINATION: CommandRejectReason.UNKNOWN_DESTINATION,
    MigrationAbortReason.INCOMPATIBLE: CommandRejectReason.INCOMPATIBLE,
}


def migration_blocker(engine: object, request_id: str) -> str | None:
    """Why the engine cannot move this request faithfully, or None.

    Engines that keep per-request state they cannot export (the vllm engine: seeded
    sampling, repetition penalty) implement ``migration_blocker(request_id)``; the
    others migrate everything.
    """
    check = getattr(engine, "migration_blocker", None)
    if check is None:
        return None
    try:
        reason: str | None = check(request_id)
    except KeyError:  # UnknownRequest: gone meanwhile
        return None
    return reason


def incompatibility(info: EngineInfo, peer: InstanceJoined) -> str:
    """What differs between this engine and a peer it cannot exchange KV with (model, dtype, layout)."""
    if info.model.dtype != peer.model.dtype or info.kv_layout.dtype != peer.kv_layout.dtype:
        return (f"dtype differs: {info.model.dtype} here, {peer.model.dtype} on {peer.instance_id!r} "
                "(agents exchange KV only in the same dtype)")
    if info.model != peer.model:
        return f"model differs: {info.model.model_id} here, {peer.model.model_id} on {peer.instance_id!r}"
    return f"KV layout differs: {info.kv_layout} here, {peer.kv_layout} on {peer.instance_id!r}"


class MigrationManager:
    """Every migration of one agent, both sides; see the module docstring."""

    def __init__(self, agent: MigrationHost, *, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.agent = agent
        self.config = agent.config.migration
        self.faults = agent.config.faults
        self.tracer = tracer_from(tracer_provider)
        self.log = MigrationLog(agent.bus, agent.codec)
        self.directory = PeerDirectory(self._peer_gone)
        self.sources: dict[str, SourceDriver] = {}
        self.sources_by_request: dict[str, SourceDriver] = {}
        self.destinations: dict[str, DestinationDriver] = {}
        self.finished_destinations: OrderedDict[str, DestinationDriver] = OrderedDict()
        self.outcomes: list[MigrationOutcome] = []
        #: Called with every source-side outcome, a refusal to start included (the agent's metrics).
        self.outcome_listeners: list[Callable[[MigrationOutcome], None]] = []
        self.faults_applied: Counter[tuple[str, str, str]] = Counter()
        self._subscription: Subscription | None = None
        self._command: MigrateOut | None = None
        self._command_failures: set[str] = set()
        self._command_sent = 0  # blocks (plus margins) sent under the command, against its room
        #: the engine's steps, which paced stage copies follow (agents.migration.pacing)
        self.step_clock = StepClock()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        agent = self.agent
        self._subscription = await agent.bus.subscribe(agent.subjects.rpc_mig(agent.instance_id))
        agent.spawn(self._receive_loop(self._subscription))
        agent.spawn(self._directory_loop())
        agent.spawn(self._tick_loop())

    async def close(self) -> None:
        """Clean stop: end every migration where it stands (peers time out) and unsubscribe."""
        self.abandon()
        if self._subscription is not None:
            with contextlib.suppress(BusError):
                await self._subscription.unsubscribe()
        await self.log.flush()

    def abandon(self) -> None:
        for driver in [*self.sources.values(), *self.destinations.values()]:
            driver.abandon()
        self.log.cancel()

    # -- counts -------------------------------------------------------------------------

    @property
    def num_outgoing(self) -> int:
        return len(self.sources)

    @property
    def num_incoming(self) -> int:
        return len(self.destinations)

    @property
    def is_idle(self) -> bool:
        return not self.sources and not self.destinations

    def is_migrating(self, request_id: str) -> bool:
        return request_id in self.sources_by_request

    # -- sending and receiving ----------------------------------------------------------

    def _fault(self, direction: str, message: MigrationMessage) -> int:
        """How many copies of ``message`` go through (0: dropped, 2: duplicated)."""
        faults = self.faults
        if faults.is_empty:
            return 1
        name = type(message).__name__
        drop = faults.drop_outgoing if direction == "out" else faults.drop_incoming
        dup = faults.duplicate_outgoing if direction == "out" else faults.duplicate_incoming
        for kind, names, copies in (("drop", drop, 0), ("duplicate", dup, 2)):
            if name in names:
                key = (direction, kind, name)
                if faults.max_faults is None or self.faults_applied[key] < faults.max_faults:
                    self.faults_applied[key] += 1
                    return copies
        return 1

    async def send(self, peer_id: str, message: MigrationMessage, span: Span | None) -> None:
        """Send a handshake message to ``peer_id`` and append it to the migration's log."""
        agent = self.agent
        headers = headers_for(span)
        data = agent.codec.encode(message, time=time.time(), trace=headers.get("traceparent"))
        logged = message
        if isinstance(message, Ack):
            logged = msgspec.structs.replace(message, transfer_token="")
        elif isinstance(message, PreAllocate) and message.block_hashes:
            logged = msgspec.structs.replace(message, block_hashes=())  # for the peer, not the log
        self.log.record(logged, trace=headers.get("traceparent"))
        for _ in range(self._fault("out", message)):
            try:
                await agent.bus.publish(agent.subjects.rpc_mig(peer_id), data, headers=headers)
            except BusError as exc:
                log.warning("agent %s: sending %s failed: %s", agent.instance_id, type(message).__name__, exc)

    async def _receive_loop(self, subscription: Subscription) -> None:
        async with subscription:
            async for received in subscription:
                envelope = self.agent.codec.decode_or_none(received.data)
                if envelope is None:
                    continue
                body = envelope.body
                if not hasattr(body, "migration_id") or not isinstance(body, MigrationMessage):
                    continue
                for _ in range(self._fault("in", body)):
                    self.route(body, received.headers)

    def route(self, message: MigrationMessage, headers: Mapping[str, str]) -> None:
        """Hand a received message to its machine (a new destination machine for a new migration)."""
        migration_id = message.migration_id
        source = self.sources.get(migration_id)
        if isinstance(message, StageWritten):  # a shell-level confirmation, not a machine input
            if source is not None:
                source.on_written(message.stage)
            return
        if isinstance(message, HurryCopy):  # pacing only, not a machine input
            hurried = self.destinations.get(migration_id) if source is None else source
            if hurried is not None:
                hurried.hurry(message.reason, tell=False)
            return
        if source is not None:
            if isinstance(message, CommitAck):
                source.on_commit_ack(message)
            if isinstance(message, Ack):
                source.on_ack(message)
            source.feed(message)
            return
        destination = self.destinations.get(migration_id) or self.finished_destinations.get(migration_id)
        if destination is not None:
            destination.feed(message)
            return
        if any(o.migration_id == migration_id for o in self.outcomes[-64:]):
            return  # a late message for a migration this agent sourced and finished
        start = DestinationStart(message, self.agent.instance_id, time.time())
        config = self.config
        if isinstance(message, PreAllocate) and message.copy_step_share is not None:
            config = replace(config, copy_step_share=message.copy_step_share)  # write as the source sends
        state, actions = start_destination(
            message,
            destination_id=start.destination_id,
            now=start.at,
            config=config,
        )
        driver = DestinationDriver(
            self, state, start, headers, on_finished=self.destination_finished, config=config
        )
        if driver.is_final:
            driver.record.started(state, actions)
            self.finished_destinations[migration_id] = driver
            driver.span.end()
            self.agent.spawn(driver.execute_all(actions))
            return
        self.destinations[migration_id] = driver
        driver.start(actions)

    # -- local events -------------------------------------------------------------------

    def request_gone(self, request_id: str, reason: MigrationAbortReason) -> None:
        """``request_id`` finished, was preempted or aborted here (a ``REQUEST_*`` reason)."""
        driver = self.sources_by_request.get(request_id)
        if driver is not None:
            driver.feed(RequestGone(reason=reason))

    def step_done(self, duration_s: float = 0.0) -> None:
        """An engine step completed (it took ``duration_s``)."""
        self.step_clock.step_done(duration_s)
        for driver in list(self.sources.values()):
            driver.on_step_done()

    def _peer_gone(self, instance_id: str) -> None:
        for source in list(self.sources.values()):
            if source.destination_id == instance_id:
                source.feed(PeerFailed())
        for destination in list(self.destinations.values()):
            if destination.state.source_id == instance_id:
                destination.feed(PeerFailed())
        if self._command is not None and self._command.destination_id == instance_id:
            self._command = None

    async def _directory_loop(self) -> None:
        agent = self.agent
        subjects = agent.subjects
        pattern = f"{subjects.prefix}.ev.instance.*"
        while True:
            try:
                async with agent.bus.tail(subjects.events_stream, from_seq=1, subjects=[pattern]) as feed:
                    async for stored in feed:
                        envelope = agent.codec.decode_or_none(stored.data)
                        if envelope is not None:
                            self.directory.apply(envelope.body)
            except BusError as exc:
                log.warning("agent %s: instance events feed failed: %s", agent.instance_id, exc)
                await asyncio.sleep(1.0)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.agent.config.tick_interval_s)
            for driver in [*self.sources.values(), *self.destinations.values()]:
                driver.feed(Tick())
            self._drive_command()

    def source_finished(self, driver: SourceDriver) -> None:
        self.sources.pop(driver.migration_id, None)
        if self.sources_by_request.get(driver.request_id) is driver:
            del self.sources_by_request[driver.request_id]
        self._record(driver.outcome)
        if not driver.outcome.migrated:
            self._command_failures.add(driver.request_id)
            if driver.outcome.reason in DESTINATION_FULL:
                self._command = None  # the destination is full: wait for the next pairing
        self.agent.wake()

    def _record(self, outcome: MigrationOutcome) -> None:
        self.outcomes.append(outcome)
        del self.outcomes[:-_FINISHED_KEPT]
        for listener in self.outcome_listeners:
            listener(outcome)

    def destination_finished(self, driver: DestinationDriver) -> None:
        self.destinations.pop(driver.migration_id, None)
        self.finished_destinations[driver.migration_id] = driver
        while len(self.finished_destinations) > _FINISHED_KEPT:
            self.finished_destinations.popitem(last=False)
        self.agent.wake()

    # -- starting migrations ------------------------------------------------------------

    async def migrate(
        self, request_id: str, destination_id: str, *, config: MigrationConfig | None = None
    ) -> MigrationOutcome:
        """Migrate ``request_id`` to ``destination_id`` and wait for the outcome.

        ``config`` overrides the agent's migration config for this one migration
        (``max_stages=1`` is a blocking copy: suspend, copy everything, resume there).
        """
        driver = await self.begin(request_id, destination_id, config=config)
        if isinstance(driver, MigrationOutcome):
            return driver
        return await driver.done

    async def begin(
        self,
        request_id: str,
        destination_id: str,
        *,
        config: MigrationConfig | None = None,
        cause: MigrationCause = MigrationCause.REQUESTED,
        command: MigrateOut | None = None,
        queued: bool = False,
        epoch: int | None = None,
    ) -> SourceDriver | MigrationOutcome:
        """Start a migration; a refusal comes back as a failed :class:`MigrationOutcome`.

        ``cause`` (and the ``command`` behind it) is logged as ``MigrationStarted`` first.
        ``queued``: move a request still queued here (no KV, see :meth:`move_queued`)."""
        migration_id = f"{self.agent.instance_id}-{uuid.uuid4().hex[:12]}"

        def refused(reason: MigrationAbortReason, detail: str = "") -> MigrationOutcome:
            outcome = MigrationOutcome(
                migration_id,
                request_id,
                destination_id,
                reason=reason,
                detail=detail,
                started_at=time.time(),
                finished_at=time.time(),
            )
            self._record(outcome)
            return outcome

        if destination_id == self.agent.instance_id:
            return refused(MigrationAbortReason.SAME_INSTANCE, "cannot migrate to itself")
        joined = await self.directory.wait_for(destination_id, self.agent.config.peer_lookup_timeout_s)
        if joined is None:
            return refused(MigrationAbortReason.UNKNOWN_DESTINATION, f"{destination_id!r} is not known")
        info = self.agent.engine.info
        if joined.model != info.model or joined.kv_layout != info.kv_layout:
            return refused(MigrationAbortReason.INCOMPATIBLE, incompatibility(info, joined))
        if len(self.sources) >= self.config.max_concurrent_per_instance:
            self.slot_wanted(incoming=False)
            return refused(MigrationAbortReason.TOO_MANY_OUTGOING)
        if request_id in self.sources_by_request:
            return refused(MigrationAbortReason.ALREADY_MIGRATING)
        stats = self.agent.engine.request_stats(request_id)
        if queued:
            if stats is None or self.agent.request_record(request_id) is None:
                return refused(MigrationAbortReason.NOT_RUNNING, "not here")
            if not getattr(self.agent.engine, "holds_queued_requests", False):
                return refused(MigrationAbortReason.NOT_MIGRATABLE, "the engine cannot hold a queued request")
            # one that started running meanwhile is found out when it is held (REQUEST_STARTED)
        elif stats is None or not stats.status.holds_blocks or self.agent.request_record(request_id) is None:
            return refused(MigrationAbortReason.NOT_RUNNING, "not running here")
        else:
            blocker = migration_blocker(self.agent.engine, request_id)
            if blocker is not None:
                return refused(MigrationAbortReason.NOT_MIGRATABLE, blocker)
        if config is None and self.config.copy_step_share > 0:  # paced unless short of memory here
            # (the destination writes at the pace PreAllocate carries)
            config = self.config.for_source(short_of_memory=self.short_of_memory())
        driver = SourceDriver(
            self,
            migration_id=migration_id,
            request_id=request_id,
            destination_id=destination_id,
            destination_address=joined.transport_address,
            on_finished=self.source_finished,
            config=config,
            queued=queued,
        )
        self.sources[migration_id] = driver
        self.sources_by_request[request_id] = driver
        self.log.record(
            MigrationStarted(
                migration_id=migration_id,
                request_id=request_id,
                source_id=self.agent.instance_id,
                destination_id=destination_id,
                cause=cause,
                epoch=(0 if command is None else command.epoch) if epoch is None else epoch,
                target_freeness=None if command is None else command.target_freeness,
                source_freeness=self.agent.load_report().freeness,
            )
        )
        driver.begin()
        return driver

    async def move_queued(self, command: MoveQueued) -> CommandReply:
        """The scheduler's ``MoveQueued``: move a request still queued here, without KV, through
        the migration protocol (a migration of zero blocks; the destination queues it). Accepted
        means started; the outcome is logged on the migration's subject."""
        outcome = await self.begin(
            command.request_id,
            command.destination_id,
            cause=MigrationCause.REQUEUE,
            queued=True,
            epoch=command.epoch,
        )
        if isinstance(outcome, MigrationOutcome):
            why = outcome.reason or MigrationAbortReason.CANCELLED
            # the scheduler logged the decision: log that the move did not start, and why
            agent_id = self.agent.instance_id
            self.log.record(MigrationStarted(
                migration_id=outcome.migration_id, request_id=command.request_id, source_id=agent_id,
                destination_id=command.destination_id, cause=MigrationCause.REQUEUE, epoch=command.epoch,
            ))
            self.log.record(Abort(
                migration_id=outcome.migration_id, reason=why, sender_id=agent_id, detail=outcome.detail
            ))
            reason = _REFUSALS.get(why, CommandRejectReason.MIGRATION_REFUSED)
            return CommandReply(accepted=False, reason=reason, detail=f"{why.value}: {outcome.detail}")
        return CommandReply(accepted=True, detail=f"moving as {outcome.migration_id}")

    async def command_migrate_out(self, command: MigrateOut) -> CommandReply:
        """Adopt the scheduler's command: migrate towards the destination until the target freeness."""
        joined = await self.directory.wait_for(
            command.destination_id, self.agent.config.peer_lookup_timeout_s
        )
        if joined is None:
            return CommandReply(
                accepted=False, reason=CommandRejectReason.UNKNOWN_DESTINATION,
                detail=f"unknown destination {command.destination_id!r}",
            )
        info = self.agent.engine.info
        if joined.model != info.model or joined.kv_layout != info.kv_layout:
            return CommandReply(
                accepted=False, reason=CommandRejectReason.INCOMPATIBLE, detail=incompatibility(info, joined)
            )
        self._command = command
        self._command_failures = set()
        self._command_sent = 0
        self._drive_command()
        return CommandReply(accepted=True, detail="migrating")

    def short_of_memory(self) -> bool:
        """:func:`agents.migration.fsm.config.short_of_memory` of this agent now."""
        report = self.agent.load_report()
        return short_of_memory(
            terminating=report.terminating, num_waiting=report.num_waiting,
            num_free_blocks=report.num_free_blocks, expected_growth_blocks=report.expected_growth_blocks,
        )

    def slot_wanted(self, *, incoming: bool) -> None:
        """Another migration waits for a slot into (``incoming``) or out of this agent: the paced
        migrations holding those slots copy the rest at full speed, and tell their peers."""
        drivers: Iterable[SourceDriver | DestinationDriver] = (
            self.destinations.values() if incoming else self.sources.values()
        )
        for driver in list(drivers):
            driver.hurry("slot_wanted")

    def command_stop(self, destination_id: str) -> bool:
        if self._command is not None and self._command.destination_id == destination_id:
            self._command = None
            return True
        return False

    @property
    def command(self) -> MigrateOut | None:
        return self._command

    def _drive_command(self) -> None:
        command = self._command
        if command is None:
            return
        free_slots = self.config.max_concurrent_per_instance - len(self.sources)
        if free_slots <= 0:
            self.slot_wanted(incoming=False)  # the command wants more moved: paced copies give way
            return
        stats = self.agent.engine.stats()
        exclude = set(self.sources_by_request) | self._command_failures
        engine = self.agent.engine
        exclude |= {r.request_id for r in stats.requests if migration_blocker(engine, r.request_id)}
        if command.max_moves_per_request > 0:
            exclude |= {
                r.request_id for r in stats.requests
                if (record := self.agent.request_record(r.request_id)) is not None
                and record.owner_epoch >= command.max_moves_per_request
            }
        margin = self.config.last_stage_max_blocks
        room = -1 if command.room_blocks < 0 else max(command.room_blocks - self._command_sent, 0)
        chosen = select_requests_to_migrate(
            running_requests(stats),
            num_total_blocks=stats.num_total_blocks,
            head_of_line_demand=stats.head_of_line_demand,
            target_freeness=command.target_freeness,
            config=self.agent.config.policy,
            terminating=self.agent.terminating,
            num_reserved_blocks=stats.num_reserved_blocks,
            exclude=exclude,
            max_requests=free_slots,
            room_blocks=room,
            margin_blocks=margin,
        )
        if room >= 0:
            self._command_sent += sum(request.num_blocks + margin for request in chosen)
        if not chosen:
            if not self.sources:
                self._command = None  # target reached (or nothing left to move)
            return
        cause = MigrationCause.DRAIN if self.agent.terminating else MigrationCause.PAIRING
        for request in chosen:
            self.agent.spawn(
                self.begin(request.request_id, command.destination_id, cause=cause, command=command)
            )

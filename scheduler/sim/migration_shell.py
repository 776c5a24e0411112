"""One migration in the simulator: the agents' two state machines, run on the virtual clock.

:class:`SimMigration` drives the source and destination machines of
:mod:`agents.migration.fsm` (``start_source``, ``start_destination``,
``step``) the way the agents' shells do (:mod:`agents.migration.source`,
:mod:`agents.migration.destination`), with the sim engines in place of real
ones and modelled time in place of the network:

* a handshake message takes ``MigrationModel.message_s`` (half the handshake
  round trip) to reach the peer; messages between two sides stay in order;
* ``CopyBlocks`` exports the blocks at once and the data lands at the
  destination ``bytes / bandwidth`` later (``BlocksReceived``; divided by
  ``MigrationConfig.copy_step_share`` for a stage the agents pace:
  :meth:`MigrationConfig.paces`, not the last, and not from a source short of
  memory; a paced copy hurries, the rest of it at full speed, when its source
  turns short of memory or another migration wants its slot: :meth:`SimMigration.hurry`); the
  destination writes it on ``WriteBlocks`` and confirms with ``StageWritten``,
  and only that confirmation becomes the source's ``CopyDone`` (``RejectBlocks``
  becomes its ``CopyFailed``); a cancelled copy never lands;
* ``Suspend`` suspends the request in the engine at once and reports
  ``Suspended`` when the step in flight ends (at once if none is), as
  ``SourceDriver._suspend`` / ``on_step_done`` do;
* ``ClaimOutcome`` appends to the owner's in-memory log, where the first claim
  wins, and the answer comes back ``MigrationModel.commit_latency_s`` later;
* a ``Tick`` is scheduled at every deadline a machine sets, so timeouts fire;
* ``Reserve`` is answered before anything else reaches the machine, with the
  agents' refusals (too many incoming migrations, a terminating instance, no
  free blocks).

Both machines' transitions go into :class:`~agents.migration.fsm.record.MachineRecord` s.
Each input reaches a machine as a heap event (:class:`Delivery`), so an input
fed while actions execute waits its turn, as on the agents' queues. The
counting (started, committed, aborted, downtime, bytes) and the slots belong
to the :class:`MigrationOwner` (:mod:`scheduler.sim.migration`).
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple, Protocol

from agents.engines.block_manager import OutOfBlocks, Reservation
from agents.engines.protocol import InvalidRequestState, KVBuffer, MigrationError, UnknownRequest
from agents.migration.fsm import Input, is_final, step
from agents.migration.fsm.actions import (
    Action,
    AdmitRequest,
    BlocksReceived,
    CancelCopy,
    ClaimOutcome,
    CopyBlocks,
    CopyDone,
    CopyFailed,
    FreeSourceBlocks,
    OutcomeClaimed,
    PeerFailed,
    RejectBlocks,
    ReleaseReservation,
    ReportFailed,
    ReportMigrated,
    RequestGone,
    Reserve,
    Reserved,
    ReserveFailed,
    ResumeOnSource,
    SendCommit,
    SendToPeer,
    Suspend,
    Suspended,
    Tick,
    WriteBlocks,
)
from agents.migration.fsm.config import MigrationConfig
from agents.migration.fsm.destination import DestinationState, start_destination
from agents.migration.fsm.record import DestinationStart, MachineRecord, SourceStart
from agents.migration.fsm.source import SourceState, start_source
from scheduler.sim.config import MigrationModel
from scheduler.sim.event_kinds import EventKind
from scheduler.sim.migration_ports import MigrationHost, MigrationInstance
from schemas.migration import Abort, Commit, CommitAck, MigrationMessage, StageWritten
from schemas.reasons import MigrationAbortReason

__all__ = ["Delivery", "Landed", "MigrationOwner", "Side", "SimMigration"]


class Side(enum.Enum):
    SOURCE = "source"
    DESTINATION = "destination"


class Landed(NamedTuple):
    """A stage's data reached the destination's transport (``generation``: which schedule of
    its landing this is; a paced copy that hurries lands again sooner, and the first is dropped)."""

    stage: int
    buffer: KVBuffer
    generation: int = 0


class Delivery(NamedTuple):
    """The payload of a ``MIGRATION`` heap event: something reaches one side of a migration."""

    migration: SimMigration
    side: Side
    item: Input | Landed


class MigrationOwner(Protocol):
    """What one migration uses of the code that started it."""

    @property
    def host(self) -> MigrationHost: ...

    @property
    def model(self) -> MigrationModel: ...

    def claim(self, outcome: CommitAck | Abort) -> bool:
        """Append ``outcome`` unless the migration has one; whether the logged one is a commit."""
        ...

    def owner_epoch(self, request_id: str) -> int: ...

    def admitted(self, migration: SimMigration, commit: Commit) -> None:
        """The destination took the request into its batch."""
        ...

    def await_step_end(self, migration: SimMigration) -> None:
        """Call :meth:`SimMigration.step_done` when the source's step in flight ends."""
        ...

    def pacing(self, migration: SimMigration) -> None:
        """Call :meth:`SimMigration.recheck_pacing` at each of the source's step ends while it says so."""
        ...

    def source_finished(self, migration: SimMigration) -> None: ...

    def destination_finished(self, migration: SimMigration) -> None: ...


class SimMigration:
    """Both sides of one migration: their machines, what each holds, and the timing."""

    def __init__(
        self,
        owner: MigrationOwner,
        migration_id: str,
        request_id: str,
        source: MigrationInstance,
        destination: MigrationInstance,
        config: MigrationConfig,
    ) -> None:
        self.owner = owner
        self.host = owner.host
        self.model = owner.model
        self.config = config
        self.migration_id = migration_id
        self.request_id = request_id
        self.source = source
        self.destination = destination
        self.source_state: SourceState | None = None
        self.destination_state: DestinationState | None = None
        self.source_record: MachineRecord | None = None
        self.destination_record: MachineRecord | None = None
        self.alive = {Side.SOURCE: True, Side.DESTINATION: True}
        self.ticks = {Side.SOURCE: math.inf, Side.DESTINATION: math.inf}
        self.num_to_destination = 0  # deliveries on their way to the destination side
        self.copies: dict[int, tuple[float, KVBuffer]] = {}  # stage -> (started, data) of live copies
        #: the paced copy in flight: (stage, started, paced seconds, full-speed seconds, generation)
        self.paced: tuple[int, float, float, float, int] | None = None
        self.landing: dict[int, int] = {}  # stage -> the generation of its landing that counts
        self.hurried = False  # a paced copy of it went on at full speed
        self.full_speed = False  # the rest of it copies unpaced (hurried, or its source ran short)
        self._generation = 0
        self.received: dict[int, KVBuffer] = {}  # landed, not yet written
        self.reservations: dict[int, Reservation] = {}
        #: the destination's cached blocks of the request's chain, held for it (not copied)
        self.held: tuple[int, ...] = ()
        self.num_cached_blocks = 0  # how many the destination held (for the bytes saved)
        self.awaiting_suspend = False
        self.num_stages = 0
        self.num_bytes = 0
        self.started_at = self.host.now
        self.suspended_at: float | None = None
        self.admitted_at: float | None = None
        self.migrated = False
        #: Why the source gave up (``None`` while running, and after a commit).
        self.reason: MigrationAbortReason | None = None
        self.source_done = False  # counted and its slot freed (by the owner)
        self.destination_done = False  # its slot at the destination freed (by the owner)

    # -- state ---------------------------------------------------------------------------

    @property
    def source_final(self) -> bool:
        return self.source_state is None or is_final(self.source_state) or not self.alive[Side.SOURCE]

    @property
    def destination_settled(self) -> bool:
        """Nothing is or will be held for this migration at the destination."""
        if self.destination_state is None:
            return self.source_final and self.num_to_destination == 0
        return is_final(self.destination_state) or not self.alive[Side.DESTINATION]

    @property
    def downtime_s(self) -> float | None:
        if self.suspended_at is None or self.admitted_at is None:
            return None
        return self.admitted_at - self.suspended_at

    # -- driving -------------------------------------------------------------------------

    def begin(self) -> None:
        """Start the source machine on the request's full blocks now."""
        stats = self.source.engine.request_stats(self.request_id)
        num_full = 0 if stats is None else stats.num_computed_tokens // self.source.block_size
        start = SourceStart(
            migration_id=self.migration_id, request_id=self.request_id,
            source_id=self.source.instance_id, destination_id=self.destination.instance_id,
            num_full_blocks=num_full, at=self.host.now,
            block_hashes=self.source.chain(self.request_id, num_full),
        )
        state, actions = start_source(
            migration_id=start.migration_id, request_id=start.request_id, source_id=start.source_id,
            destination_id=start.destination_id, num_full_blocks=num_full, now=start.at, config=self.config,
            block_hashes=start.block_hashes,
        )
        self.source_state = state
        self.source_record = MachineRecord(start, self.config)
        self.source_record.started(state, actions)
        self._after_step(Side.SOURCE, actions)

    def deliver(self, side: Side, item: Input | Landed) -> None:
        """Something reaches ``side`` now (a heap event)."""
        if side is Side.DESTINATION:
            self.num_to_destination -= 1
        if not self.alive[side]:
            return
        if side is Side.SOURCE:
            self._at_source(item)
        else:
            self._at_destination(item)

    def feed(self, side: Side, item: Input | Landed, *, after: float = 0.0) -> None:
        """Let ``item`` reach ``side`` ``after`` seconds from now."""
        if side is Side.DESTINATION:
            self.num_to_destination += 1
        self.host.push(self.host.now + after, EventKind.MIGRATION, Delivery(self, side, item))

    def step_done(self) -> None:
        """The source's step in flight ended: a pending suspend reports now."""
        if self.awaiting_suspend:
            self.awaiting_suspend = False
            self._report_suspended()

    def peer_left(self, side: Side) -> None:
        """The instance of ``side`` left the cluster: the other side's failure detection fires."""
        if not self.alive[side]:
            return
        was_final = self.source_final if side is Side.SOURCE else self.destination_settled
        self.alive[side] = False
        if side is Side.SOURCE and not was_final:
            self.reason = MigrationAbortReason.CANCELLED  # the source instance left
            self.owner.source_finished(self)
        elif side is Side.DESTINATION and not was_final:
            self.owner.destination_finished(self)
        other = Side.DESTINATION if side is Side.SOURCE else Side.SOURCE
        self.feed(other, PeerFailed())

    def _at_source(self, item: Input | Landed) -> None:
        if self.source_final or isinstance(item, Landed):
            return  # a finished source drops late messages, as the agents' manager does
        if isinstance(item, StageWritten):
            done = self._copy_done(item.stage)
            if done is not None:
                self._step(Side.SOURCE, done)
            return
        if isinstance(item, CopyFailed):
            self.copies.pop(item.stage, None)
        self._step(Side.SOURCE, item)

    def _at_destination(self, item: Input | Landed) -> None:
        if isinstance(item, Landed):
            if item.stage not in self.copies or self.destination_state is None:
                return  # the copy was cancelled on its way
            if item.generation != self.landing.get(item.stage, item.generation):
                return  # a paced copy that hurried: it landed sooner, at its second schedule
            self.received[item.stage] = item.buffer
            item = BlocksReceived(stage=item.stage)
        if self.destination_state is None:
            if isinstance(item, MigrationMessage):
                self._start_destination(item)
            return
        if isinstance(item, Tick) and is_final(self.destination_state):
            return
        self._step(Side.DESTINATION, item)

    def _start_destination(self, message: MigrationMessage) -> None:
        start = DestinationStart(message, self.destination.instance_id, self.host.now)
        state, actions = start_destination(
            message, destination_id=start.destination_id, now=start.at, config=self.config
        )
        self.destination_state = state
        self.destination_record = MachineRecord(start, self.config)
        self.destination_record.started(state, actions)
        self._after_step(Side.DESTINATION, actions)

    def _step(self, side: Side, event: Input) -> None:
        now = self.host.now
        if side is Side.SOURCE:
            assert self.source_state is not None and self.source_record is not None
            before_s = self.source_state
            self.source_state, actions = step(before_s, event, now=now, config=self.config)
            self.source_record.stepped(now, event, before_s, self.source_state, actions)
        else:
            assert self.destination_state is not None and self.destination_record is not None
            before_d = self.destination_state
            self.destination_state, actions = step(before_d, event, now=now, config=self.config)
            self.destination_record.stepped(now, event, before_d, self.destination_state, actions)
        self._after_step(side, actions)

    def _after_step(self, side: Side, actions: tuple[Action, ...]) -> None:
        """Schedule the machine's next deadline, execute its actions, then apply their answers."""
        state = self.source_state if side is Side.SOURCE else self.destination_state
        assert state is not None
        if not is_final(state) and state.deadline != self.ticks[side] and math.isfinite(state.deadline):
            self.ticks[side] = state.deadline
            self.feed(side, Tick(), after=state.deadline - self.host.now)
        if actions:
            self.source.dirty = self.destination.dirty = True
        answers = [self._execute(side, action) for action in actions]
        for answer in answers:
            if answer is not None:
                self._step(side, answer)

    def _execute(self, side: Side, action: Action) -> Input | None:
        if side is Side.SOURCE:
            self._execute_at_source(action)
            return None
        return self._execute_at_destination(action)

    # -- the source's actions ------------------------------------------------------------

    def _execute_at_source(self, action: Action) -> None:
        source, engine, message_s = self.source, self.source.engine, self.model.message_s
        if isinstance(action, SendToPeer):
            self.feed(Side.DESTINATION, action.message, after=message_s)
        elif isinstance(action, SendCommit):
            self.feed(Side.DESTINATION, self._commit(), after=message_s)
        elif isinstance(action, CopyBlocks):
            self._copy(action)
        elif isinstance(action, CancelCopy):
            self.copies.pop(action.stage, None)
        elif isinstance(action, Suspend):
            self._suspend()
        elif isinstance(action, ResumeOnSource):
            try:
                engine.resume(self.request_id)
            except (UnknownRequest, InvalidRequestState):
                pass
            self.awaiting_suspend = False
            self.host.wake(source.instance_id)
        elif isinstance(action, FreeSourceBlocks):
            try:
                engine.release_request(self.request_id)
            except UnknownRequest:
                pass
            source.forget(self.request_id)
            self.host.wake(source.instance_id)
        elif isinstance(action, ClaimOutcome):
            self._claim(Side.SOURCE, action)
        elif isinstance(action, ReportMigrated | ReportFailed):
            self.migrated = isinstance(action, ReportMigrated)
            self.reason = action.reason if isinstance(action, ReportFailed) else None
            self.owner.source_finished(self)

    def _claim(self, side: Side, action: ClaimOutcome) -> None:
        """Append the outcome to the log (the first claim wins); the answer comes back later."""
        committed = self.owner.claim(action.outcome)
        self.feed(side, OutcomeClaimed(committed=committed), after=self.model.commit_latency_s)

    def _commit(self) -> Commit:
        continuation = self.source.continuation(self.request_id)
        if continuation is None:
            raise RuntimeError(f"request {self.request_id!r} vanished while suspended for its commit")
        prompt = continuation.prompt_token_ids
        return Commit(
            migration_id=self.migration_id,
            request_id=self.request_id,
            source_id=self.source.instance_id,
            destination_id=self.destination.instance_id,
            token_ids=(*prompt, *continuation.output_token_ids),
            num_prompt_tokens=len(prompt),
            owner_epoch=self.owner.owner_epoch(self.request_id),
            suspended_at=self.host.now if self.suspended_at is None else self.suspended_at,
            sampling=continuation.sampling,
            priority=continuation.priority,
        )

    def _copy(self, action: CopyBlocks) -> None:
        """Export the stage's blocks now; the data lands ``bytes / bandwidth`` later."""
        engine = self.source.engine
        try:
            buffer = engine.export_blocks(self.request_id, range(action.first_block, action.end_block))
        except (UnknownRequest, MigrationError) as exc:
            stats = engine.request_stats(self.request_id)
            if isinstance(exc, UnknownRequest) or stats is None:
                reason = MigrationAbortReason.REQUEST_FINISHED
            elif not stats.status.holds_blocks:
                reason = MigrationAbortReason.REQUEST_PREEMPTED
            else:
                reason = MigrationAbortReason.COPY_FAILED
            detail = f"{type(exc).__name__}: {exc}"
            self.feed(Side.SOURCE, CopyFailed(stage=action.stage, reason=reason, detail=detail))
            return
        self.num_stages += 1
        self.copies[action.stage] = (self.host.now, buffer)
        copy_s = self.model.copy_s(buffer.num_blocks, self.source.bytes_per_block)
        last = self.source_state is not None and self.source_state.last_stage
        if self.config.paces(buffer.num_blocks) and not last and not self._hurried():
            # paced as the agents pace it, who go at full speed rather than past half the copy timeout
            paced_s = min(copy_s / self.config.copy_step_share, max(copy_s, self.config.copy_timeout_s / 2))
            self._generation += 1
            self.paced = (action.stage, self.host.now, paced_s, copy_s, self._generation)
            self.owner.pacing(self)
            copy_s = paced_s
        self.landing[action.stage] = self._generation
        self.feed(Side.DESTINATION, Landed(action.stage, buffer, self._generation), after=copy_s)

    def _hurried(self) -> bool:
        """Whether the rest of the migration copies at full speed: it was hurried, or its source is
        short of memory now (as the agents' pacers ask before every chunk). The machines' config
        stays as it started (their records replay with it); only the shell's pacing changes."""
        if not self.full_speed and self.source.short_of_memory():
            self.full_speed = True
        return self.full_speed

    def recheck_pacing(self) -> bool:
        """A step of the source ended while a stage copies paced: if the source is now short of
        memory, the rest of the stage goes at full speed (it lands sooner). Whether the copy is
        still paced."""
        if self.paced is None:
            return False
        stage, _, _, _, generation = self.paced
        if stage not in self.copies or generation != self._generation:
            self.paced = None
            return False
        if not self._hurried():
            return True
        self.hurry()
        return False

    def hurry(self) -> None:
        """Copy the rest of this migration at full speed: the stage in flight lands sooner."""
        self.full_speed = True
        if self.paced is None:
            return
        stage, started, paced_s, copy_s, generation = self.paced
        self.paced = None
        if stage not in self.copies or generation != self._generation:
            return
        done = min(1.0, (self.host.now - started) / paced_s) if paced_s > 0 else 1.0
        self._generation += 1
        self.landing[stage] = self._generation
        self.hurried = True
        buffer = self.copies[stage][1]
        self.feed(Side.DESTINATION, Landed(stage, buffer, self._generation), after=(1 - done) * copy_s)

    def _copy_done(self, stage: int) -> CopyDone | None:
        """The destination wrote ``stage``: the copy is done (None if it was cancelled meanwhile)."""
        copy = self.copies.pop(stage, None)
        if copy is None:
            return None
        started, buffer = copy
        self.num_bytes += buffer.nbytes
        stats = self.source.engine.request_stats(self.request_id)
        full = 0 if stats is None else stats.num_computed_tokens // self.source.block_size
        return CopyDone(stage=stage, num_full_blocks=full, num_bytes=buffer.nbytes,
                        duration_s=self.host.now - started)

    def _suspend(self) -> None:
        try:
            self.source.engine.suspend(self.request_id)
        except UnknownRequest:
            self.feed(Side.SOURCE, RequestGone(reason=MigrationAbortReason.REQUEST_FINISHED))
            return
        except InvalidRequestState:
            self.feed(Side.SOURCE, RequestGone(reason=MigrationAbortReason.REQUEST_PREEMPTED))
            return
        if self.source.busy:
            self.awaiting_suspend = True  # applies once the step in flight completes
            self.owner.await_step_end(self)
        else:
            self._report_suspended()

    def _report_suspended(self) -> None:
        stats = self.source.engine.request_stats(self.request_id)
        if stats is None or not stats.status.holds_blocks:
            self.feed(Side.SOURCE, RequestGone(
                    reason=MigrationAbortReason.REQUEST_FINISHED
                    if stats is None
                    else MigrationAbortReason.REQUEST_PREEMPTED
                ),
            )
            return
        self.suspended_at = self.host.now
        self.feed(Side.SOURCE, Suspended(num_blocks=stats.num_blocks))

    # -- the destination's actions -------------------------------------------------------

    def _execute_at_destination(self, action: Action) -> Input | None:
        engine, message_s = self.destination.engine, self.model.message_s
        if isinstance(action, Reserve):
            return self._reserve(action)
        if isinstance(action, SendToPeer):
            self.feed(Side.SOURCE, action.message, after=message_s)
        elif isinstance(action, WriteBlocks):
            engine.import_blocks(action.block_ids, self.received.pop(action.stage))
            written = StageWritten(migration_id=self.migration_id, stage=action.stage)
            self.feed(Side.SOURCE, written, after=message_s)
        elif isinstance(action, RejectBlocks):
            self.received.pop(action.stage, None)
            self.feed(Side.SOURCE, CopyFailed(stage=action.stage, reason=action.reason), after=message_s)
        elif isinstance(action, ReleaseReservation):
            for reservation in self.reservations.values():
                engine.release_reservation(reservation)
            self.reservations.clear()
            self._drop_held()
            self.received.clear()
        elif isinstance(action, AdmitRequest):
            self._admit(action.commit)
        elif isinstance(action, ClaimOutcome):
            self._claim(Side.DESTINATION, action)
        elif isinstance(action, ReportMigrated | ReportFailed):
            self.owner.destination_finished(self)
        return None

    def _reserve(self, action: Reserve) -> Reserved | ReserveFailed:
        destination = self.destination
        if action.stage == 0 and destination.num_migrating_in > self.config.max_concurrent_per_instance:
            return ReserveFailed(stage=action.stage, reason=MigrationAbortReason.TOO_MANY_INCOMING)
        if action.stage == 0 and destination.terminating:
            return ReserveFailed(stage=action.stage, reason=MigrationAbortReason.DESTINATION_TERMINATING)
        # the cached leading run is held before reserving, so the reservation cannot evict it
        held = self._hold(action.block_hashes)
        try:
            reservation = destination.engine.reserve(action.num_blocks - len(held))
        except OutOfBlocks:
            self._drop_held()
            return ReserveFailed(stage=action.stage, reason=MigrationAbortReason.OUT_OF_BLOCKS)
        self.reservations[action.stage] = reservation
        return Reserved(stage=action.stage, block_ids=reservation.block_ids, cached_block_ids=held)

    def _hold(self, block_hashes: tuple[int, ...]) -> tuple[int, ...]:
        """Reference the leading blocks of the offered chain the destination caches (stage 0 only)."""
        if not block_hashes or self.held:
            return ()
        self.held = self.destination.engine.hold_cached_blocks(block_hashes)
        self.num_cached_blocks = len(self.held)
        return self.held

    def _drop_held(self) -> None:
        held, self.held = self.held, ()
        if held:
            self.destination.engine.drop_held_blocks(held)

    def _admit(self, commit: Commit) -> None:
        """Take the request into the destination's batch; a block that did not arrive fails loudly."""
        reservations = [self.reservations[s] for s in sorted(self.reservations)]
        prompt = commit.token_ids[: commit.num_prompt_tokens]
        outputs = commit.token_ids[commit.num_prompt_tokens :]
        self.destination.engine.admit_migrated(
            commit.request_id, prompt, outputs, commit.sampling, commit.priority, reservations,
            cached_block_ids=self.held,
        )
        self.held = ()  # their references are the request's now
        self.reservations.clear()
        self.destination.adopt(commit.request_id)
        self.admitted_at = self.host.now
        self.owner.admitted(self, commit)
        self.host.wake(self.destination.instance_id)

"""A toy world for the migration state machines: two agent shells, a faulty channel, a log.

The shells execute actions the way the real agents will (a block pool on the
destination, an engine that grows and finishes the request on the source), the
channel between them can lose, duplicate, delay and reorder messages, and the
log keeps the first outcome claimed for the migration. Safety invariants are
checked as actions execute; :meth:`World.settle` lets time run until both
machines have finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agents.migration.fsm import is_final
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
    LocalEvent,
    OutcomeClaimed,
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
from agents.migration.fsm.destination import DestinationState, destination_step, start_destination
from agents.migration.fsm.source import SourceState, source_step, start_source
from schemas.migration import Commit, CommitAck, MigrationMessage
from schemas.reasons import MigrationAbortReason

CONFIG = MigrationConfig(last_stage_max_blocks=2, max_stages=5, ack_timeout_s=2.0, copy_timeout_s=5.0,
                         suspend_timeout_s=2.0, commit_timeout_s=2.0, claim_retry_s=1.0,
                         destination_idle_timeout_s=20.0)


class InvariantBroken(AssertionError):
    pass


@dataclass
class World:
    """Source agent ``a`` migrating request ``r`` to destination agent ``b``."""

    full_blocks: int = 20
    free_blocks: int = 1000
    now: float = 0.0
    src: SourceState | None = None
    dst: DestinationState | None = None
    to_dst: list[MigrationMessage] = field(default_factory=list)
    to_src: list[MigrationMessage] = field(default_factory=list)
    src_pending: list[LocalEvent | str] = field(default_factory=list)  # "copy:<stage>", "suspend"
    dst_pending: list[LocalEvent] = field(default_factory=list)
    log_outcome: bool | None = None
    src_owns: bool = True  # the source holds the request (running or suspended)
    src_running: bool = True
    suspended: bool = False
    gone: bool = False
    dst_admitted: bool = False
    reserved: set[int] = field(default_factory=set)
    next_block: int = 0
    reports: list[str] = field(default_factory=list)
    reserve_fails: bool = False
    written: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)
    #: the request is still queued on the source (never ran, no blocks): a move without KV
    queued: bool = False

    def start(self) -> None:
        self.src, actions = start_source(
            migration_id="m", request_id="r", source_id="a", destination_id="b",
            num_full_blocks=self.full_blocks, now=self.now, config=CONFIG,
        )
        self.run_src_actions(actions)

    # -- feeding the machines -------------------------------------------------

    def to_source(self, event: MigrationMessage | LocalEvent) -> None:
        assert self.src is not None
        self.src, actions = source_step(self.src, event, now=self.now, config=CONFIG)
        self.run_src_actions(actions)

    def to_destination(self, event: MigrationMessage | LocalEvent) -> None:
        if self.dst is None:
            if not isinstance(event, MigrationMessage):
                return
            self.dst, actions = start_destination(event, destination_id="b", now=self.now, config=CONFIG)
        else:
            self.dst, actions = destination_step(self.dst, event, now=self.now, config=CONFIG)
        self.run_dst_actions(actions)

    # -- the shells -------------------------------------------------------------

    def run_src_actions(self, actions: tuple[Action, ...]) -> None:
        for action in actions:
            if isinstance(action, SendToPeer):
                self.to_dst.append(action.message)
            elif isinstance(action, SendCommit):
                self.check(self.suspended and not self.gone, "commit sent for a request not suspended")
                self.to_dst.append(Commit(migration_id="m", request_id="r", source_id="a", destination_id="b",
                                          token_ids=(1, 2, 3), num_prompt_tokens=2, owner_epoch=0,
                                          suspended_at=self.now))
            elif isinstance(action, CopyBlocks):
                self.check(action.end_block - action.first_block == len(action.destination_block_ids),
                           "copy range does not match the reservation")
                self.src_pending.append(f"copy:{action.stage}")
            elif isinstance(action, CancelCopy):
                self.src_pending = [e for e in self.src_pending if e != f"copy:{action.stage}"]
            elif isinstance(action, Suspend):
                self.src_pending.append("suspend")
            elif isinstance(action, ResumeOnSource):
                self.check(self.log_outcome is not True, "resumed a request the log gave to the destination")
                self.src_pending = [e for e in self.src_pending if e != "suspend"]
                if self.src_owns:
                    self.suspended, self.src_running = False, True
            elif isinstance(action, FreeSourceBlocks):
                self.check(self.log_outcome is True, "source freed blocks without a committed outcome")
                self.src_owns = self.src_running = self.suspended = False
            elif isinstance(action, ClaimOutcome):
                self.claim(action, self.src_pending)
            elif isinstance(action, ReportMigrated | ReportFailed):
                self.reports.append(f"src:{type(action).__name__}")
            else:
                raise InvariantBroken(f"source cannot execute {action!r}")

    def run_dst_actions(self, actions: tuple[Action, ...]) -> None:
        for action in actions:
            if isinstance(action, SendToPeer):
                self.to_src.append(action.message)
            elif isinstance(action, Reserve):
                # the block manager answers at once, before anything else reaches the machine
                if self.reserve_fails or action.num_blocks > self.free_blocks:
                    full = MigrationAbortReason.OUT_OF_BLOCKS
                    self.to_destination(ReserveFailed(stage=action.stage, reason=full))
                else:
                    ids = tuple(range(self.next_block, self.next_block + action.num_blocks))
                    self.next_block += action.num_blocks
                    self.free_blocks -= action.num_blocks
                    self.reserved |= set(ids)
                    self.to_destination(Reserved(stage=action.stage, block_ids=ids))
            elif isinstance(action, ReleaseReservation):
                self.check(set(action.block_ids) <= self.reserved, "released blocks it did not hold")
                self.reserved -= set(action.block_ids)
                self.free_blocks += len(action.block_ids)
            elif isinstance(action, WriteBlocks):
                self.check(set(action.block_ids) <= self.reserved, "copy written into unreserved blocks")
                self.written.append(action.stage)
            elif isinstance(action, RejectBlocks):
                self.rejected.append(action.stage)
            elif isinstance(action, AdmitRequest):
                self.check(self.log_outcome is True, "admitted without the committed outcome in the log")
                self.check(not self.src_running, "admitted while the source still runs the request")
                self.check(set(action.block_ids) <= self.reserved, "admitted with unreserved blocks")
                self.reserved -= set(action.block_ids)
                self.dst_admitted = True
            elif isinstance(action, ClaimOutcome):
                self.claim(action, self.dst_pending)
            elif isinstance(action, ReportMigrated | ReportFailed):
                self.reports.append(f"dst:{type(action).__name__}")
            else:
                raise InvariantBroken(f"destination cannot execute {action!r}")

    def claim(self, action: ClaimOutcome, answers: list[LocalEvent | str] | list[LocalEvent]) -> None:
        """The log keeps the first outcome; the answer comes back later but surely."""
        if self.log_outcome is None:
            self.log_outcome = isinstance(action.outcome, CommitAck)
        answers.append(OutcomeClaimed(committed=self.log_outcome))

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            raise InvariantBroken(message)

    # -- the environment's moves --------------------------------------------------

    def deliver_src_local(self, index: int) -> None:
        if not self.src_pending:
            return
        item = self.src_pending.pop(index % len(self.src_pending))
        if isinstance(item, str) and item.startswith("copy:"):
            # the data reaches the destination, which writes it only into blocks it still holds
            stage = int(item[5:])
            self.to_destination(BlocksReceived(stage=stage))
            if self.rejected and self.rejected[-1] == stage:
                self.rejected.pop()
                self.to_source(CopyFailed(
                    stage=stage, reason=MigrationAbortReason.COPY_FAILED, detail="rejected by the destination"
                ))
            else:
                written = bool(self.written) and self.written.pop() == stage
                self.check(written, "copy neither written nor rejected")
                self.to_source(CopyDone(stage=stage, num_full_blocks=self.full_blocks))
        elif item == "suspend":
            if self.src_running and not self.gone:
                self.src_running, self.suspended = False, True
                self.to_source(Suspended(num_blocks=0 if self.queued else self.full_blocks + 1))
        elif not isinstance(item, str):
            self.to_source(item)

    def deliver_dst_local(self, index: int) -> None:
        if self.dst_pending:
            self.to_destination(self.dst_pending.pop(index % len(self.dst_pending)))

    def engine_step(self, tokens: int) -> None:
        if self.src_running and not self.gone and not self.queued:
            self.full_blocks += tokens % 3

    def finish_request(self) -> None:
        if self.src_running and not self.gone:
            self.gone, self.src_running, self.src_owns = True, False, False
            self.to_source(RequestGone(reason=MigrationAbortReason.REQUEST_FINISHED))

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.to_source(Tick())
        if self.dst is not None:
            self.to_destination(Tick())

    def settle(self, rounds: int = 200) -> None:
        """Deliver what is left, let every timeout fire, until both machines are done."""
        for _ in range(rounds):
            while self.src_pending or self.dst_pending or self.to_dst or self.to_src:
                if self.src_pending:
                    self.deliver_src_local(0)
                elif self.dst_pending:
                    self.deliver_dst_local(0)
                elif self.to_dst:
                    self.to_destination(self.to_dst.pop(0))
                else:
                    self.to_source(self.to_src.pop(0))
            assert self.src is not None
            if is_final(self.src) and (self.dst is None or is_final(self.dst)):
                return
            self.tick(30.0)
        raise InvariantBroken(f"no progress: {self.src.phase if self.src else None}, "
                              f"{self.dst.phase if self.dst else None}")

    def check_end(self) -> None:
        """Both idle: one owner (unless the request finished), no reservation left."""
        self.check(not self.reserved, f"reservation left after both sides finished: {sorted(self.reserved)}")
        if self.gone:
            self.check(not self.dst_admitted, "a finished request was admitted on the destination")
            return
        self.check(self.src_owns != self.dst_admitted,
                   "both sides own the request" if self.src_owns else "neither side owns the request")
        self.check(self.dst_admitted == (self.log_outcome is True), "the owner disagrees with the log")
        if self.src_owns:
            self.check(self.src_running, "the source owns the request but left it suspended")

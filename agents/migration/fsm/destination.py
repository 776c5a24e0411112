"""The destination side of a live migration, as a state machine.

Phases and what moves them::

    RESERVING --Reserved--> RESERVED (Ack sent)      --ReserveFailed--> ABORTED (Abort sent)
    RESERVED  --PreAllocate(next stage)--> RESERVING
    RESERVED  --Commit--> CLAIMING: claim "committed" in the log
    CLAIMING  --OutcomeClaimed(committed)--> COMMITTED (admit, CommitAck sent) | ABORTED
    RESERVED  --Abort | PeerFailed | idle timeout--> ABORTED (reservation released)

The destination admits the request only after the log accepted its committed
event (``CommitAck``) as the migration's first outcome; so if the source gave
up first (it claimed "aborted" after waiting too long for ``COMMIT-ACK``) the
destination releases instead, and the request is never run twice. A
reservation is released by the one rollback, :func:`_rollback`, on abort,
peer failure, a failed reservation, a lost claim or ``destination_idle_timeout_s``
without news from the source. Copied data is written only into blocks still
reserved (:class:`~agents.migration.fsm.actions.WriteBlocks`), never after a
release. Repeated messages are answered again (the same
``Ack`` for a stage, the same ``CommitAck`` after committing, ``Abort`` once
aborted). Pure: :func:`destination_step` returns the next state and actions.

Stage 0 deduplicates against the prefix cache: the ``PreAllocate``'s block hashes go into
the ``Reserve``, the blocks the cache already holds come back referenced
(``Reserved.cached_block_ids``), the ``Ack`` says how many (``num_cached_blocks``) and blocks
are reserved for the rest only. Those references are held until the admission takes them
over or the rollback drops them with the reservation.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

import msgspec

from agents.migration.fsm.actions import (
    Action,
    AdmitRequest,
    BlocksReceived,
    ClaimOutcome,
    LocalEvent,
    OutcomeClaimed,
    PeerFailed,
    RejectBlocks,
    ReleaseReservation,
    ReportFailed,
    ReportMigrated,
    Reserve,
    Reserved,
    ReserveFailed,
    SendToPeer,
    Tick,
    WriteBlocks,
)
from agents.migration.fsm.config import MigrationConfig
from schemas.migration import Abort, Ack, Commit, CommitAck, MigrationMessage, PreAllocate, StageDone
from schemas.reasons import MigrationAbortReason

__all__ = ["DestinationPhase", "DestinationState", "destination_step", "start_destination"]

_replace = msgspec.structs.replace
_Step = tuple["DestinationState", tuple[Action, ...]]
_R = MigrationAbortReason


class DestinationPhase(enum.StrEnum):
    RESERVING = "reserving"
    RESERVED = "reserved"
    CLAIMING = "claiming"
    COMMITTED = "committed"
    ABORTED = "aborted"

    @property
    def is_final(self) -> bool:
        return self in (DestinationPhase.COMMITTED, DestinationPhase.ABORTED)


class DestinationState(msgspec.Struct, frozen=True, kw_only=True):
    """Where the destination stands.

    ``block_ids`` are every block it reserved for the request, ``blocks_by_stage``
    the same split by the stage that reserved them; ``cached_block_ids`` the request's leading
    blocks its prefix cache held at stage 0, referenced for it and not copied.
    """

    migration_id: str
    request_id: str
    source_id: str
    destination_id: str
    phase: DestinationPhase
    stage: int = 0
    block_ids: tuple[int, ...] = ()
    blocks_by_stage: tuple[tuple[int, ...], ...] = ()
    cached_block_ids: tuple[int, ...] = ()
    commit: Commit | None = None
    commit_ack: CommitAck | None = None
    deadline: float = math.inf
    reason: MigrationAbortReason | None = None


def start_destination(
    message: MigrationMessage, *, destination_id: str, now: float, config: MigrationConfig
) -> _Step:
    """A machine for the first message of an unknown migration.

    A stage-0 ``PreAllocate`` starts a reservation; anything else belongs to a
    migration this agent no longer (or never) knew, so it is answered with
    ``Abort`` where the source waits for an answer.
    """
    if isinstance(message, PreAllocate) and message.stage == 0:
        state = DestinationState(
            migration_id=message.migration_id, request_id=message.request_id,
            source_id=message.source_id, destination_id=destination_id,
            phase=DestinationPhase.RESERVING, stage=0,
        )
        hashes = message.block_hashes[: message.num_blocks]
        return state, (Reserve(stage=0, num_blocks=message.num_blocks, block_hashes=hashes),)
    request_id = getattr(message, "request_id", "")
    source_id = getattr(message, "source_id", "")
    state = DestinationState(
        migration_id=message.migration_id, request_id=request_id, source_id=source_id,
        destination_id=destination_id, phase=DestinationPhase.ABORTED, reason=_R.UNKNOWN_MIGRATION,
    )
    if isinstance(message, PreAllocate | Commit):
        return state, (SendToPeer(message=_abort(state, _R.UNKNOWN_MIGRATION)),)
    return state, ()


def _abort(state: DestinationState, reason: MigrationAbortReason, detail: str = "") -> Abort:
    return Abort(migration_id=state.migration_id, reason=reason, sender_id=state.destination_id,
                 detail=detail)


# -- the one rollback -----------------------------------------------------------


def _rollback(state: DestinationState, reason: MigrationAbortReason, *, notify_peer: bool,
              detail: str = "") -> _Step:
    """Release every reserved block and held cached block, tell the peer if asked, report."""
    actions: list[Action] = []
    if state.block_ids or state.cached_block_ids:
        actions.append(ReleaseReservation(block_ids=state.block_ids, cached_block_ids=state.cached_block_ids))
    if notify_peer:
        actions.append(SendToPeer(message=_abort(state, reason, detail)))
    actions.append(ReportFailed(reason=reason, detail=detail))
    state = _replace(state, phase=DestinationPhase.ABORTED, block_ids=(), blocks_by_stage=(),
                     cached_block_ids=(), deadline=math.inf, reason=reason)
    return state, tuple(actions)


# -- handlers -------------------------------------------------------------------


def _on_reserved(state: DestinationState, event: Reserved, now: float, config: MigrationConfig) -> _Step:
    if event.stage != state.stage:
        return state, ()
    state = _replace(
        state, phase=DestinationPhase.RESERVED, block_ids=state.block_ids + event.block_ids,
        blocks_by_stage=(*state.blocks_by_stage, event.block_ids),
        cached_block_ids=state.cached_block_ids + event.cached_block_ids,
        deadline=now + config.destination_idle_timeout_s,
    )
    return state, (SendToPeer(message=_ack(state, state.stage)),)


def _ack(state: DestinationState, stage: int) -> Ack:
    """The ``Ack`` of a reserved stage (stage 0 says how many leading blocks are held cached)."""
    return Ack(migration_id=state.migration_id, stage=stage, block_ids=state.blocks_by_stage[stage],
               num_cached_blocks=len(state.cached_block_ids) if stage == 0 else 0)


def _on_reserve_failed(state: DestinationState, event: ReserveFailed, now: float,
                       config: MigrationConfig) -> _Step:
    return _rollback(state, event.reason, notify_peer=True, detail=event.detail)


def _on_pre_allocate(state: DestinationState, event: PreAllocate, now: float,
                     config: MigrationConfig) -> _Step:
    if event.stage == state.stage:  # the source did not get our Ack: send it again
        return state, (SendToPeer(message=_ack(state, state.stage)),)
    if event.stage != state.stage + 1:
        return state, ()
    state = _replace(state, phase=DestinationPhase.RESERVING, stage=event.stage)
    return state, (Reserve(stage=event.stage, num_blocks=event.num_blocks),)


def _on_blocks_received(state: DestinationState, event: BlocksReceived, now: float,
                        config: MigrationConfig) -> _Step:
    if 0 <= event.stage < len(state.blocks_by_stage):
        return state, (WriteBlocks(stage=event.stage, block_ids=state.blocks_by_stage[event.stage]),)
    return state, (RejectBlocks(stage=event.stage, reason=_R.STAGE_NOT_RESERVED),)


def _on_unexpected_blocks(state: DestinationState, event: BlocksReceived, now: float,
                          config: MigrationConfig) -> _Step:
    return state, (RejectBlocks(stage=event.stage, reason=_R.STAGE_NOT_RESERVED,
                                detail=f"migration {state.phase.value}"),)


def _on_stage_done(state: DestinationState, event: StageDone, now: float, config: MigrationConfig) -> _Step:
    return _replace(state, deadline=now + config.destination_idle_timeout_s), ()


def _on_commit(state: DestinationState, event: Commit, now: float, config: MigrationConfig) -> _Step:
    ack = CommitAck(
        migration_id=state.migration_id, request_id=state.request_id,
        destination_id=state.destination_id, owner_epoch=event.owner_epoch + 1, resumed_at=now,
    )
    state = _replace(state, phase=DestinationPhase.CLAIMING, commit=event, commit_ack=ack,
                     deadline=now + config.claim_retry_s)
    return state, (ClaimOutcome(outcome=ack),)


def _claimed(state: DestinationState) -> tuple[Commit, CommitAck]:
    """The commit being claimed (set on entering CLAIMING)."""
    if state.commit is None or state.commit_ack is None:
        raise RuntimeError(f"migration {state.migration_id}: no commit in phase {state.phase}")
    return state.commit, state.commit_ack


def _on_outcome(state: DestinationState, event: OutcomeClaimed, now: float,
                config: MigrationConfig) -> _Step:
    if not event.committed:
        return _rollback(state, _R.CLAIM_LOST, notify_peer=False, detail="the source aborted first")
    commit, ack = _claimed(state)
    admit = AdmitRequest(commit=commit, block_ids=state.block_ids, cached_block_ids=state.cached_block_ids)
    state = _replace(state, phase=DestinationPhase.COMMITTED, deadline=math.inf)
    return state, (admit, SendToPeer(message=ack), ReportMigrated())


def _on_claim_retry(state: DestinationState, event: Tick, now: float, config: MigrationConfig) -> _Step:
    state = _replace(state, deadline=now + config.claim_retry_s)
    return state, (ClaimOutcome(outcome=_claimed(state)[1]),)


def _on_abort(state: DestinationState, event: Abort, now: float, config: MigrationConfig) -> _Step:
    detail = f"source aborted: {event.detail}" if event.detail else "source aborted"
    return _rollback(state, event.reason, notify_peer=False, detail=detail)


def _on_peer_failed(state: DestinationState, event: PeerFailed, now: float,
                    config: MigrationConfig) -> _Step:
    return _rollback(state, _R.PEER_FAILED, notify_peer=False, detail="source failed")


def _on_idle_timeout(state: DestinationState, event: Tick, now: float, config: MigrationConfig) -> _Step:
    return _rollback(state, _R.IDLE_TIMEOUT, notify_peer=True)


def _on_repeat_commit(state: DestinationState, event: Commit, now: float, config: MigrationConfig) -> _Step:
    return state, (SendToPeer(message=_claimed(state)[1]),)


def _on_late_request(state: DestinationState, event: Any, now: float, config: MigrationConfig) -> _Step:
    return state, (SendToPeer(message=_abort(state, state.reason or _R.UNKNOWN_MIGRATION)),)


_Handler = Callable[[DestinationState, Any, float, MigrationConfig], _Step]
_P = DestinationPhase

_TABLE: dict[tuple[DestinationPhase, type], _Handler] = {
    (_P.RESERVING, Reserved): _on_reserved,
    (_P.RESERVING, ReserveFailed): _on_reserve_failed,
    (_P.RESERVING, BlocksReceived): _on_unexpected_blocks,
    (_P.RESERVED, BlocksReceived): _on_blocks_received,
    (_P.RESERVED, PreAllocate): _on_pre_allocate,
    (_P.RESERVED, StageDone): _on_stage_done,
    (_P.RESERVED, Commit): _on_commit,
    (_P.RESERVED, Abort): _on_abort,
    (_P.RESERVED, PeerFailed): _on_peer_failed,
    (_P.RESERVED, Tick): _on_idle_timeout,
    (_P.CLAIMING, BlocksReceived): _on_unexpected_blocks,
    (_P.CLAIMING, OutcomeClaimed): _on_outcome,
    (_P.CLAIMING, Tick): _on_claim_retry,
    (_P.COMMITTED, Commit): _on_repeat_commit,
    (_P.COMMITTED, BlocksReceived): _on_unexpected_blocks,
    (_P.ABORTED, BlocksReceived): _on_unexpected_blocks,
    (_P.ABORTED, PreAllocate): _on_late_request,
    (_P.ABORTED, Commit): _on_late_request,
}


def destination_step(
    state: DestinationState,
    event: MigrationMessage | LocalEvent,
    *,
    now: float,
    config: MigrationConfig,
) -> _Step:
    """Apply one message or local event; unlisted (phase, event) pairs change nothing.

    While ``RESERVING`` only the block manager's answer counts: the shell gives
    it before anything else (reserving is a local, synchronous call).
    """
    if isinstance(event, Tick) and now < state.deadline:
        return state, ()
    if getattr(event, "migration_id", state.migration_id) != state.migration_id:
        return state, ()
    handler = _TABLE.get((state.phase, type(event)))
    if handler is None:
        return state, ()
    return handler(state, event, now, config)

"""The source side of a live migration, as a state machine.

Phases and what moves them (``T`` = the phase's timeout)::

    PRE_ALLOCATING --Ack(stage)--> COPYING --CopyDone--> PRE_ALLOCATING (next stage)
                                                     \\-> SUSPENDING (few blocks left*)
                                                     \\-> COMMITTING (after the last stage)
    SUSPENDING --Suspended--> PRE_ALLOCATING (last stage) | COMMITTING (nothing left)
    PRE_ALLOCATING (last stage of 0 blocks) --Ack--> COMMITTING (nothing to copy)
    COMMITTING --CommitAck--> MIGRATED (free the source blocks)
    COMMITTING --T | PeerFailed--> RESOLVING: claim "aborted" in the log
    RESOLVING  --OutcomeClaimed(committed)--> MIGRATED | ABORTED (resume on the source)

    * at most ``last_stage_max_blocks`` new full blocks, none after a paced stage; or max stages

Before ``COMMITTING``, an ``Abort`` from the destination, a timeout, a failed
copy, the peer failing or the request finishing / being preempted all roll
back. After ``Commit`` is sent only the log can say who owns the request, so
the source never frees its blocks on a guess: a ``CommitAck`` (sent only by a
destination that won the log) or the log's answer decides. An ``Abort`` from
the destination in ``COMMITTING`` is safe to act on: a destination that aborts
never commits. A request that finishes while a stage is being copied rolls back
when the copy ends, so the destination never frees blocks under a running copy;
the reason is the first thing that happened to the request, whatever the copy
then reports.

A request that holds no blocks (still queued on the source, never run: the
scheduler's move of a queued request) migrates the same way with nothing to
copy: ``Suspend`` (the shell holds it out of its queue) -> ``PreAllocate`` of 0
blocks -> ``Ack`` -> ``Commit``; the destination queues it instead of running it.

Deduplication: the first ``PreAllocate`` offers the chain hashes of the request's full
blocks (``block_hashes`` at the start); the destination's stage-0 ``Ack`` names how many
leading blocks it already caches (``num_cached_blocks``), and that stage copies only the
blocks after them (a stage left with nothing to copy is a ``CopyBlocks`` of an empty range,
done at once). Later stages are unchanged. An ``Ack`` claiming more blocks than were offered
is a ``BAD_ACK``; an older destination answers 0 and everything is copied.

Rollback lives in one place, :func:`_rollback`, which undoes exactly what the
state says is held. Every way to fail has a :class:`~schemas.reasons.MigrationAbortReason`:
a phase's timeout its own (``_TIMEOUTS``), an ``Abort`` from the destination the
destination's reason (the detail says who). Pure: :func:`source_step` returns the next state and the
actions; time comes in as ``now``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

import msgspec

from agents.migration.fsm.actions import (
    Action,
    CancelCopy,
    ClaimOutcome,
    CopyBlocks,
    CopyDone,
    CopyFailed,
    FreeSourceBlocks,
    LocalEvent,
    OutcomeClaimed,
    PeerFailed,
    ReportFailed,
    ReportMigrated,
    RequestGone,
    ResumeOnSource,
    SendCommit,
    SendToPeer,
    Suspend,
    Suspended,
    Tick,
)
from agents.migration.fsm.config import MigrationConfig
from schemas.migration import Abort, Ack, CommitAck, MigrationMessage, PreAllocate, StageDone
from schemas.reasons import MigrationAbortReason

__all__ = ["SourcePhase", "SourceState", "source_step", "start_source"]

_replace = msgspec.structs.replace
_Step = tuple["SourceState", tuple[Action, ...]]
_R = MigrationAbortReason


class SourcePhase(enum.StrEnum):
    PRE_ALLOCATING = "pre_allocating"
    COPYING = "copying"
    SUSPENDING = "suspending"
    COMMITTING = "committing"
    RESOLVING = "resolving"
    MIGRATED = "migrated"
    ABORTED = "aborted"

    @property
    def is_final(self) -> bool:
        return self in (SourcePhase.MIGRATED, SourcePhase.ABORTED)


class SourceState(msgspec.Struct, frozen=True, kw_only=True):
    """Where the source stands. Blocks ``[0, num_copied_blocks)`` are at the destination.

    ``stage`` is the current stage (-1 before the first); the current stage
    covers blocks ``[stage_start, stage_end)``. ``suspend_requested`` and
    ``peer_may_hold`` record what a rollback must undo. ``block_hashes`` are offered in the
    first ``PreAllocate`` (then dropped; ``num_offered`` counts them); ``num_cached_blocks``
    is how many leading blocks the destination held cached and were not copied.
    """

    migration_id: str
    request_id: str
    source_id: str
    destination_id: str
    phase: SourcePhase
    stage: int = -1
    last_stage: bool = False
    stage_start: int = 0
    stage_end: int = 0
    num_copied_blocks: int = 0
    destination_block_ids: tuple[int, ...] = ()
    block_hashes: tuple[int, ...] = ()
    num_offered: int = 0
    num_cached_blocks: int = 0
    suspend_requested: bool = False
    peer_may_hold: bool = False
    request_gone: MigrationAbortReason | None = None
    deadline: float = math.inf
    reason: MigrationAbortReason | None = None


def start_source(
    *,
    migration_id: str,
    request_id: str,
    source_id: str,
    destination_id: str,
    num_full_blocks: int,
    now: float,
    config: MigrationConfig,
    block_hashes: tuple[int, ...] = (),
) -> _Step:
    """Begin migrating a running request that has ``num_full_blocks`` full blocks.

    ``block_hashes``: the chain hashes of (at most) those full blocks, offered to the
    destination for deduplication against its prefix cache (empty: copy everything)."""
    state = SourceState(
        migration_id=migration_id, request_id=request_id, source_id=source_id,
        destination_id=destination_id, phase=SourcePhase.PRE_ALLOCATING,
        block_hashes=block_hashes[:num_full_blocks],
    )
    if num_full_blocks <= config.last_stage_max_blocks or config.max_stages == 1:
        return _suspend(state, now, config)
    return _pre_allocate(state, num_full_blocks, last=False, now=now, config=config)


# -- forward steps --------------------------------------------------------------


def _pre_allocate(state: SourceState, num_blocks: int, *, last: bool, now: float,
                  config: MigrationConfig) -> _Step:
    stage = state.stage + 1
    offered = state.block_hashes[:num_blocks] if stage == 0 else ()
    message = PreAllocate(
        migration_id=state.migration_id, request_id=state.request_id, source_id=state.source_id,
        destination_id=state.destination_id, stage=stage, num_blocks=num_blocks,
        copy_step_share=config.copy_step_share, block_hashes=offered,
    )
    state = _replace(
        state, phase=SourcePhase.PRE_ALLOCATING, stage=stage, last_stage=last,
        stage_start=state.num_copied_blocks, stage_end=state.num_copied_blocks + num_blocks,
        destination_block_ids=(), peer_may_hold=True, deadline=now + config.ack_timeout_s,
        block_hashes=(), num_offered=len(offered) if stage == 0 else state.num_offered,
    )
    return state, (SendToPeer(message=message),)


def _suspend(state: SourceState, now: float, config: MigrationConfig) -> _Step:
    state = _replace(
        state, phase=SourcePhase.SUSPENDING, suspend_requested=True,
        deadline=now + config.suspend_timeout_s,
    )
    return state, (Suspend(),)


def _commit(state: SourceState, now: float, config: MigrationConfig,
            sent: tuple[Action, ...] = ()) -> _Step:
    state = _replace(state, phase=SourcePhase.COMMITTING, deadline=now + config.commit_timeout_s)
    return state, (*sent, SendCommit(migration_id=state.migration_id))


def _claim_abort(state: SourceState, now: float, config: MigrationConfig,
                 reason: MigrationAbortReason) -> _Step:
    reason = state.reason or reason
    state = _replace(state, phase=SourcePhase.RESOLVING, deadline=now + config.claim_retry_s, reason=reason)
    abort = Abort(migration_id=state.migration_id, reason=reason, sender_id=state.source_id)
    return state, (ClaimOutcome(outcome=abort),)


def _claimed_reason(state: SourceState) -> MigrationAbortReason:
    """Why the source claimed "aborted" (set on entering RESOLVING; the fallback is never used)."""
    return state.reason or _R.COMMIT_TIMEOUT


def _migrated(state: SourceState) -> _Step:
    state = _replace(state, phase=SourcePhase.MIGRATED, deadline=math.inf)
    return state, (FreeSourceBlocks(), ReportMigrated())


# -- the one rollback -----------------------------------------------------------


def _rollback(state: SourceState, reason: MigrationAbortReason, *, notify_peer: bool,
              detail: str = "") -> _Step:
    """Undo what the state holds: stop a copy, resume the request, tell the peer, report."""
    actions: list[Action] = []
    if state.phase is SourcePhase.COPYING:
        actions.append(CancelCopy(stage=state.stage))
    if state.suspend_requested and state.request_gone is None:
        actions.append(ResumeOnSource())
    if notify_peer and state.peer_may_hold:
        actions.append(SendToPeer(message=Abort(
            migration_id=state.migration_id, reason=reason, sender_id=state.source_id, detail=detail,
        )))
    actions.append(ReportFailed(reason=reason, detail=detail))
    state = _replace(state, phase=SourcePhase.ABORTED, deadline=math.inf, reason=reason)
    return state, tuple(actions)


# -- handlers -------------------------------------------------------------------


def _on_ack(state: SourceState, event: Ack, now: float, config: MigrationConfig) -> _Step:
    if event.stage != state.stage:
        return state, ()  # a duplicate or a late ack of another stage
    cached = event.num_cached_blocks if state.stage == 0 else 0
    if cached:
        if not 0 < cached <= state.num_offered:
            detail = f"{cached} blocks held cached of {state.num_offered} offered"
            return _rollback(state, _R.BAD_ACK, notify_peer=True, detail=detail)
        # the destination holds the leading blocks already: this stage copies the rest
        state = _replace(state, num_cached_blocks=cached, num_copied_blocks=cached,
                         stage_start=state.stage_start + cached)
    num_blocks = state.stage_end - state.stage_start
    if len(event.block_ids) != num_blocks:
        detail = f"{len(event.block_ids)} blocks reserved for a stage of {num_blocks}"
        return _rollback(state, _R.BAD_ACK, notify_peer=True, detail=detail)
    if num_blocks == 0 and state.last_stage:  # nothing to copy (a queued request): commit at once
        return _commit(_replace(state, destination_block_ids=()), now, config)
    copy = CopyBlocks(stage=state.stage, first_block=state.stage_start, end_block=state.stage_end,
                      destination_block_ids=event.block_ids)
    state = _replace(state, phase=SourcePhase.COPYING, destination_block_ids=event.block_ids,
                     deadline=now + config.copy_timeout_s)
    return state, (copy,)


def _on_copy_done(state: SourceState, event: CopyDone, now: float, config: MigrationConfig) -> _Step:
    if event.stage != state.stage:
        return state, ()
    if state.request_gone is not None:
        return _rollback(state, state.request_gone, notify_peer=True)
    state = _replace(state, num_copied_blocks=state.stage_end)
    done = SendToPeer(message=StageDone(
        migration_id=state.migration_id, stage=state.stage, num_blocks=state.stage_end - state.stage_start,
        num_bytes=event.num_bytes, duration_s=event.duration_s, last=state.last_stage,
    ))
    if state.last_stage:
        return _commit(state, now, config, sent=(done,))
    new_blocks = event.num_full_blocks - state.num_copied_blocks
    if _last_before_suspend(new_blocks, state.stage_end - state.stage_start, state.stage, config):
        state, actions = _suspend(state, now, config)
    else:
        state, actions = _pre_allocate(state, new_blocks, last=False, now=now, config=config)
    return state, (done, *actions)


def _last_before_suspend(new_blocks: int, stage_blocks: int, stage: int, config: MigrationConfig) -> bool:
    """Whether the stage just copied (``stage_blocks``, leaving ``new_blocks`` new full blocks)
    makes the next one the last: few blocks are left, or ``max_stages`` is reached. A stage of a
    paced size (:meth:`MigrationConfig.paces`) took about ``1 / copy_step_share`` times as long as
    at full speed, so the request decoded that many more tokens meanwhile: any new full block it
    left is caught up by one more (small, unpaced) stage first, so the suspended last stage, the
    request's downtime, is as small as after an unpaced copy."""
    if stage + 2 >= config.max_stages:
        return True
    if config.paces(stage_blocks):
        return new_blocks <= 0
    return new_blocks <= config.last_stage_max_blocks


def _on_suspended(state: SourceState, event: Suspended, now: float, config: MigrationConfig) -> _Step:
    remaining = event.num_blocks - state.num_copied_blocks
    if remaining <= 0 and state.stage >= 0:
        return _commit(state, now, config)
    # a request with no blocks (still queued: a move without KV) still reserves its (zero) blocks
    # first, so the destination knows the migration before the Commit
    return _pre_allocate(state, max(remaining, 0), last=True, now=now, config=config)


def _on_copy_failed(state: SourceState, event: CopyFailed, now: float, config: MigrationConfig) -> _Step:
    if event.stage != state.stage:
        return state, ()
    if state.request_gone is not None:  # the copy failed because the request lost its blocks
        return _rollback(state, state.request_gone, notify_peer=True, detail=event.detail)
    return _rollback(state, event.reason, notify_peer=True, detail=event.detail)


def _on_gone_before_copy(state: SourceState, event: RequestGone, now: float,
                         config: MigrationConfig) -> _Step:
    return _rollback(_replace(state, request_gone=event.reason), event.reason, notify_peer=True)


def _on_gone_while_copying(state: SourceState, event: RequestGone, now: float,
                           config: MigrationConfig) -> _Step:
    gone = state.request_gone or event.reason  # the first cause (preempted, then finished: preempted)
    return _replace(state, request_gone=gone), ()  # roll back once the copy stops


def _on_abort(state: SourceState, event: Abort, now: float, config: MigrationConfig) -> _Step:
    detail = f"destination aborted: {event.detail}" if event.detail else "destination aborted"
    return _rollback(state, event.reason, notify_peer=False, detail=detail)


def _on_peer_failed(state: SourceState, event: PeerFailed, now: float, config: MigrationConfig) -> _Step:
    return _rollback(state, _R.PEER_FAILED, notify_peer=False, detail="destination failed")


def _on_commit_ack(state: SourceState, event: CommitAck, now: float, config: MigrationConfig) -> _Step:
    return _migrated(state)


def _on_commit_unknown(state: SourceState, event: Any, now: float, config: MigrationConfig) -> _Step:
    reason = _R.PEER_FAILED if isinstance(event, PeerFailed) else _R.COMMIT_TIMEOUT
    return _claim_abort(state, now, config, reason)


def _on_outcome(state: SourceState, event: OutcomeClaimed, now: float, config: MigrationConfig) -> _Step:
    if event.committed:
        return _migrated(state)
    return _rollback(state, _claimed_reason(state), notify_peer=True)


#: The reason a phase's deadline gives (``COMMITTING`` claims it in the log instead of rolling back).
_TIMEOUTS: dict[SourcePhase, MigrationAbortReason] = {
    SourcePhase.PRE_ALLOCATING: _R.ACK_TIMEOUT,
    SourcePhase.COPYING: _R.COPY_TIMEOUT,
    SourcePhase.SUSPENDING: _R.SUSPEND_TIMEOUT,
    SourcePhase.COMMITTING: _R.COMMIT_TIMEOUT,
}


def _on_timeout(state: SourceState, event: Tick, now: float, config: MigrationConfig) -> _Step:
    if state.phase is SourcePhase.COMMITTING:
        return _claim_abort(state, now, config, _TIMEOUTS[state.phase])
    if state.phase is SourcePhase.RESOLVING:
        return _claim_abort(state, now, config, _claimed_reason(state))
    if state.phase is SourcePhase.COPYING and state.request_gone is not None:
        return _rollback(state, state.request_gone, notify_peer=True)
    return _rollback(state, _TIMEOUTS[state.phase], notify_peer=True)


_Handler = Callable[[SourceState, Any, float, MigrationConfig], _Step]
_P = SourcePhase

_TABLE: dict[tuple[SourcePhase, type], _Handler] = {
    (_P.PRE_ALLOCATING, Ack): _on_ack,
    (_P.PRE_ALLOCATING, Abort): _on_abort,
    (_P.PRE_ALLOCATING, RequestGone): _on_gone_before_copy,
    (_P.PRE_ALLOCATING, PeerFailed): _on_peer_failed,
    (_P.PRE_ALLOCATING, Tick): _on_timeout,
    (_P.COPYING, CopyDone): _on_copy_done,
    (_P.COPYING, CopyFailed): _on_copy_failed,
    (_P.COPYING, Abort): _on_abort,
    (_P.COPYING, RequestGone): _on_gone_while_copying,
    (_P.COPYING, PeerFailed): _on_peer_failed,
    (_P.COPYING, Tick): _on_timeout,
    (_P.SUSPENDING, Suspended): _on_suspended,
    (_P.SUSPENDING, Abort): _on_abort,
    (_P.SUSPENDING, RequestGone): _on_gone_before_copy,
    (_P.SUSPENDING, PeerFailed): _on_peer_failed,
    (_P.SUSPENDING, Tick): _on_timeout,
    (_P.COMMITTING, CommitAck): _on_commit_ack,
    (_P.COMMITTING, Abort): _on_abort,
    (_P.COMMITTING, PeerFailed): _on_commit_unknown,
    (_P.COMMITTING, Tick): _on_timeout,
    (_P.RESOLVING, CommitAck): _on_commit_ack,
    (_P.RESOLVING, OutcomeClaimed): _on_outcome,
    (_P.RESOLVING, Tick): _on_timeout,
}


def source_step(
    state: SourceState,
    event: MigrationMessage | LocalEvent,
    *,
    now: float,
    config: MigrationConfig,
) -> _Step:
    """Apply one message or local event; unlisted (phase, event) pairs change nothing.

    A :class:`Tick` before the deadline changes nothing; messages for another
    migration id are ignored. A request that finishes while committing is
    ignored here: it is suspended, and the owner the log names handles it.
    """
    if isinstance(event, Tick) and now < state.deadline:
        return state, ()
    if getattr(event, "migration_id", state.migration_id) != state.migration_id:
        return state, ()
    handler = _TABLE.get((state.phase, type(event)))
    if handler is None:
        return state, ()
    return handler(state, event, now, config)

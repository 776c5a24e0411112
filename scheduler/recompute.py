"""Fold points and decision recomputation: what makes a scheduler decision replayable.

The live scheduler folds the two streams only at *fold points*: it folds the
events it has buffered (in stream order), then the load reports it has
buffered (in stream order), then decides. Every fold point is recorded in the
log by exactly one ``Dispatched`` or ``SchedulerTick`` carrying its
:class:`Cursor` (the last events / loads sequences folded); decisions without
a cursor of their own (pairing, scaling, failures) were made at the last fold
point recorded in their epoch. A decision is then a pure function of

* the state at its fold point (the log folded segment by segment, each
  segment events-then-loads, exactly as the scheduler did), and
* the *overlay*: the scheduler's own events of the same epoch that sit between
  the fold point's events sequence and the decision in the events stream —
  decisions it had made but not yet folded back from the log;

plus the request. :func:`dispatch_decision`, :func:`requeue_decision` (a queued
request moved off a stalled instance, logged as a ``Dispatched`` with
``requeued_from``) and :func:`next_pairing_decision` are that function; the
live scheduler and every recomputation call them.
Scaling (:func:`scaling_event`) and failure detection (:func:`failure_event`)
also read the scheduler's clock and timers: those readings are recorded in
the decision (``ScalingInputs``, ``FailureInputs``), so they are recomputed
from the same view plus the readings.
Pairing is emitted one decision at a time: the first decision of
:func:`~scheduler.policy.pair_instances` over the view, applied to the view,
again, until the plan is empty.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import msgspec

from scheduler.cluster_state import ClusterState, InstanceStatus, live_loads
from scheduler.config import DispatchPolicy, PolicyConfig
from scheduler.fold import evolve
from scheduler.policy.dispatch import (
    Dispatcher,
    PendingRequest,
    make_dispatcher,
    requeue_choice,
    requeue_request,
)
from scheduler.policy.pairing import pair_instances
from scheduler.policy.scaling import ScalingDecision, ScalingState, decide_scaling
from schemas.decisions import (
    Dispatched,
    Paired,
    ScaleDown,
    ScaleUp,
    ScalingInputs,
    SchedulerTick,
    Unpaired,
)
from schemas.envelope import Body
from schemas.instance import FailureInputs, InstanceFailed
from schemas.load import QueuedRequest
from schemas.position import Position
from schemas.reasons import FailureReason
from schemas.rpc import DispatchRequest

__all__ = [
    "OVERLAY_STREAM",
    "Cursor",
    "SchedulerEvent",
    "apply_overlay",
    "dispatch_decision",
    "failure_event",
    "fold_point_of",
    "next_pairing_decision",
    "overlay_of",
    "pairing_plan_events",
    "recomputable",
    "recompute",
    "requeue_decision",
    "scaling_event",
    "scheduler_epoch",
]

#: The pseudo stream under which overlay events are applied to a transient view.
OVERLAY_STREAM = "~overlay"

SchedulerEvent = Dispatched | Paired | Unpaired | ScaleUp | ScaleDown | SchedulerTick | InstanceFailed


class Cursor(NamedTuple):
    """A fold point: the last events and loads sequences folded (0: none)."""

    events_seq: int
    loads_seq: int

    def covers(self, other: Cursor) -> bool:
        return self.events_seq >= other.events_seq and self.loads_seq >= other.loads_seq


def scheduler_epoch(body: Body) -> int | None:
    """The lease epoch of an event the active scheduler appended; None for anything else."""
    if isinstance(body, (Dispatched, Paired, Unpaired, ScaleUp, ScaleDown, SchedulerTick)):
        return body.epoch
    if isinstance(body, InstanceFailed) and body.epoch > 0:
        return body.epoch
    return None


def fold_point_of(body: Body) -> Cursor | None:
    """The fold point an event records, if it records one."""
    if isinstance(body, Dispatched) and (body.events_seq or body.loads_seq):
        return Cursor(body.events_seq, body.loads_seq)
    if isinstance(body, SchedulerTick) and not body.takeover:
        return Cursor(body.events_seq, body.loads_seq)
    return None


def apply_overlay(state: ClusterState, bodies: Iterable[Body]) -> ClusterState:
    """``state`` with ``bodies`` folded after it under the overlay pseudo stream."""
    view = state
    for body in bodies:
        view = evolve(view, Position(OVERLAY_STREAM, view.positions.get(OVERLAY_STREAM, 0) + 1), body)
    return view


def dispatch_decision(
    view: ClusterState,
    request: DispatchRequest,
    *,
    epoch: int,
    cursor: Cursor,
    policy: PolicyConfig,
    dispatcher: Dispatcher | None = None,
    cached_blocks: tuple[tuple[str, int], ...] = (),
    kv_seq: int = 0,
) -> Dispatched | None:
    """The placement of ``request`` over ``view`` as the event the scheduler appends (None: no place).

    ``dispatcher``: one made by ``make_dispatcher(policy.dispatch_policy, policy)``; by default
    one kept per policy configuration. A dispatcher memoises its ratings per instance view
    (the same result, computed once), so consecutive decisions over views that share most
    instances' loads rate only what changed.

    ``cached_blocks``: what the prefix index (at kv-stream sequence ``kv_seq``) said of the
    request's ``block_hashes``: per instance the leading blocks it holds. Like a scaling
    decision's clock readings it is an input the decision records, so a recomputation reads it
    back from the recorded event; the policy sees it as ``PendingRequest.cached_tokens``.
    """
    if dispatcher is None:
        dispatcher = _kept_dispatcher(policy)
    block_size = request.block_size
    pending = PendingRequest(
        request_id=request.request_id,
        num_prompt_tokens=request.num_prompt_tokens,
        priority=request.priority,
        exclude=request.exclude,
        cached_tokens=tuple((key, n * block_size) for key, n in cached_blocks),
    )
    decision = dispatcher.choose(pending, live_loads(view), num_dispatched=view.num_dispatched)
    if decision is None:
        return None
    return msgspec.structs.replace(
        decision.to_event(epoch), events_seq=cursor.events_seq, loads_seq=cursor.loads_seq,
        exclude=request.exclude, num_chain_blocks=len(request.block_hashes),
        cached_blocks=cached_blocks, kv_seq=kv_seq,
    )


def requeue_decision(
    view: ClusterState,
    request: QueuedRequest,
    source_id: str,
    *,
    epoch: int,
    cursor: Cursor,
    policy: PolicyConfig,
) -> Dispatched | None:
    """Where ``request``, still queued on ``source_id`` (no KV), moves over ``view``
    (:func:`~scheduler.policy.dispatch.requeue_choice`: only where it would start at once, never
    back), as the ``Dispatched`` the scheduler appends with ``requeued_from``; None: it stays."""
    dispatcher = make_dispatcher(policy.dispatch_policy, policy)
    pending = PendingRequest(
        request_id=request.request_id,
        num_prompt_tokens=request.num_prompt_tokens,
        priority=request.priority,
    )
    loads = live_loads(view)
    decision = requeue_choice(
        dispatcher, pending, source_id, loads, config=policy, num_dispatched=view.num_dispatched
    )
    if decision is None:
        return None
    # what it excluded: the source, and where growth leaves it no room (older logs: the source alone)
    excluded = requeue_request(pending, source_id, loads, policy).exclude
    return msgspec.structs.replace(
        decision.to_event(epoch), events_seq=cursor.events_seq, loads_seq=cursor.loads_seq,
        exclude=excluded, requeued_from=source_id,
    )


@functools.lru_cache(maxsize=8)
def _kept_dispatcher(policy: PolicyConfig) -> Dispatcher:
    return make_dispatcher(policy.dispatch_policy, policy)


def next_pairing_decision(
    view: ClusterState, *, epoch: int, policy: PolicyConfig
) -> Paired | Unpaired | None:
    """The first decision of the pairing plan over ``view``: an un-pairing first, else a pairing."""
    plan = pair_instances(live_loads(view), view.pairings.values(), policy)
    if plan.unpaired:
        return plan.unpaired[0].to_event(epoch)
    if plan.paired:
        return plan.paired[0].to_event(epoch)
    return None


def pairing_plan_events(
    view: ClusterState, *, epoch: int, policy: PolicyConfig, limit: int = 1024
) -> tuple[ClusterState, list[Paired | Unpaired]]:
    """Emit pairing decisions one at a time until the plan is empty; the view after them, and them."""
    events: list[Paired | Unpaired] = []
    for _ in range(limit):
        event = next_pairing_decision(view, epoch=epoch, policy=policy)
        if event is None:
            break
        events.append(event)
        view = apply_overlay(view, (event,))
    return view, events


def scaling_event(
    decision: ScalingDecision, *, epoch: int, clock: float, before: ScalingState
) -> ScaleUp | ScaleDown:
    """The event of a scaling decision, with the readings it was made from."""
    inputs = ScalingInputs(
        clock=clock,
        below_since=before.below_since,
        above_since=before.above_since,
        launch_started_at=before.launch_started_at,
    )
    return msgspec.structs.replace(decision.to_event(epoch), inputs=inputs)


def failure_event(
    view: ClusterState, instance_id: str, *, epoch: int, inputs: FailureInputs, last_heartbeat: float
) -> InstanceFailed | None:
    """``instance_id`` marked failed if, over ``view``, it is live and was silent for longer than
    the timeout (None otherwise). The silence is measured from the last report received, which
    cannot be older than the one the view folded: readings that say so are not the log's.
    ``last_heartbeat`` (wall clock) is reported, not decided on."""
    record = view.instances.get(instance_id)
    if record is None or record.status is InstanceStatus.FAILED:
        return None
    silence = inputs.clock - inputs.last_seen
    if silence <= inputs.timeout_s or record.load.stream_seq > inputs.last_report_seq:
        return None
    return InstanceFailed(
        instance_id=instance_id,
        reason=FailureReason.NO_LOAD_REPORT,
        detail=f"no load report for {silence:.1f}s",
        last_heartbeat=last_heartbeat,
        epoch=epoch,
        inputs=inputs,
        incarnation=record.incarnation,
    )


def recomputable(recorded: Body) -> bool:
    """Whether the log holds every input of ``recorded`` (a decision of a known policy, with its
    readings where it took any)."""
    if isinstance(recorded, Dispatched):
        return recorded.policy in DispatchPolicy._value2member_map_
    if isinstance(recorded, (Paired, Unpaired)):
        return True
    if isinstance(recorded, (ScaleUp, ScaleDown)):
        return recorded.inputs is not None
    if isinstance(recorded, InstanceFailed):
        return recorded.epoch > 0 and recorded.inputs is not None
    return False


def recompute(
    view: ClusterState, recorded: Body, *, policy: PolicyConfig
) -> Dispatched | Paired | Unpaired | ScaleUp | ScaleDown | InstanceFailed | None:
    """What the scheduler would decide in ``recorded``'s place over ``view`` (None: nothing).

    Call it for :func:`recomputable` decisions only (others give None).
    """
    if not recomputable(recorded):
        return None
    if isinstance(recorded, (ScaleUp, ScaleDown)):
        assert recorded.inputs is not None
        inputs = recorded.inputs
        before = ScalingState(
            below_since=inputs.below_since,
            above_since=inputs.above_since,
            launch_started_at=inputs.launch_started_at,
        )
        _, decision = decide_scaling(
            live_loads(view),
            now=inputs.clock,
            state=before,
            config=policy.scaling,
            num_launching=view.num_launching,
        )
        if decision is None:
            return None
        return scaling_event(decision, epoch=recorded.epoch, clock=inputs.clock, before=before)
    if isinstance(recorded, InstanceFailed):
        assert recorded.inputs is not None
        decided = failure_event(
            view,
            recorded.instance_id,
            epoch=recorded.epoch,
            inputs=recorded.inputs,
            last_heartbeat=recorded.last_heartbeat,
        )
        if decided is not None and not recorded.incarnation:  # an older log's: no incarnation named
            decided = msgspec.structs.replace(decided, incarnation=0)
        return decided
    if isinstance(recorded, Dispatched) and recorded.requeued_from:
        recorded_policy = dataclasses.replace(policy, dispatch_policy=DispatchPolicy(recorded.policy))
        queued = QueuedRequest(
            request_id=recorded.request_id,
            num_prompt_tokens=recorded.num_prompt_tokens,
            priority=recorded.priority,
        )
        cursor = Cursor(recorded.events_seq, recorded.loads_seq)
        return requeue_decision(
            view, queued, recorded.requeued_from, epoch=recorded.epoch, cursor=cursor, policy=recorded_policy
        )
    if isinstance(recorded, Dispatched):
        request = DispatchRequest(
            request_id=recorded.request_id,
            num_prompt_tokens=recorded.num_prompt_tokens,
            priority=recorded.priority,
            exclude=recorded.exclude,
            # the chain itself is not recorded, only its length and what the index said of it
            block_size=_recorded_block_size(view, recorded),
            block_hashes=(0,) * recorded.num_chain_blocks,
        )
        recorded_policy = dataclasses.replace(policy, dispatch_policy=DispatchPolicy(recorded.policy))
        cursor = Cursor(recorded.events_seq, recorded.loads_seq)
        return dispatch_decision(
            view, request, epoch=recorded.epoch, cursor=cursor, policy=recorded_policy,
            cached_blocks=recorded.cached_blocks, kv_seq=recorded.kv_seq,
        )
    if isinstance(recorded, (Paired, Unpaired)):
        return next_pairing_decision(view, epoch=recorded.epoch, policy=policy)
    return None


def _recorded_block_size(view: ClusterState, recorded: Dispatched) -> int:
    """The block size the recorded chain was cut in: that of the instances the index named."""
    for instance_id, _ in recorded.cached_blocks:
        record = view.instances.get(instance_id)
        if record is not None:
            return record.joined.block_size
    return 0


def overlay_of(buffered: Sequence[tuple[int, Body]], *, epoch: int, before_seq: int) -> list[Body]:
    """The scheduler's own events of ``epoch`` among ``buffered`` (unfolded events) before ``before_seq``."""
    return [body for seq, body in buffered if seq < before_seq and scheduler_epoch(body) == epoch]

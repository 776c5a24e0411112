"""The simulator's global scheduler: the live scheduler's fold and policies over its inputs.

:class:`PolicyLayer` keeps a :class:`~scheduler.cluster_state.ClusterState`
built by the live scheduler's own fold (:func:`scheduler.fold.evolve` /
:func:`~scheduler.fold.replay`) from the inputs a scheduler receives
(``InstanceJoined``, ``LoadReport``, ``InstanceLeft``, ...), and makes its
decisions with the same pure functions the live scheduler calls directly:
:func:`~scheduler.policy.make_dispatcher` for dispatch,
:func:`~scheduler.policy.pair_instances` for migration pairing and
:func:`~scheduler.policy.decide_scaling` for auto-scaling, over
:func:`~scheduler.cluster_state.live_loads` (instance-id order, ties to the
smaller id). Every decision is folded back as its event (``Dispatched``,
``Paired``, ``Unpaired``, ``ScaleUp``, ``ScaleDown``), as the live scheduler
appends it to the log.

With a :class:`PolicyLog` the layer records its inputs and every decision in
order; :func:`replay_policy_log` feeds such a log (the simulator's own, or one
rebuilt from a live recorded run) through a fresh layer and returns the
decisions it makes, which must equal the recorded ones.

:func:`replay_recorded_log` drives layers from a live scheduler's recorded
streams at the fold points the log records (see :mod:`scheduler.recompute`):
a base layer folds each segment (events, then load reports) as the scheduler
did; each decision is made by a fork of it that has folded the scheduler's own
events not yet folded at that point (the overlay), through
:meth:`PolicyLayer.dispatch` and :meth:`PolicyLayer.pair`.

No engine, no clock of its own: time is passed in. Positions are assigned
here, one counter per stream (``loads`` for load reports, ``events`` for
everything else, gapless).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from scheduler.cluster_state import ClusterState, initial_state, live_loads
from scheduler.config import PolicyConfig
from scheduler.fold import evolve, replay
from scheduler.policy import (
    DispatchDecision,
    InstanceLoad,
    PairingPlan,
    PendingRequest,
    ScalingDecision,
    ScalingState,
    decide_scaling,
    make_dispatcher,
    pair_instances,
)
from scheduler.policy.dispatch import requeue_choice, requeue_request
from scheduler.recompute import Cursor, fold_point_of, scheduler_epoch
from schemas.decisions import Dispatched, Paired, ScaleDown, ScaleUp, Unpaired
from schemas.envelope import Body
from schemas.load import LoadReport
from schemas.position import Position

__all__ = [
    "EVENTS_STREAM",
    "LOADS_STREAM",
    "DispatchCall",
    "FoldInputs",
    "PairCall",
    "PolicyLayer",
    "PolicyLog",
    "ReplayedDecision",
    "ScaleCall",
    "replay_policy_log",
    "replay_recorded_log",
]

EVENTS_STREAM = "events"
LOADS_STREAM = "loads"

Decision = Dispatched | Paired | Unpaired | ScaleUp | ScaleDown


class FoldInputs(msgspec.Struct, frozen=True, kw_only=True):
    """Inputs the scheduler received (reports, lifecycle events), folded in this order."""

    bodies: tuple[Body, ...]


class DispatchCall(msgspec.Struct, frozen=True, kw_only=True):
    """A dispatch asked for, and the event it produced (None: no instance was eligible)."""

    request: PendingRequest
    decision: Dispatched | None


class PairCall(msgspec.Struct, frozen=True, kw_only=True):
    """A pairing round and the events it produced (un-pairings first, then new pairs)."""

    decisions: tuple[Unpaired | Paired, ...]


class ScaleCall(msgspec.Struct, frozen=True, kw_only=True):
    """A scaling evaluation at ``now`` and the event it produced, if any."""

    now: float
    decision: ScaleUp | ScaleDown | None


LogEntry = FoldInputs | DispatchCall | PairCall | ScaleCall


class PolicyLog:
    """What a :class:`PolicyLayer` received and decided, in order."""

    def __init__(self) -> None:
        self.entries: list[LogEntry] = []

    def decisions(self) -> list[Decision | None]:
        """Every decision call's outcome in order (pairing rounds contribute each event)."""
        out: list[Decision | None] = []
        for entry in self.entries:
            if isinstance(entry, DispatchCall | ScaleCall):
                out.append(entry.decision)
            elif isinstance(entry, PairCall):
                out.extend(entry.decisions)
        return out


class PolicyLayer:
    """The live scheduler's state fold and decision rules, driven by a caller (the simulator)."""

    def __init__(self, config: PolicyConfig, *, epoch: int = 1, log: PolicyLog | None = None) -> None:
        self.config = config
        self.epoch = epoch
        self.log = log
        self.state: ClusterState = initial_state(gapless_streams=(EVENTS_STREAM,))
        self._dispatcher = make_dispatcher(config.dispatch_policy, config)
        self._scaling = ScalingState()
        self._seq = {EVENTS_STREAM: 0, LOADS_STREAM: 0}
        self._views: list[InstanceLoad] | None = None
        self._views_of: ClusterState | None = None

    def fork(self) -> PolicyLayer:
        """A layer at this one's state and positions (no log), to decide on a branch of it."""
        branch = PolicyLayer(self.config, epoch=self.epoch)
        branch.state = self.state
        branch._seq = dict(self._seq)
        branch._scaling = self._scaling
        return branch

    # ---------------------------------------------------------------- inputs

    def _position(self, body: Body) -> Position:
        stream = LOADS_STREAM if type(body) is LoadReport else EVENTS_STREAM
        seq = self._seq[stream] + 1
        self._seq[stream] = seq
        return Position(stream, seq)

    def fold(self, bodies: Iterable[Body]) -> None:
        """Fold received inputs in order (a batch is folded with :func:`~scheduler.fold.replay`)."""
        batch = tuple(bodies)
        if not batch:
            return
        if self.log is not None:
            self.log.entries.append(FoldInputs(bodies=batch))
        if len(batch) == 1:
            self.state = evolve(self.state, self._position(batch[0]), batch[0])
        else:
            self.state = replay(((self._position(b), b) for b in batch), self.state)

    def _fold_decision(self, body: Decision) -> None:
        self.state = evolve(self.state, self._position(body), body)

    # ---------------------------------------------------------------- views

    def loads(self) -> list[InstanceLoad]:
        """The policies' input: live instances' views in id order (rebuilt only when the state changed)."""
        if self._views_of is not self.state or self._views is None:
            self._views = live_loads(self.state)
            self._views_of = self.state
        return self._views

    def can_ever_place(self, num_prompt_tokens: int) -> bool | None:
        """Whether some live instance could ever hold this prompt; None if no instance is live."""
        views = self.loads()
        if not views:
            return None
        return any(view.can_ever_fit(num_prompt_tokens) for view in views)

    @property
    def num_launching(self) -> int:
        return self.state.num_launching

    # ---------------------------------------------------------------- decisions

    def dispatch(self, request: PendingRequest) -> DispatchDecision | None:
        """Place one request (None: no eligible instance now); the decision is folded as ``Dispatched``."""
        decision = self._dispatcher.choose(request, self.loads(), num_dispatched=self.state.num_dispatched)
        event = None if decision is None else decision.to_event(self.epoch)
        if event is not None:
            self._fold_decision(event)
        if self.log is not None:
            self.log.entries.append(DispatchCall(request=request, decision=event))
        return decision

    def requeue(self, request: PendingRequest, source: str) -> DispatchDecision | None:
        """Move a request still queued on ``source`` where it would start at once
        (:func:`~scheduler.policy.dispatch.requeue_choice`); a move is folded and logged as a
        ``Dispatched`` (recomputing it as a dispatch gives the same instance), no move is not logged."""
        loads = self.loads()
        decision = requeue_choice(
            self._dispatcher, request, source, loads, config=self.config,
            num_dispatched=self.state.num_dispatched,
        )
        if decision is None:
            return None
        event = decision.to_event(self.epoch)
        self._fold_decision(event)
        if self.log is not None:  # replayed as a dispatch of the request with what it excluded
            moved = requeue_request(request, source, loads, self.config)
            self.log.entries.append(DispatchCall(request=moved, decision=event))
        return decision

    def pair(self) -> PairingPlan:
        """One pairing round over the pairs in force; un-pairings and new pairs are folded."""
        plan = pair_instances(self.loads(), self.state.pairings.values(), self.config)
        events: list[Unpaired | Paired] = [u.to_event(self.epoch) for u in plan.unpaired]
        events += [p.to_event(self.epoch) for p in plan.paired]
        for event in events:
            self._fold_decision(event)
        if self.log is not None:
            self.log.entries.append(PairCall(decisions=tuple(events)))
        return plan

    def scale(self, now: float) -> ScalingDecision | None:
        """One auto-scaling evaluation at ``now``; a decision is folded as ``ScaleUp``/``ScaleDown``."""
        self._scaling, decision = decide_scaling(
            self.loads(), now=now, state=self._scaling, config=self.config.scaling,
            num_launching=self.state.num_launching,
        )
        event = None if decision is None else decision.to_event(self.epoch)
        if event is not None:
            self._fold_decision(event)
        if self.log is not None:
            self.log.entries.append(ScaleCall(now=now, decision=event))
        return decision


def replay_policy_log(entries: Sequence[LogEntry], config: PolicyConfig, *, epoch: int = 1) -> PolicyLog:
    """Feed a recorded log's inputs and decision calls through a fresh layer; returns its own log.

    Compare ``result.decisions()`` with the recorded log's: the same inputs must
    give the same decisions.
    """
    log = PolicyLog()
    layer = PolicyLayer(config, epoch=epoch, log=log)
    for entry in entries:
        if isinstance(entry, FoldInputs):
            layer.fold(entry.bodies)
        elif isinstance(entry, DispatchCall):
            layer.dispatch(entry.request)
        elif isinstance(entry, PairCall):
            layer.pair()
        else:
            layer.scale(entry.now)
    return log


RecordedDecision = Dispatched | Paired | Unpaired


class ReplayedDecision(msgspec.Struct, frozen=True, kw_only=True):
    """A decision of a recorded live run and the layer's decision in its place.

    ``seq`` is the recorded event's sequence (0 with ``recorded`` None: the
    layer's pairing round planned a decision the scheduler did not record).
    """

    seq: int
    recorded: RecordedDecision | None
    recomputed: RecordedDecision | None

    @property
    def matches(self) -> bool:
        return self.recorded == self.recomputed


def _check_gapless(stream: str, seqs: Sequence[int]) -> None:
    if list(seqs) != list(range(1, len(seqs) + 1)):
        raise ValueError(
            f"the recorded {stream} stream must be complete from sequence 1 (the layer numbers it)"
        )


def replay_recorded_log(
    events: Sequence[tuple[int, Body]],
    loads: Sequence[tuple[int, LoadReport]],
    config: PolicyConfig,
) -> list[ReplayedDecision]:
    """Recompute every ``Dispatched``, ``Paired`` and ``Unpaired`` of a live run's log with layers.

    ``events`` and ``loads`` are the two streams' decoded entries (sequence,
    body), each complete from sequence 1. The base layer folds, at each fold
    point a ``Dispatched`` or ``SchedulerTick`` records, the events up to its
    events sequence and then the reports up to its loads sequence. A decision
    is made by a fork of the base that has folded the overlay: the scheduler's
    own events of the same epoch after the fold point's events sequence (its
    own decisions as the layer made them, the others as recorded). A dispatch
    is :meth:`PolicyLayer.dispatch` (the event completed with the fold point
    and the request's exclusions, as the scheduler records it); the first
    pairing decision of a round runs :meth:`PolicyLayer.pair` and the
    following recorded ones are compared with the rest of its plan. Older
    epochs' events after a newer one are stale and skipped, as the fold does.
    """
    _check_gapless("events", [seq for seq, _ in events])
    _check_gapless("loads", [seq for seq, _ in loads])
    base = PolicyLayer(config)
    cursor = Cursor(0, 0)
    folded_events = 0
    folded_loads = 0
    control_epoch = 0
    own: list[tuple[int, int, Body]] = []  # (seq, epoch, body as folded in the overlay)
    decider: PolicyLayer | None = None
    planned: list[Unpaired | Paired] = []
    out: list[ReplayedDecision] = []

    def unrecorded_plan() -> None:
        out.extend(ReplayedDecision(seq=0, recorded=None, recomputed=event) for event in planned)
        planned.clear()

    for seq, body in events:
        epoch = scheduler_epoch(body)
        if epoch is None or epoch < control_epoch:
            continue
        control_epoch = epoch
        if not isinstance(body, Paired | Unpaired):
            unrecorded_plan()
        point = fold_point_of(body)
        if decider is None or (point is not None and point != cursor):
            if point is not None:
                cursor = Cursor(
                    max(point.events_seq, cursor.events_seq), max(point.loads_seq, cursor.loads_seq)
                )
            base.fold(b for _, b in events[folded_events:cursor.events_seq])
            base.fold(b for _, b in loads[folded_loads:cursor.loads_seq])
            folded_events, folded_loads = cursor.events_seq, cursor.loads_seq
            own = [item for item in own if item[0] > cursor.events_seq]
            decider = base.fork()
            decider.fold(b for _, e, b in own if e == epoch)
        decider.epoch = epoch
        made: Body = body
        if isinstance(body, Dispatched):
            request = PendingRequest(
                request_id=body.request_id, num_prompt_tokens=body.num_prompt_tokens,
                priority=body.priority, exclude=body.exclude,
            )
            decision = decider.dispatch(request)
            recomputed = None if decision is None else msgspec.structs.replace(
                decision.to_event(epoch), events_seq=body.events_seq, loads_seq=body.loads_seq,
                exclude=body.exclude,
            )
            out.append(ReplayedDecision(seq=seq, recorded=body, recomputed=recomputed))
            made = recomputed if recomputed is not None else body
            if recomputed is None:
                decider.fold((body,))
        elif isinstance(body, Paired | Unpaired):
            if not planned:
                plan = decider.pair()
                planned.extend(u.to_event(epoch) for u in plan.unpaired)
                planned.extend(p.to_event(epoch) for p in plan.paired)
            first = planned.pop(0) if planned else None
            out.append(ReplayedDecision(seq=seq, recorded=body, recomputed=first))
            made = first if first is not None else body
            if first is None:
                decider.fold((body,))
        else:
            decider.fold((body,))
        own.append((seq, epoch, made))
    unrecorded_plan()
    return out

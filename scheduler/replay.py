"""Replaying a recorded log: state at a position or time, recomputed decisions, what-if.

:func:`replay_log` folds a :class:`~scheduler.logfile.RecordedLog` with the
same :class:`~scheduler.follower.Shadow` a standby scheduler runs, so the
state at each recorded fold point is the one the scheduler decided from. For
every dispatch and pairing decision it recomputes the decision over that view
and compares (replay recomputes, it never reads decisions back into state it
would not have derived), under the policy configuration the decision's epoch
recorded in its takeover tick (``ReplayOptions.policy`` for logs without one).
Scaling and failure decisions are recomputed from the clock readings they
record. A log whose events stream no longer starts at the beginning, or a
replay of a window (``from_time``), starts from the latest checkpoint of the
history stream before it (``scheduler.history``); decisions before
``from_time`` are folded, not recomputed.
With ``what_if`` (a :class:`WhatIf`: changes to those rules) it also decides
each point under the changed rules and reports where the choice differs and
the freeness of both choices. Migrations are summarised from
their handshake steps with stage timings. :func:`prefix_index_at` rebuilds the
prefix index as the scheduler had folded it at a kv-stream sequence (a
dispatch records the one it read). Pure apart from reading the in-memory log.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from scheduler.cluster_state import ClusterState, initial_state, live_loads
from scheduler.config import DispatchPolicy, PolicyConfig
from scheduler.follower import LogFollower, Shadow, ShadowStats
from scheduler.history import checkpoint_state, decode_checkpoint
from scheduler.logfile import RecordedLog
from scheduler.policy.dispatch import Dispatcher, PendingRequest, make_dispatcher
from scheduler.policy.load import freeness_after_admit, load_freeness
from scheduler.prefix_index import PrefixIndex
from scheduler.recompute import (
    Cursor,
    dispatch_decision,
    next_pairing_decision,
    recomputable,
    recompute,
)
from schemas.decisions import Dispatched, Paired, ScaleDown, ScaleUp, Unpaired
from schemas.envelope import Body, Codec
from schemas.history import Checkpoint
from schemas.instance import InstanceFailed
from schemas.kv_events import KVCacheEvents
from schemas.load import LoadReport
from schemas.migration import Abort, Commit, CommitAck, PreAllocate, StageDone
from schemas.reasons import MigrationAbortReason, RpcErrorCode
from schemas.rpc import DispatchRequest, RpcError

__all__ = [
    "Candidate",
    "DecisionRow",
    "MigrationSummary",
    "ReplayOptions",
    "ReplayResult",
    "WhatIf",
    "WhatIfRow",
    "prefix_hits_text",
    "prefix_index_at",
    "replay_log",
]

_MALFORMED = RpcError(code=RpcErrorCode.MALFORMED, message="undecodable log entry")


@dataclass(frozen=True)
class WhatIf:
    """Changes to the recorded rules to decide again under; None keeps the recorded value."""

    dispatch_policy: DispatchPolicy | None = None
    low_freeness: float | None = None
    high_freeness: float | None = None
    target_freeness: float | None = None

    def apply(self, policy: PolicyConfig) -> PolicyConfig:
        changes = {
            name: value
            for name in ("low_freeness", "high_freeness", "target_freeness")
            if (value := getattr(self, name)) is not None
        }
        return dataclasses.replace(
            policy,
            dispatch_policy=self.dispatch_policy or policy.dispatch_policy,
            pairing=dataclasses.replace(policy.pairing, **changes),
        )


@dataclass(frozen=True)
class ReplayOptions:
    until_seq: int | None = None
    until_time: float | None = None
    #: Recomputes the decisions of epochs whose takeover tick recorded no policy (older logs).
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    what_if: WhatIf | None = None
    #: Requests whose dispatch view to keep (``ReplayResult.dispatch_views``): ``shoal replay --request``.
    capture_requests: frozenset[str] = frozenset()
    #: Recompute only decisions stored at or after this time (start from a checkpoint before it).
    from_time: float | None = None
    #: Fold points whose state to keep (``ReplayResult.states``).
    capture_at: frozenset[Cursor] = frozenset()


class Candidate(msgspec.Struct, frozen=True):
    """An instance as a dispatch decision saw it: its load and freeness before and after admitting."""

    instance_id: str
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_total_blocks: int
    freeness: float
    freeness_after: float
    excluded: bool = False
    #: What the decision's own policy maximised for this instance (e.g. minus the blocks ahead of the
    #: request under ``blocks_ahead``); None: not eligible, round-robin, or a policy unknown here.
    score: float | None = None


class DecisionRow(msgspec.Struct, frozen=True):
    """A recorded decision and its recomputation. ``verifiable`` is False when load reports it
    depended on are gone (outside the retention), or the log lacks an input of it (an older
    schema, a dispatch policy this shoal does not know): such a row is not a mismatch."""

    seq: int
    decision: Body
    recomputed: Body | None
    matches: bool
    verifiable: bool = True

    @property
    def kind(self) -> str:
        if isinstance(self.decision, Dispatched) and self.decision.requeued_from:
            return "requeue"  # a queued request moved off a stalled instance
        return _KINDS.get(type(self.decision), "other")


_KINDS: dict[type, str] = {
    Dispatched: "dispatch",
    Paired: "pairing",
    Unpaired: "pairing",
    ScaleUp: "scaling",
    ScaleDown: "scaling",
    InstanceFailed: "failure",
}


class WhatIfRow(msgspec.Struct, frozen=True):
    seq: int
    kind: str
    subject: str
    recorded: str
    alternative: str
    recorded_freeness: float
    alternative_freeness: float


class StageTiming(msgspec.Struct, frozen=True):
    stage: int
    num_blocks: int
    duration_s: float


class MigrationSummary(msgspec.Struct):
    migration_id: str
    request_id: str
    source_id: str
    destination_id: str
    started_at: float
    ended_at: float = 0.0
    outcome: str = "in_flight"  # "committed", or "aborted: <reason>" for people
    stages: list[StageTiming] = msgspec.field(default_factory=list)
    downtime_s: float | None = None
    abort_reason: MigrationAbortReason | None = None


class ReplayResult(msgspec.Struct):
    state: ClusterState
    cursor: Cursor
    stats: ShadowStats
    decisions: list[DecisionRow]
    what_if: list[WhatIfRow]
    migrations: list[MigrationSummary]
    num_events: int
    num_loads: int
    #: The policy each epoch recorded, and the one in force at the end (freeness is shown under it).
    policies: dict[int, PolicyConfig] = msgspec.field(default_factory=dict)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    #: For each captured dispatch (by events seq): every live instance as the decision saw it.
    dispatch_views: dict[int, list[Candidate]] = msgspec.field(default_factory=dict)
    #: The state at each fold point of ``ReplayOptions.capture_at`` the replay passed.
    states: dict[Cursor, ClusterState] = msgspec.field(default_factory=dict)
    #: The checkpoint the replay started from (None: the log's beginning).
    checkpoint: Cursor | None = None

    @property
    def num_recomputed(self) -> int:
        return sum(1 for row in self.decisions if row.recomputed is not None or row.matches)

    @property
    def mismatches(self) -> list[DecisionRow]:
        return [row for row in self.decisions if row.verifiable and not row.matches]

    @property
    def num_unverifiable(self) -> int:
        return sum(1 for row in self.decisions if not row.verifiable)


def _decoded(codec: Codec, data: bytes) -> Body:
    envelope = codec.decode_or_none(data)
    return _MALFORMED if envelope is None else envelope.body


class _Retention:
    """Which fold points had every load report they depended on (the loads stream drops old ones).

    ``last_missing`` is the highest loads sequence absent from the log. A fold
    point at loads sequence ``L`` is complete if every instance has at least
    ``pending_report_limit + 1`` reports in ``(last_missing, L]``: an instance's
    view then depends only on reports that are present.
    """

    def __init__(
        self, loads: list[tuple[int, LoadReport]], pending_report_limit: int, start: int = 0
    ) -> None:
        """``start``: the loads sequence the replay's first state includes (a checkpoint's)."""
        present = [seq for seq, _ in loads if seq > start]
        expected = range(start + 1, (present[-1] if present else start) + 1)
        self.last_missing = 0 if len(present) == len(expected) else max(set(expected) - set(present))
        self.needed = pending_report_limit + 1
        self.by_instance: dict[str, list[int]] = {}
        for seq, report in loads:
            if seq > self.last_missing:
                self.by_instance.setdefault(report.instance_id, []).append(seq)

    def complete(self, view: ClusterState, loads_seq: int) -> bool:
        if self.last_missing == 0:
            return True
        if loads_seq <= self.last_missing:
            return False
        return all(
            bisect.bisect_right(self.by_instance.get(instance_id, []), loads_seq) >= self.needed
            for instance_id in view.instances
        )


class _Observer:
    def __init__(self, options: ReplayOptions, retention: _Retention, shadow: Shadow) -> None:
        self.options = options
        self.retention = retention
        self.shadow = shadow
        self.follower = shadow.follower
        self.rows: list[DecisionRow] = []
        self.what_if: list[WhatIfRow] = []
        self.dispatch_views: dict[int, list[Candidate]] = {}
        self.states: dict[Cursor, ClusterState] = {}
        #: Stored time per events seq, and the first time whose decisions are recomputed.
        self.times: dict[int, float] = {}
        self.from_time = float("-inf") if options.from_time is None else options.from_time

    def __call__(self, seq: int, body: Body, view: ClusterState) -> None:
        cursor = self.follower.cursor
        if cursor in self.options.capture_at and cursor not in self.states:
            self.states[cursor] = self.follower.state
        if type(body) not in _KINDS or (isinstance(body, InstanceFailed) and not body.epoch):
            return
        if self.times.get(seq, 0.0) < self.from_time:
            return
        if isinstance(body, Dispatched) and body.request_id in self.options.capture_requests:
            self.dispatch_views[seq] = _candidates(view, body, self.shadow.policy)
        if not recomputable(body):
            self.rows.append(DecisionRow(seq, body, None, False, verifiable=False))
            return
        recomputed = recompute(view, body, policy=self.shadow.policy)
        verifiable = self.retention.complete(view, cursor.loads_seq)
        self.rows.append(DecisionRow(seq, body, recomputed, recomputed == body, verifiable))
        if self.options.what_if is not None and isinstance(body, (Dispatched, Paired, Unpaired)):
            self._what_if(seq, body, view, self.options.what_if.apply(self.shadow.policy))

    def _what_if(self, seq: int, body: Body, view: ClusterState, policy: PolicyConfig) -> None:
        if isinstance(body, Dispatched):
            request = DispatchRequest(
                request_id=body.request_id,
                num_prompt_tokens=body.num_prompt_tokens,
                priority=body.priority,
                exclude=body.exclude,
            )
            alternative = dispatch_decision(
                view, request, epoch=body.epoch, cursor=Cursor(0, 0), policy=policy
            )
            chosen = alternative.instance_id if alternative is not None else "-"
            if chosen != body.instance_id:
                self.what_if.append(
                    WhatIfRow(
                        seq,
                        "dispatch",
                        body.request_id,
                        body.instance_id,
                        chosen,
                        self._after(view, body.instance_id, body.num_prompt_tokens, policy),
                        self._after(view, chosen, body.num_prompt_tokens, policy),
                    )
                )
            return
        assert isinstance(body, (Paired, Unpaired))
        other = next_pairing_decision(view, epoch=body.epoch, policy=policy)
        if other != body:
            self.what_if.append(
                WhatIfRow(
                    seq,
                    "pairing",
                    body.source_id,
                    _describe(body),
                    _describe(other),
                    self._freeness(view, body.source_id, policy),
                    self._freeness(view, getattr(other, "source_id", ""), policy),
                )
            )

    @staticmethod
    def _freeness(view: ClusterState, instance_id: str, policy: PolicyConfig) -> float:
        record = view.instances.get(instance_id)
        return float("nan") if record is None else load_freeness(record.load, policy)

    @staticmethod
    def _after(view: ClusterState, instance_id: str, num_prompt_tokens: int, policy: PolicyConfig) -> float:
        record = view.instances.get(instance_id)
        if record is None:
            return float("nan")
        return freeness_after_admit(record.load, record.load.demand_blocks(num_prompt_tokens), policy)


def _candidates(view: ClusterState, body: Dispatched, policy: PolicyConfig) -> list[Candidate]:
    try:
        dispatcher: Dispatcher | None = make_dispatcher(body.policy, policy)
    except ValueError:
        dispatcher = None
    if dispatcher is not None and dispatcher.policy is DispatchPolicy.ROUND_ROBIN:
        dispatcher = None  # its "score" is a slot number, not a judgement of the instance
    request = PendingRequest(
        request_id=body.request_id, num_prompt_tokens=body.num_prompt_tokens, priority=body.priority
    )
    out = []
    for load in live_loads(view):
        record = view.instances[load.instance_id]
        demand = record.load.demand_blocks(body.num_prompt_tokens)
        alone = None if dispatcher is None else dispatcher.choose(request, [load])
        out.append(
            Candidate(
                instance_id=load.instance_id,
                num_running=load.num_running,
                num_waiting=load.num_waiting,
                num_used_blocks=load.num_used_blocks,
                num_total_blocks=load.num_total_blocks,
                freeness=load_freeness(record.load, policy),
                freeness_after=freeness_after_admit(record.load, demand, policy),
                excluded=load.instance_id in body.exclude,
                score=None if alone is None else alone.score,
            )
        )
    return out


def _describe(body: Body | None) -> str:
    if isinstance(body, Paired):
        return f"pair {body.source_id}->{body.destination_id}"
    if isinstance(body, Unpaired):
        return f"unpair {body.source_id}->{body.destination_id} ({body.reason})"
    return "-"


def _migrations(events: list[tuple[int, float, Body]]) -> list[MigrationSummary]:
    """Each migration's summary. The source records its ``Commit`` without waiting, so the
    destination's ``CommitAck`` (its claim) may be stored first: downtime needs both, in any order."""
    found: dict[str, MigrationSummary] = {}
    suspended: dict[str, float] = {}
    resumed: dict[str, float] = {}
    for _, time, body in events:
        if isinstance(body, Commit):
            suspended.setdefault(body.migration_id, body.suspended_at)
        elif isinstance(body, CommitAck):
            resumed.setdefault(body.migration_id, body.resumed_at)
        if isinstance(body, PreAllocate) and body.stage == 0 and body.migration_id not in found:
            found[body.migration_id] = MigrationSummary(
                body.migration_id,
                body.request_id,
                body.source_id,
                body.destination_id,
                started_at=time,
            )
        summary = found.get(getattr(body, "migration_id", ""))
        if summary is None or summary.outcome != "in_flight":
            continue
        if isinstance(body, StageDone):
            summary.stages.append(StageTiming(body.stage, body.num_blocks, body.duration_s))
        elif isinstance(body, CommitAck):
            summary.outcome, summary.ended_at = "committed", time
        elif isinstance(body, Abort):
            summary.outcome, summary.ended_at = f"aborted: {body.reason}", time
            summary.abort_reason = body.reason
    for summary in found.values():
        at, until = suspended.get(summary.migration_id), resumed.get(summary.migration_id)
        if summary.outcome == "committed" and at is not None and until is not None:
            summary.downtime_s = until - at
    return list(found.values())


def _start_checkpoint(log: RecordedLog, options: ReplayOptions, codec: Codec) -> Checkpoint | None:
    """The checkpoint to start from: needed if the events stream lost its beginning, or asked
    for by ``from_time``. The latest one before ``from_time`` (or the replay's end) whose fold
    point the events kept in the log follow without a gap."""
    first_event = log.events[0].seq if log.events else 1
    if first_event <= 1 and options.from_time is None:
        return None
    until = options.from_time if options.from_time is not None else options.until_time
    best: Checkpoint | None = None
    for entry in log.checkpoints:
        checkpoint = decode_checkpoint(codec, entry)
        if checkpoint is None or checkpoint.events_seq < first_event - 1:
            continue
        if options.until_seq is not None and checkpoint.events_seq > options.until_seq:
            continue
        if until is not None and checkpoint.taken_at > until:
            continue
        if best is None or checkpoint.events_seq > best.events_seq:
            best = checkpoint
    return best


def replay_log(log: RecordedLog, options: ReplayOptions | None = None) -> ReplayResult:
    """Fold ``log`` up to ``until_seq`` / ``until_time`` the way the scheduler did, recomputing decisions."""
    options = options or ReplayOptions()
    codec = Codec()
    subjects = log.subjects
    checkpoint = _start_checkpoint(log, options, codec)
    after = Cursor(0, 0) if checkpoint is None else Cursor(checkpoint.events_seq, checkpoint.loads_seq)
    events = [
        (e.seq, e.time, e.msg_id, _decoded(codec, e.data))
        for e in log.events
        if e.seq > after.events_seq
        and (options.until_seq is None or e.seq <= options.until_seq)
        and (options.until_time is None or e.time <= options.until_time)
    ]
    until_time = options.until_time
    if until_time is None and options.until_seq is not None and events:
        until_time = events[-1][1]
    loads = [
        (e.seq, body)
        for e in log.loads
        if e.seq > after.loads_seq and (until_time is None or e.time <= until_time)
        if isinstance(body := _decoded(codec, e.data), LoadReport)
    ]
    if checkpoint is not None:
        state = checkpoint_state(checkpoint)
        follower = LogFollower(
            state, events_stream=subjects.events_stream, loads_stream=subjects.loads_stream, cursor=after
        )
        shadow = Shadow(follower, control_epoch=checkpoint.epoch, policy=options.policy, verify=False)
        if checkpoint.policy:
            shadow.adopt_policy(checkpoint.epoch, checkpoint.policy)
    else:
        first_event = events[0][0] if events else 1
        state = initial_state(
            gapless_streams=(subjects.events_stream,),
            start_positions={subjects.events_stream: first_event - 1} if first_event > 1 else None,
        )
        follower = LogFollower(
            state, events_stream=subjects.events_stream, loads_stream=subjects.loads_stream
        )
        shadow = Shadow(follower, policy=options.policy, verify=False)
    retention = _Retention(loads, state.pending_report_limit, start=after.loads_seq)
    observer = _Observer(options, retention, shadow)
    observer.times = {seq: time for seq, time, _, _ in events}
    shadow.observer = observer
    for seq, report in loads:
        shadow.on_load(seq, report)
    for seq, _, msg_id, body in events:
        shadow.on_event(seq, body, msg_id)
        shadow.advance()
    shadow.advance()
    follower.fold_to(follower.received)
    return ReplayResult(
        state=follower.state,
        cursor=follower.cursor,
        stats=shadow.stats,
        decisions=observer.rows,
        what_if=observer.what_if,
        migrations=_migrations([(s, t, b) for s, t, _, b in events]),
        num_events=len(events),
        num_loads=len(loads),
        policies=dict(shadow.policies),
        policy=shadow.policy,
        dispatch_views=observer.dispatch_views,
        states=observer.states,
        checkpoint=None if checkpoint is None else after,
    )


def prefix_index_at(entries: Iterable[tuple[int, Body]], *, through_seq: int | None = None) -> PrefixIndex:
    """The prefix index folded from the kv stream's ``(seq, body)`` entries (in order, from the
    stream's first or from an index snapshot's sequence on) up to ``through_seq``: what a
    scheduler that read that far knew. Instances that failed since are still listed (the
    scheduler drops them when the events stream says so)."""
    index = PrefixIndex()
    for seq, body in entries:
        if through_seq is not None and seq > through_seq:
            break
        if isinstance(body, KVCacheEvents):
            index.apply(body, seq)
        else:
            index.reject(seq)
    return index


def prefix_hits_text(decision: Dispatched) -> str:
    """What a dispatch recorded of the prefix index, in words."""
    if not decision.num_chain_blocks:
        return f"dispatch of {decision.request_id}: no block hashes (not looked up)"
    held = ", ".join(f"{key} held {n} of {decision.num_chain_blocks}" for key, n in decision.cached_blocks)
    return (
        f"dispatch of {decision.request_id} to {decision.instance_id} at kv seq {decision.kv_seq}: "
        f"{held or f'no instance held any of its {decision.num_chain_blocks} blocks'}"
    )

"""Replaying the log of a random run rebuilds exactly the live state, and the same decisions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cluster_state import (
    ClusterState,
    InstanceStatus,
    decode_snapshot,
    encode_snapshot,
    initial_state,
    live_loads,
)
from scheduler.config import DispatchPolicy, PolicyConfig, ScalingConfig
from scheduler.fold import evolve, replay
from scheduler.policy import (
    PendingRequest,
    ScalingState,
    decide_scaling,
    make_dispatcher,
    pair_instances,
)
from schemas.decisions import Dispatched
from schemas.envelope import Body
from schemas.instance import InstanceFailed, InstanceHeartbeat, InstanceLeft, InstanceTerminating
from schemas.migration import Abort, Ack, Commit, CommitAck, PreAllocate, StageDone
from schemas.position import Position
from schemas.reasons import CloseReason, FailureReason, FinishReason, MigrationAbortReason
from schemas.requests import (
    RequestAborted,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPlaced,
    RequestRescued,
)
from tests.scheduler.events import EVENTS, LOADS, joined, report

CONFIG = PolicyConfig(scaling=ScalingConfig(sustain_s=3, max_instances=6))
POLICIES = list(DispatchPolicy)


class Run:
    """A scheduler, agents and frontends producing a log, with the scheduler folding it live."""

    def __init__(self) -> None:
        self.state = initial_state(gapless_streams=(EVENTS,), pending_report_limit=2)
        self.log: list[tuple[Position, Body]] = []
        self.seq = {EVENTS: 0, LOADS: 0}
        self.epoch = 1
        self.agent_seq: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.scaling = ScalingState()
        self.migrations: dict[str, int] = {}  # migration id -> next step

    def append(self, body: Body, stream: str = EVENTS, gap: int = 0) -> None:
        self.seq[stream] += 1 + gap
        position = Position(stream, self.seq[stream])
        self.log.append((position, body))
        self.state = evolve(self.state, position, body)

    def op(self, t: int, kind: int, a: int, b: int) -> None:
        iid = f"i{a % 5}"
        record = self.state.instances.get(iid)
        if kind == 0 and (record is None or record.status is InstanceStatus.FAILED):
            self.append(joined(iid, 400 + 100 * (b % 6), model="tiny" if a % 7 else "other"))
            self.agent_seq[iid] = self.accepted[iid] = 0
        elif kind == 1 and record is not None:
            self.agent_seq[iid] += 1
            self.accepted[iid] += b % 3
            running = ((0, b % 7, (b * 7) % 350),) + (((-1, 1, 20),) if b % 5 == 0 else ())
            self.append(report(iid, self.agent_seq[iid], running=running, accepted=self.accepted[iid],
                               hol=(b * 13) % 300 if b % 4 == 0 else 0, waiting=int(b % 4 == 0),
                               total=record.joined.num_blocks, terminating=b % 11 == 0),
                        LOADS, gap=b % 2)
        elif kind == 2:
            request = PendingRequest(request_id=f"r{t}", num_prompt_tokens=1 + (a * b) % 4000,
                                     priority=b % 3 - 1)
            placement = make_dispatcher(POLICIES[b % 4], CONFIG).choose(
                request, live_loads(self.state), num_dispatched=self.state.num_dispatched)
            if placement is not None:
                self.append(placement.to_event(self.epoch))
        elif kind == 3:
            plan = pair_instances(live_loads(self.state), self.state.pairings.values(), CONFIG)
            for end in plan.unpaired:
                self.append(end.to_event(self.epoch))
            for pair in plan.paired:
                self.append(pair.to_event(self.epoch))
        elif kind == 4:
            self.scaling, decision = decide_scaling(
                live_loads(self.state), now=float(t), state=self.scaling, config=CONFIG.scaling,
                num_launching=self.state.num_launching)
            if decision is not None:
                self.append(decision.to_event(self.epoch))
        elif kind == 5:
            self.migration_step(f"m{a % 4}-{b % 2}", f"q{a % 6}", b)
        elif kind == 6:
            self.request_event(f"q{a % 6}", b)
        elif kind == 7 and record is not None:
            lifecycle: list[Body] = [
                InstanceHeartbeat(instance_id=iid, seq=t),
                InstanceTerminating(instance_id=iid),
                InstanceFailed(instance_id=iid, reason=FailureReason.NO_LOAD_REPORT, epoch=self.epoch),
                InstanceLeft(instance_id=iid),
            ]
            self.append(lifecycle[b % 4])
        elif kind == 8:
            if b % 3 == 0:
                self.epoch += 1  # a new scheduler took the lease
            elif self.epoch > 1:  # the old one, not yet aware, decides once more
                self.append(Dispatched(epoch=self.epoch - 1, request_id=f"old{t}", instance_id=iid,
                                       policy="freeness", num_prompt_tokens=99))
        elif kind == 9 and self.log:
            position, body = self.log[-1]
            assert evolve(self.state, position, body) is self.state  # a redelivery changes nothing

    def migration_step(self, migration_id: str, request_id: str, b: int) -> None:
        step = self.migrations.get(migration_id, 0)
        if step >= 5:
            return
        common = dict(migration_id=migration_id)
        bodies: list[Body] = [
            PreAllocate(request_id=request_id, source_id="i0", destination_id="i1", stage=0, num_blocks=8,
                        **common),
            Ack(stage=0, block_ids=tuple(range(8)), **common),
            StageDone(stage=0, num_blocks=8, num_bytes=64, duration_s=0.01, **common),  # type: ignore[arg-type]
            Commit(request_id=request_id, source_id="i0", destination_id="i1", token_ids=(1,),
                   num_prompt_tokens=1, owner_epoch=0, suspended_at=0.0, **common),
            CommitAck(request_id=request_id, destination_id="i1", owner_epoch=1, resumed_at=0.0,
                      **common),
        ]
        if step > 0 and b % 5 == 0:
            self.append(Abort(reason=MigrationAbortReason.COMMIT_TIMEOUT, sender_id="i0", **common))
            self.migrations[migration_id] = 5
            return
        self.append(bodies[step])
        self.migrations[migration_id] = step + 1

    def request_event(self, request_id: str, b: int) -> None:
        bodies: list[Body] = [
            RequestArrived(request_id=request_id, num_prompt_tokens=10, max_tokens=5, priority=b % 2),
            RequestPlaced(request_id=request_id, instance_id="i2", bypass=b % 2 == 0),
            RequestFirstToken(request_id=request_id, instance_id="i2", ttft_s=0.2),
            RequestRescued(request_id=request_id, failed_instance_id="i2", new_instance_id="i3",
                           num_tokens_kept=2),
            RequestFinished(request_id=request_id, finish_reason=FinishReason.STOP, num_prompt_tokens=10,
                            num_output_tokens=5, e2e_s=1.0),
            RequestAborted(request_id=request_id, reason=CloseReason.CLIENT),
        ]
        self.append(bodies[b % 6])


ops = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 999), st.integers(0, 999)), max_size=120)


def _recompute_dispatches(log: list[tuple[Position, Body]]) -> int:
    """Re-decide every current-epoch dispatch from the state folded just before it."""
    state: ClusterState = initial_state(gapless_streams=(EVENTS,), pending_report_limit=2)
    checked = 0
    for position, body in log:
        current = isinstance(body, Dispatched) and body.epoch >= state.epoch
        if isinstance(body, Dispatched) and current and not body.request_id.startswith("old"):
            request = PendingRequest(request_id=body.request_id, num_prompt_tokens=body.num_prompt_tokens,
                                     priority=body.priority)
            decision = make_dispatcher(body.policy, CONFIG).choose(
                request, live_loads(state), num_dispatched=state.num_dispatched)
            assert decision is not None and decision.to_event(body.epoch) == body
            checked += 1
        state = evolve(state, position, body)
    return checked


@settings(max_examples=120, deadline=None)
@given(ops=ops, cut=st.integers(0, 10**6))
def test_replaying_a_random_run_rebuilds_the_live_state(ops: list[tuple[int, int, int]], cut: int) -> None:
    run = Run()
    for t, (kind, a, b) in enumerate(ops):
        run.op(t, kind, a, b)
    start = initial_state(gapless_streams=(EVENTS,), pending_report_limit=2)
    replayed = replay(run.log, start)
    assert replayed == run.state
    assert encode_snapshot(replayed) == encode_snapshot(run.state)
    assert replay(run.log, start) == replayed  # twice the same
    # recovery: a snapshot at any point plus the tail gives the same state
    k = cut % (len(run.log) + 1)
    snapshot = decode_snapshot(encode_snapshot(replay(run.log[:k], start)))
    assert replay(run.log[k:], snapshot) == run.state
    # decisions recomputed from the folded inputs are the decisions in the log
    _recompute_dispatches(run.log)


def test_a_busy_run_exercises_every_kind_of_event() -> None:
    run = Run()
    script = [(0, k, 0) for k in range(5)] + [(kind, a, b) for a in range(40) for kind, b in
                                               ((1, a * 37), (2, a * 11), (3, a), (4, a), (5, a), (6, a),
                                                (8, a), (9, 0))]
    script += [(7, 3, 3), (7, 1, 2), (1, 1, 5)]
    for t, (kind, a, b) in enumerate(script):
        run.op(t, kind, a, b)
    kinds = {type(body).__name__ for _, body in run.log}
    assert {"Dispatched", "Paired", "LoadReport", "CommitAck", "Abort", "InstanceLeft",
            "InstanceFailed", "RequestRescued"} <= kinds
    assert run.state.num_stale_decisions > 0 and run.state.num_dispatched > 0
    assert replay(run.log, initial_state(gapless_streams=(EVENTS,), pending_report_limit=2)) == run.state
    assert _recompute_dispatches(run.log) > 10

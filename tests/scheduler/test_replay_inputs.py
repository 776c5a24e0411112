"""Replay over logs a decision's inputs do not fully describe: an unknown dispatch policy, a failure
or scaling decision of an older schema (no readings), readings the log contradicts."""

from __future__ import annotations

from scheduler.cluster_state import live_loads
from scheduler.logfile import LogEntry, RecordedLog
from scheduler.policy.scaling import average_scaling_freeness
from scheduler.replay import replay_log
from schemas import Codec, Subjects
from schemas.decisions import Dispatched, LoadPosition, ScaleDown, ScaleUp, ScalingInputs, SchedulerTick
from schemas.envelope import Body
from schemas.instance import FailureInputs, InstanceFailed
from schemas.reasons import FailureReason
from tests.scheduler.log_helpers import _joined, _load

PREFIX = "inputs"


def _log(bodies: list[Body]) -> RecordedLog:
    subjects, codec = Subjects(PREFIX), Codec(producer="test")
    log = RecordedLog(PREFIX, [], [])
    for body in bodies:
        loads = type(body).__name__ == "LoadReport"
        entries = log.loads if loads else log.events
        subject = subjects.load("i1") if loads else subjects.sched("x")
        entries.append(
            LogEntry(
                len(entries) + 1,
                100.0 + len(log.events) + len(log.loads),
                subject,
                codec.encode(body, time=0.0),
            )
        )
    return log


def test_a_dispatch_of_an_unknown_policy_is_not_verifiable_and_does_not_crash() -> None:
    log = _log(
        [
            SchedulerTick(epoch=1, takeover=True),
            _joined("i1"),
            _load("i1", 1, 40),
            Dispatched(
                epoch=1,
                request_id="r",
                instance_id="i1",
                policy="a-policy-from-the-future",
                num_prompt_tokens=8,
                loads=(LoadPosition(instance_id="i1", stream_seq=1),),
                events_seq=2,
                loads_seq=1,
            ),
        ]
    )
    result = replay_log(log)
    [row] = result.decisions
    assert row.kind == "dispatch" and not row.verifiable and result.mismatches == []


def test_failure_and_scaling_decisions_are_recomputed_from_their_readings() -> None:
    readings = FailureInputs(clock=50.0, last_seen=40.0, timeout_s=3.0, last_report_seq=1)
    failed = InstanceFailed(
        instance_id="i1",
        reason=FailureReason.NO_LOAD_REPORT,
        detail="no load report for 10.0s",
        last_heartbeat=90.0,
        epoch=1,
        inputs=readings,
    )
    base = [
        SchedulerTick(epoch=1, takeover=True),
        _joined("i1"),
        _load("i1", 1, 40),
        SchedulerTick(epoch=1, events_seq=2, loads_seq=1),
    ]
    result = replay_log(_log([*base, failed]))
    [row] = result.decisions
    assert row.kind == "failure" and row.matches
    # readings that do not cross the timeout, or name a report older than the one folded: mismatches
    for inputs in (
        FailureInputs(clock=50.0, last_seen=48.0, timeout_s=3.0, last_report_seq=1),
        FailureInputs(clock=50.0, last_seen=40.0, timeout_s=3.0, last_report_seq=0),
    ):
        wrong = InstanceFailed(
            instance_id="i1",
            reason=FailureReason.NO_LOAD_REPORT,
            detail=failed.detail,
            last_heartbeat=90.0,
            epoch=1,
            inputs=inputs,
        )
        assert len(replay_log(_log([*base, wrong])).mismatches) == 1
    # a version-2 failure decision (no readings) and scale-up: shown, not verifiable, not a mismatch
    old = [
        InstanceFailed(instance_id="i1", reason=FailureReason.NO_LOAD_REPORT, epoch=1),
        ScaleUp(epoch=1, num_instances=1, average_freeness=5.0),
    ]
    rows = replay_log(_log([*base, *old])).decisions
    assert [(r.kind, r.verifiable) for r in rows] == [("failure", False), ("scaling", False)]


def test_a_scale_down_is_recomputed_from_its_clock_and_timers() -> None:
    base = [
        SchedulerTick(epoch=1, takeover=True),
        _joined("i1"),
        _joined("i2"),
        _load("i1", 1, 40),
        _load("i2", 2, 90),
        SchedulerTick(epoch=1, events_seq=3, loads_seq=2),
    ]
    state = replay_log(_log(base)).state
    average = average_scaling_freeness(live_loads(state))
    assert average is not None and average > 60  # above the default band [10, 60]

    def scale_down(above_since: float) -> ScaleDown:
        inputs = ScalingInputs(clock=100.0, above_since=above_since)
        return ScaleDown(epoch=1, instance_id="i1", average_freeness=average, inputs=inputs)

    [row] = replay_log(_log([*base, scale_down(above_since=85.0)])).decisions  # above for 15 s >= 10 s
    assert row.kind == "scaling" and row.matches
    [row] = replay_log(_log([*base, scale_down(above_since=95.0)])).decisions  # only 5 s: no decision
    assert not row.matches and row.recomputed is None

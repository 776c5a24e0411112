from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator

import httpx
import pytest

from agents.engines.sim import SimEngine
from frontend.detokenize import IncrementalDetokenizer
from frontend.drill.faults import FaultRecord
from frontend.drill.greedy import GreedyText, RecordedText, SimTokens
from frontend.drill.load import LoadGenerator, Outcome, RequestRecord
from frontend.drill.report import report_dict, verdict_counts
from frontend.drill.runner import DrillResult
from frontend.drill.scenario import BUILTIN, LoadSpec
from frontend.drill.verdicts import (
    AgentCheck,
    LogCheck,
    Verdict,
    check_placements,
    greedy_verdict,
    hang_verdict,
    hanging,
    judge,
    placement_verdict,
    ready_intervals,
    takeable_verdict,
)
from schemas import SamplingParams
from schemas.instance import InstanceFailed
from schemas.reasons import FailureReason
from schemas.requests import RequestPlaced, RequestRescued
from tests.scheduler.events import joined


def _abort_verdict(abort_reasons: dict[str, int]) -> Verdict:
    log = LogCheck(num_migrations=sum(abort_reasons.values()), aborted=sum(abort_reasons.values()),
                   abort_reasons=abort_reasons)
    verdicts = judge(BUILTIN["kv-blackhole"], [], [], [], log, recovered=True, num_rescues=0.0,
                     num_preemptions=0, greedy_method=None)
    return next(v for v in verdicts if v.name == "a migration aborted by the fault")


@pytest.mark.parametrize(
    ("reasons", "passed", "detail"),
    [
        ({"copy_timeout": 1}, True, "aborts: {'copy_timeout': 1}"),
        ({"request_finished": 2}, False,
         "aborts: none; not counted, the request ended first: {'request_finished': 2}"),
        ({"copy_timeout": 1, "request_finished": 3}, True,
         "aborts: {'copy_timeout': 1}; not counted, the request ended first: {'request_finished': 3}"),
    ],
)
def test_a_migration_that_ended_with_its_request_is_not_counted_as_aborted_by_the_fault(
    reasons: dict[str, int], passed: bool, detail: str
) -> None:
    verdict = _abort_verdict(reasons)
    assert (verdict.passed, verdict.detail) == (passed, detail)


# ------------------------------------------------------------------ greedy text

_GREEDY = "greedy text as without faults"


def _engine_tokens(request_id: str, max_tokens: int) -> list[int]:
    """What a sim engine generates for a greedy request of this id, run step by step."""
    engine = SimEngine("tiny-test")
    engine.add_request(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step().outputs for t in o.token_ids]
    return tokens


def _rendered(sim: SimTokens, tokens: list[int], rng: random.Random) -> str:
    """The frontend's text for these tokens, arriving in deltas of random sizes."""
    detokenizer = IncrementalDetokenizer(sim.tokenizer, sim.tokenizer.encode("river stone"))
    parts, index = [], 0
    while index < len(tokens):
        size = rng.randint(1, 8)
        parts.append(detokenizer.push(tokens[index : index + size]))
        index += size
    return "".join(parts) + detokenizer.flush()


def _load(greedy: GreedyText | None) -> LoadGenerator:
    spec = LoadSpec(output_tokens=64)
    return LoadGenerator(spec, "http://127.0.0.1:9", "sim:tiny-test", lambda: 0.0, greedy)


def _answered(request_id: str, text: str, index: int = 0) -> RequestRecord:
    return RequestRecord(index, 0.0, False, True, 0, outcome=Outcome.OK, request_id=request_id, text=text)


def test_the_expected_sim_tokens_are_those_the_engine_generates_for_the_request_id() -> None:
    sim = SimTokens("tiny-test", 64)
    for request_id in ("cmpl-0", "cmpl-5f1c", "chatcmpl-ab12"):
        assert sim.token_ids(request_id) == _engine_tokens(request_id, 64)


def test_the_compared_text_does_not_depend_on_how_the_tokens_were_split_into_deltas() -> None:
    sim, rng = SimTokens("tiny-test", 400), random.Random(7)
    for n in range(200):
        request_id = f"cmpl-{n:032x}"
        expected = sim.expected(request_id, 0)
        assert expected is not None
        want = sim.compared(expected)
        for _ in range(3):
            assert sim.compared(_rendered(sim, sim.token_ids(request_id), rng)) == want


@pytest.mark.parametrize(("from_index", "wrong"), [(1, "another request's"), (32, "another request's"),
                                                   (32, "restarted at index 0")])
def test_a_sim_answer_whose_tokens_go_wrong_after_some_index_is_a_mismatch(
    from_index: int, wrong: str
) -> None:
    sim, rng = SimTokens("tiny-test", 64), random.Random(from_index)
    load = _load(sim)
    # from from_index on, the tokens are another request's, or start again from output index 0 (an
    # engine that lost its place after a migration or rescue): every one of these answers differs (a
    # short wrong tail, or one shifted by a token or two, can read alike: greedy.py says why)
    good, bad = [], []
    for n in range(20):
        request_id = f"cmpl-{from_index}-{n}"
        tokens = sim.token_ids(request_id)
        other = sim.token_ids(f"other-{n}") if wrong == "another request's" else tokens[: 64 - from_index]
        broken = tokens[:from_index] + other[: 64 - from_index]
        good.append(_answered(request_id, _rendered(sim, tokens, rng), n))
        bad.append(_answered(request_id, _rendered(sim, broken, rng), n))
    for record in good + bad:
        load._compare(record)
    assert all(r.outcome is Outcome.OK and r.compared_chars for r in good)
    assert sum(r.outcome is Outcome.MISMATCH for r in bad) == 20
    assert greedy_verdict(good, sim.method).status == "passed"
    failed = greedy_verdict(bad, sim.method)
    assert failed.status == "failed"
    assert failed.detail.startswith("20 of 20 greedy answers differ")


def test_recorded_text_is_compared_exactly() -> None:
    recorded = RecordedText()
    recorded.texts[0] = "caf\u00e9 au lait"
    load = _load(recorded)
    same, other = _answered("a", "caf\u00e9 au lait"), _answered("b", "caf\ufffd au lait", 1)
    load._compare(same)
    load._compare(other)
    assert (same.outcome, other.outcome) == (Outcome.OK, Outcome.MISMATCH)
    assert same.compared_chars == len("caf\u00e9 au lait")


def _judged(records: list[RequestRecord], method: str | None) -> DrillResult:
    result = DrillResult(BUILTIN["baseline"], records=records)
    result.verdicts = judge(BUILTIN["baseline"], records, [], [], LogCheck(), recovered=True, num_rescues=0.0,
                            num_preemptions=0, greedy_method=method)
    result.passed = not any(v.failed for v in result.verdicts)
    return result


@pytest.mark.parametrize(
    ("records", "method", "why"),
    [
        ([_answered("cmpl-1", "x")], None, "unknown"),  # a sim cluster the drill did not start
        ([RequestRecord(0, 0.0, False, False, -1, outcome=Outcome.OK)], "m", "0 greedy requests"),
        ([RequestRecord(0, 0.0, False, True, 0, outcome=Outcome.ERROR)], "m", "1 greedy requests, 0 comp"),
    ],
)
def test_a_greedy_verdict_with_nothing_compared_is_not_checked_not_passed(
    records: list[RequestRecord], method: str | None, why: str
) -> None:
    result = _judged(records, method)
    verdict = next(v for v in result.verdicts if v.name == _GREEDY)
    assert (verdict.status, verdict.checked, verdict.passed) == ("not checked", False, False)
    assert why in verdict.detail
    tally = verdict_counts([result])[_GREEDY]
    assert tally == {"scenarios": 1, "checked": 0, "passed": 0, "failed": 0, "not_checked": 1}
    data = report_dict([result])
    (scenario,) = data["scenarios"]
    assert next(v for v in scenario["verdicts"] if v["name"] == _GREEDY)["status"] == "not checked"
    assert data["verdicts"][_GREEDY]["not_checked"] == 1 and data["verdicts"][_GREEDY]["passed"] == 0


def test_the_suite_counts_per_verdict_how_many_scenarios_checked_and_passed_it() -> None:
    compared = _answered("cmpl-1", "x")
    compared.compared_chars = 1
    mismatch = _answered("cmpl-2", "y", 1)
    mismatch.compared_chars, mismatch.outcome = 1, Outcome.MISMATCH
    results = [_judged([compared], "m"), _judged([mismatch], "m"), _judged([compared], None)]
    assert [r.passed for r in results] == [True, False, True]
    counts = report_dict(results)["verdicts"]
    assert counts[_GREEDY] == {"scenarios": 3, "checked": 2, "passed": 1, "failed": 1, "not_checked": 1}
    assert counts["no request lost"]["checked"] == counts["no request lost"]["passed"] == 3


# ------------------------------------------------------------------ the bound, readiness, placements

_HANG = "no request hanging past the bound"
_TAKEABLE = "none lost where an instance could take it"
_PLACED = "never dispatched to an instance not ready"


def _ended(index: int, sent: float, ended: float | None, outcome: Outcome, **fields: object) -> RequestRecord:
    return RequestRecord(index, sent, False, False, -1, outcome=outcome, ended_at=ended, **fields)  # type: ignore[arg-type]


def _kill(component: str, at: float, **fields: object) -> FaultRecord:
    return FaultRecord("kill", "agents", component=component, injected_at=at, verified_at=at,
                       verified_by="pid gone", **fields)  # type: ignore[arg-type]


def test_a_request_that_fails_within_the_bound_after_the_fault_does_not_hang() -> None:
    # sent at 1 s, its agent killed at 5 s, the 503 at 11 s: 6 s after the fault, within 2 + 8
    records = [_ended(0, 1.0, 11.0, Outcome.ERROR, error_source="answer"), _ended(1, 2.0, 4.0, Outcome.OK)]
    verdict = hang_verdict(records, [_kill("agent-0", 5.0)], 2.0, 8.0)
    assert verdict.status == "passed", verdict.detail
    assert "the longest 6.00s" in verdict.detail


@pytest.mark.parametrize(
    ("record", "why"),
    [
        # the error came 12 s after the fault: past the 2 s bound plus the 8 s margin
        (_ended(0, 1.0, 17.0, Outcome.ERROR, error_source="answer"), "1 of 1 errors ended more than 10s"),
        # no end at all within the load's timeout
        (_ended(0, 1.0, 61.0, Outcome.LOST, timed_out=True, detail="no end within 60.0s"),
         "1 of 1 requests without an end"),
        (_ended(0, 1.0, None, Outcome.LOST, timed_out=True), "1 of 1 requests without an end"),
    ],
)
def test_a_request_that_hangs_past_the_bound_fails_the_verdict(record: RequestRecord, why: str) -> None:
    verdict = hang_verdict([record], [_kill("agent-0", 5.0)], 2.0, 8.0)
    assert verdict.status == "failed"
    assert why in verdict.detail


def test_the_hang_verdict_without_a_known_bound_is_not_checked() -> None:
    verdict = hang_verdict([_ended(0, 1.0, 2.0, Outcome.OK)], [], None, 8.0)
    assert (verdict.status, verdict.checked) == ("not checked", False)
    assert hang_verdict([], [], 30.0, 8.0).status == "not checked"


def test_readiness_ends_at_a_failure_a_departure_or_a_kill_and_starts_again_at_a_join() -> None:
    lifecycle = [(0.0, "agent-0", "joined"), (0.0, "agent-1", "joined"), (9.0, "agent-0", "joined"),
                 (6.0, "agent-1", "failed"), (12.0, "agent-1", "joined"), (14.0, "agent-1", "left")]
    spans = ready_intervals(lifecycle, [(5.0, "agent-0")], 20.0)
    assert spans == {"agent-0": [(0.0, 5.0), (9.0, 20.0)], "agent-1": [(0.0, 6.0), (12.0, 14.0)]}


def test_an_error_while_another_instance_was_ready_is_one_an_instance_could_have_taken() -> None:
    ready = {"agent-0": [(0.0, 5.0)], "agent-1": [(0.0, 30.0)]}
    error = _ended(3, 4.0, 9.0, Outcome.ERROR, error_source="answer", detail="HTTP 503: no instance")
    verdict = takeable_verdict([error, _ended(4, 1.0, 3.0, Outcome.OK)], ready, 3.0)
    assert verdict.status == "failed"
    assert verdict.detail.startswith("1 of 1 errors and losses") and "agent-1 ready" in verdict.detail
    lost = _ended(5, 4.0, 20.0, Outcome.LOST, detail="truncated without an error")
    assert takeable_verdict([lost], ready, 3.0).status == "failed"


@pytest.mark.parametrize(
    ("ready", "down", "ended"),
    [
        ({"agent-0": [(0.0, 5.0), (12.0, 30.0)]}, [], 9.0),  # every instance down at its end
        ({"agent-0": [(0.0, 5.0), (12.0, 30.0)]}, [], 13.0),  # back only 1 s before: within the grace
        ({"agent-0": [(0.0, 30.0)]}, [(8.0, 10.0)], 9.0),  # the frontend itself was down
    ],
)
def test_an_error_no_instance_could_have_taken_passes(
    ready: dict[str, list[tuple[float, float]]], down: list[tuple[float, float]], ended: float
) -> None:
    error = _ended(0, 4.0, ended, Outcome.ERROR, error_source="answer")
    verdict = takeable_verdict([error], ready, 3.0, down)
    assert verdict.status == "passed", verdict.detail
    assert takeable_verdict([error], None, 3.0).status == "not checked"


def _log(*bodies: object) -> LogCheck:
    check = LogCheck()
    check_placements(check, list(enumerate(bodies, start=1)))
    return check


def _failed(instance_id: str) -> InstanceFailed:
    return InstanceFailed(instance_id=instance_id, reason=FailureReason.NO_LOAD_REPORT)


def _placed(request_id: str, instance_id: str) -> RequestPlaced:
    return RequestPlaced(request_id=request_id, instance_id=instance_id)


def test_a_placement_on_an_instance_never_ready_or_failed_since_fails_the_placement_verdict() -> None:
    good = _log(joined("agent-0"), _placed("r1", "agent-0"),
                RequestRescued(request_id="r1", failed_instance_id="agent-9", new_instance_id="agent-0",
                               num_tokens_kept=3))
    assert placement_verdict(good).status == "passed"
    assert good.num_placements == 2 and good.joins == {"agent-0": 1}
    never = _log(joined("agent-0"), _placed("r1", "agent-1"))
    failed = _log(joined("agent-0"), _failed("agent-0"),
                  _placed("r2", "agent-0"))
    for check, why in ((never, "agent-1 (never ready"), (failed, "agent-0 (failed")):
        verdict = placement_verdict(check)
        assert verdict.status == "failed" and why in verdict.detail, verdict.detail
    rejoined = _log(joined("agent-0"), _failed("agent-0"),
                    joined("agent-0"), _placed("r3", "agent-0"))
    assert placement_verdict(rejoined).status == "passed"  # a new incarnation, ready again
    # the first incarnation (joined at seq 1) judged failed after the second joined (seq 2)
    stale = _log(joined("agent-0"), joined("agent-0"),
                 InstanceFailed(instance_id="agent-0", reason=FailureReason.NO_LOAD_REPORT, incarnation=1),
                 _placed("r4", "agent-0"))
    assert placement_verdict(stale).status == "passed"
    current = _log(joined("agent-0"), joined("agent-0"),
                   InstanceFailed(instance_id="agent-0", reason=FailureReason.NO_LOAD_REPORT, incarnation=2),
                   _placed("r5", "agent-0"))
    assert placement_verdict(current).status == "failed"
    assert placement_verdict(LogCheck()).status == "not checked"


def _scenario_verdicts(name: str, faults: list[FaultRecord], log: LogCheck) -> dict[str, Verdict]:
    verdicts = judge(BUILTIN[name], [_ended(0, 1.0, 2.0, Outcome.OK)], faults, [], log, recovered=True,
                     num_rescues=1.0, num_preemptions=0, greedy_method=None, bound_s=2.0,
                     ready={"agent-0": [(0.0, 30.0)]})
    return {v.name: v for v in verdicts}


def test_an_engine_that_cannot_step_fails_its_verdict_if_it_announced_itself_ready_or_got_a_request() -> None:
    name = "an engine that cannot step: never ready, never given a request"
    fine = _scenario_verdicts("engine-cannot-step", [], _log(joined("agent-0"), _placed("r1", "agent-0")))
    assert fine[name].status == "passed", fine[name].detail
    ready = _scenario_verdicts("engine-cannot-step", [], _log(joined("agent-3")))
    assert ready[name].status == "failed" and "agent-3 (exit): announced ready 1 times" in ready[name].detail
    given = _scenario_verdicts("engine-cannot-step", [], _log(joined("agent-0"), _placed("r1", "agent-2")))
    assert given[name].status == "failed" and "agent-2 (raise): announced ready 0 times, 1 placements" in (
        given[name].detail)
    assert given[_PLACED].status == "failed"


def test_agents_killed_together_must_come_back_by_supervision() -> None:
    name = "killed agents came back by supervision"
    back = [_kill("agent-0", 5.0, back_at=9.0), _kill("agent-1", 5.0, back_at=9.5)]
    assert _scenario_verdicts("all-agents-kill", back, LogCheck())[name].status == "passed"
    one_missing = [_kill("agent-0", 5.0, back_at=9.0), _kill("agent-1", 5.0)]
    verdict = _scenario_verdicts("all-agents-kill", one_missing, LogCheck())[name]
    assert verdict.status == "failed" and "agent-1 not back" in verdict.detail


def test_a_crash_looping_agent_must_be_left_down() -> None:
    name = "left down after crash-looping"
    kills = [FaultRecord("crash_loop", "agent", component="agent-1", injected_at=t, verified_at=t)
             for t in (5.0, 8.0, 12.0)]
    kills[-1].left_down, kills[-1].left_down_reason = True, "agent-1 exited 3 times within 60s; left down"
    verdict = _scenario_verdicts("agent-crash-loop", kills, LogCheck())[name]
    assert verdict.status == "passed" and verdict.detail.startswith("killed 3 times; agent-1 exited 3 times")
    kills[-1].left_down, kills[-1].left_down_reason = False, "still restarted after 3 kills"
    verdict = _scenario_verdicts("agent-crash-loop", kills, LogCheck())[name]
    assert verdict.status == "failed" and "still restarted" in verdict.detail
    # engines that cannot step: each must be left down
    stepless = [FaultRecord("first_step", how, component=agent, injected_at=3.0, verified_at=4.0,
                            left_down=True, left_down_reason=f"{agent} exited 3 times within 60s")
                for agent, how in (("agent-2", "raise"), ("agent-3", "exit"))]
    assert _scenario_verdicts("engine-cannot-step", stepless, LogCheck())[name].status == "passed"
    stepless[1].left_down, stepless[1].left_down_reason = False, ""
    verdict = _scenario_verdicts("engine-cannot-step", stepless, LogCheck())[name]
    assert verdict.status == "failed" and "agent-3 not left down" in verdict.detail


def test_the_suite_report_counts_hanging_requests_lost_requests_and_leaked_blocks() -> None:
    records = [_ended(0, 1.0, 17.0, Outcome.ERROR, error_source="answer"),  # 12 s after the fault
               _ended(1, 1.0, 61.0, Outcome.LOST, timed_out=True), _ended(2, 1.0, 9.0, Outcome.ERROR)]
    faults = [_kill("agent-0", 5.0)]
    assert hanging(records, faults, 2.0, 8.0) == 2
    assert hanging(records, faults, None, 8.0) is None
    result = DrillResult(BUILTIN["all-agents-kill"], records=records, faults=faults, num_hanging=2,
                         agents=[AgentCheck("agent-1", True, num_used_blocks=3, num_reserved_blocks=1)])
    data = report_dict([result, DrillResult(BUILTIN["baseline"])])
    assert (data["requests_hanging"], data["requests_lost"], data["blocks_leaked"]) == (2, 1, 4)
    assert data["scenarios"][0]["hanging"] == 2 and data["scenarios"][1]["hanging"] is None


@pytest.mark.parametrize("split", [1, 7, 1000])
async def test_a_streamed_answer_holding_unicode_line_breaks_is_read_whole(split: int) -> None:
    # SSE lines end at CR LF, LF or CR only: a token's text may hold U+0085 or U+2028 as they are
    # (two bytes of a sim engine's random output can be U+0085), and the answer must still be read
    text = "a\u0085b\u2028c"
    chunks = [{"id": "cmpl-1", "choices": [{"index": 0, "text": text, "finish_reason": None}]},
              {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
              {"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": 2}}]
    body = "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    raw = body.encode()

    def respond(request: httpx.Request) -> httpx.Response:
        parts = [raw[i:i + split] for i in range(0, len(raw), split)]  # the body in pieces of split bytes
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Chunks(parts))

    load = LoadGenerator(LoadSpec(output_tokens=2), "http://drill.test", "sim:tiny-test", lambda: 0.0, None)
    await load._http.aclose()
    load._http = httpx.AsyncClient(base_url="http://drill.test", transport=httpx.MockTransport(respond))
    record = RequestRecord(0, 0.0, True, False, -1)
    try:
        await load._send(record, "river stone")
    finally:
        await load.close()
    assert (record.outcome, record.text, record.request_id) == (Outcome.OK, text, "cmpl-1"), record.detail


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part

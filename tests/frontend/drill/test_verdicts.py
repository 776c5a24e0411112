from __future__ import annotations

import random

import pytest

from agents.engines.sim import SimEngine
from frontend.detokenize import IncrementalDetokenizer
from frontend.drill.greedy import GreedyText, RecordedText, SimTokens
from frontend.drill.load import LoadGenerator, Outcome, RequestRecord
from frontend.drill.report import report_dict, verdict_counts
from frontend.drill.runner import DrillResult
from frontend.drill.scenario import BUILTIN, LoadSpec
from frontend.drill.verdicts import LogCheck, Verdict, greedy_verdict, judge
from schemas import SamplingParams


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

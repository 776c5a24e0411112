from __future__ import annotations

import pytest

from frontend.drill.scenario import BUILTIN
from frontend.drill.verdicts import LogCheck, Verdict, judge


def _abort_verdict(abort_reasons: dict[str, int]) -> Verdict:
    log = LogCheck(num_migrations=sum(abort_reasons.values()), aborted=sum(abort_reasons.values()),
                   abort_reasons=abort_reasons)
    verdicts = judge(BUILTIN["kv-blackhole"], [], [], [], log, recovered=True, num_rescues=0.0,
                     num_preemptions=0, greedy_checked=False)
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

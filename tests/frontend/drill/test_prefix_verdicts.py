"""The prefix-cache verdicts of ``scheduler-kill-cached``: a scheduler whose recorded prefix index
differs from the fold of the cache events fails, a takeover not compared is not checked, a hit rate
that drops after the fault fails, answers without cached tokens leave it not checked; and the
scenario's load shares a prompt prefix."""

from __future__ import annotations

import pytest

from frontend.drill.load import LoadGenerator, Outcome, RequestRecord
from frontend.drill.scenario import BUILTIN, ScenarioError, validate
from frontend.drill.verdicts import (
    PrefixCheck,
    compare_prefix_views,
    hit_rate,
    hit_rate_verdict,
    prefix_index_verdict,
)
from schemas.block_hash import block_hashes
from schemas.decisions import Dispatched
from schemas.kv_events import KVCacheEvents

BLOCK = 4
SHARED = block_hashes(list(range(12)), BLOCK)  # 3 blocks every prompt starts with
CHAIN_A = block_hashes([*range(12), 50, 51, 52, 53], BLOCK)  # the shared 3 and one of its own
CHAIN_B = block_hashes([*range(12), 60, 61, 62, 63], BLOCK)


def _batch(instance: str, seq: int, stored: list[int], *, full: bool = False) -> KVCacheEvents:
    return KVCacheEvents(
        instance_id=instance, incarnation="i1", seq=seq, block_size=BLOCK, stored=tuple(stored), full=full
    )


#: (kv stream seq, batch): agent-0 caches the shared prefix and A's block; agent-1 the shared prefix
BATCHES = [
    (1, _batch("agent-0", 0, [], full=True)),
    (2, _batch("agent-1", 0, [], full=True)),
    (3, _batch("agent-0", 1, [*SHARED, CHAIN_A[3]])),
    (4, _batch("agent-1", 1, SHARED[:2])),
]


def _dispatched(request_id: str, epoch: int, kv_seq: int, cached: dict[str, int]) -> Dispatched:
    return Dispatched(
        epoch=epoch,
        request_id=request_id,
        instance_id="agent-0",
        policy="prefix",
        num_prompt_tokens=16,
        num_chain_blocks=4,
        cached_blocks=tuple(sorted(cached.items())),
        kv_seq=kv_seq,
    )


def test_views_equal_to_the_fold_at_their_kv_seq_pass_in_both_epochs() -> None:
    check = PrefixCheck()
    dispatches = [
        (10, _dispatched("a", 1, 2, {})),  # nothing cached yet at kv seq 2
        (11, _dispatched("b", 1, 3, {"agent-0": 3})),
        (20, _dispatched("a2", 2, 4, {"agent-0": 4, "agent-1": 2})),  # the standby's, after the takeover
    ]
    compare_prefix_views(check, dispatches, BATCHES, {"a": CHAIN_A, "b": CHAIN_B, "a2": CHAIN_A})
    assert check.num_mismatches == 0
    assert check.compared == {1: 2, 2: 1}
    verdict = prefix_index_verdict(check)
    assert verdict.passed and verdict.checked


def test_a_standby_whose_index_lacks_what_the_events_hold_fails() -> None:
    check = PrefixCheck()
    dispatches = [
        (11, _dispatched("b", 1, 3, {"agent-0": 3})),
        (20, _dispatched("a2", 2, 4, {"agent-1": 2})),  # agent-0's blocks lost in the takeover
    ]
    compare_prefix_views(check, dispatches, BATCHES, {"b": CHAIN_B, "a2": CHAIN_A})
    verdict = prefix_index_verdict(check)
    assert verdict.failed
    assert "a2" in verdict.detail and "epoch 2" in verdict.detail


def test_only_one_epoch_compared_is_not_checked_and_an_unknown_chain_is_counted() -> None:
    check = PrefixCheck()
    compare_prefix_views(
        check,
        [(11, _dispatched("b", 1, 3, {"agent-0": 3})), (12, _dispatched("gone", 2, 3, {}))],
        BATCHES,
        {"b": CHAIN_B},
    )
    assert check.no_chain == 1
    verdict = prefix_index_verdict(check)
    assert not verdict.checked and not verdict.failed
    assert prefix_index_verdict(PrefixCheck(error="StreamNotFound: drill_kv")).status == "not checked"


def _record(index: int, sent: float, prompt: int | None, cached: int | None) -> RequestRecord:
    record = RequestRecord(index, sent, True, False, -1, outcome=Outcome.OK, ended_at=sent + 1.0)
    record.prompt_tokens, record.cached_tokens = prompt, cached
    return record


def test_the_hit_rate_must_hold_after_the_fault() -> None:
    before = [_record(0, 1.0, 100, 90), _record(1, 2.0, 100, 80)]
    held = [*before, _record(2, 9.0, 100, 85)]
    rate, answers = hit_rate(before)
    assert rate == pytest.approx(0.85) and answers == 2
    assert hit_rate_verdict(held, 4.0, 8.0, 0.1).passed
    dropped = [*before, _record(2, 9.0, 100, 60)]
    verdict = hit_rate_verdict(dropped, 4.0, 8.0, 0.1)
    assert verdict.failed and "60.0%" in verdict.detail and "85.0%" in verdict.detail
    silent = [_record(0, 1.0, 100, None), _record(2, 9.0, 100, None)]
    assert hit_rate_verdict(silent, 4.0, 8.0, 0.1).status == "not checked"


def test_the_scenario_shares_a_prefix_runs_a_standby_and_checks_the_index() -> None:
    scenario = BUILTIN["scheduler-kill-cached"]
    assert scenario.cluster.standby_scheduler and scenario.verdicts.expect_prefix_index
    assert scenario.fault.restart_after_s is None  # the standby, not a restart, takes over
    load = LoadGenerator(scenario.load, "http://127.0.0.1:1", "tiny", lambda: 0.0, None)
    assert load.prefix and all(p.startswith(load.prefix) for p in load.greedy_prompts)
    assert len(load.prefix.split()) == scenario.load.prefix_words
    plain = LoadGenerator(BUILTIN["baseline"].load, "http://127.0.0.1:1", "tiny", lambda: 0.0, None)
    assert plain.prefix == ""
    with pytest.raises(ScenarioError, match=r"standby_scheduler needs cluster\.scheduler"):
        validate({"name": "x", "cluster": {"scheduler": False, "standby_scheduler": True}}, "x.toml")


def test_only_a_scenario_that_expects_the_prefix_index_is_judged_on_it() -> None:
    from frontend.drill.verdicts import LogCheck, judge

    names = {
        "scheduler's prefix index equals the cache events' fold",
        "prefix-cache hit rate held after the fault",
    }
    for name, expected in (("scheduler-kill-cached", names), ("scheduler-kill", set())):
        verdicts = judge(BUILTIN[name], [], [], [], LogCheck(), recovered=True, num_rescues=0.0,
                         num_preemptions=0, greedy_method=None)  # fmt: skip
        assert {v.name for v in verdicts} & names == expected

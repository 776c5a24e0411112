"""The dispatch rules a user picks from, and the superseded ones a recorded log may still carry.

``shoal scheduler --policy`` and ``shoal simulate --dispatch`` offer shoal's default, its cache-aware
cost model, the paper's rule, the two comparison baselines and the KV-aware routers of Dynamo and
llm-d, and refuse a superseded rule. A log recorded under a
superseded rule still replays: ``shoal replay`` recomputes each decision under the rule recorded
with it, whatever ``--policy`` the replay runs with.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from frontend.cli import cli
from scheduler.cluster_state import initial_state
from scheduler.config import (
    DISPATCH_MENU,
    SUPERSEDED_DISPATCH,
    DispatchPolicy,
    PolicyConfig,
    decode_policy,
    encode_policy,
)
from scheduler.fold import evolve
from scheduler.logfile import LogEntry, RecordedLog, write_log
from scheduler.recompute import Cursor, dispatch_decision
from schemas import Codec, Subjects
from schemas.decisions import SchedulerTick
from schemas.envelope import Body
from schemas.load import LoadReport, PriorityLoad
from schemas.position import Position
from schemas.requests import RequestArrived
from schemas.rpc import DispatchRequest
from tests.scheduler.events import joined

PREFIX = "menu"
MENU = ["prefill_ahead", "predicted_ttft", "freeness", "infaas++", "round_robin", "kv", "prefix"]
SUPERSEDED = ["freeness_after_admit", "queue_aware", "blocks_ahead", "blocks_ahead_growth",
              "prefill_ahead_saturated"]


def test_the_menu_is_the_default_the_paper_s_rule_and_the_baselines() -> None:
    assert [p.value for p in DISPATCH_MENU] == MENU
    assert sorted(p.value for p in SUPERSEDED_DISPATCH) == sorted(SUPERSEDED)
    assert all(p.superseded for p in SUPERSEDED_DISPATCH) and not any(p.superseded for p in DISPATCH_MENU)


@pytest.mark.parametrize("command", [["scheduler"], ["simulate"]])
def test_help_offers_the_menu_and_no_superseded_rule_or_history(command: list[str]) -> None:
    result = CliRunner().invoke(cli, [*command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "[prefill_ahead|predicted_ttft|freeness|infaas++|round_robin|kv|prefix]" in result.output
    for name in SUPERSEDED:
        assert name not in result.output
    assert not re.search(r"\brounds? \d|\b20\d\d-\d\d", result.output)  # behaviour, not history
    for option in ("priority-preemption", "prompts-by-priority", "high-reserve-blocks"):
        assert option not in result.output


def test_a_superseded_rule_is_refused_on_the_command_line() -> None:
    result = CliRunner().invoke(cli, ["scheduler", "--policy", "blocks_ahead"])
    assert result.exit_code == 2 and "blocks_ahead" in result.output
    result = CliRunner().invoke(cli, ["simulate", "--dispatch", "queue_aware", "--quiet"])
    assert result.exit_code == 2
    result = CliRunner().invoke(cli, ["simulate", "--priority-preemption", "--quiet"])
    assert result.exit_code == 2 and "No such option" in result.output


def _report(instance_id: str, used: int, prefill_blocks: int = 0) -> LoadReport:
    return LoadReport(
        instance_id=instance_id, seq=1, num_total_blocks=400, num_free_blocks=400 - used,
        num_reserved_blocks=0, running=(PriorityLoad(priority=0, num_running=1, num_blocks=used),),
        head_of_line_demand=0, num_waiting=0, batch_size=1, freeness=float(400 - used),
        virtual_usage=float(used), num_accepted=1, prefill_blocks=prefill_blocks,
    )


def _recorded_log(
    policy: DispatchPolicy, cached_blocks: tuple[tuple[str, int], ...] = ()
) -> tuple[RecordedLog, str]:
    """Two instances: ``prefilling`` holds 100 blocks and prefills a 90-block prompt in its step in
    flight; ``decoding`` holds 200 and prefills nothing. A scheduler under ``policy`` took over and
    placed one request of 4 blocks, of which the prefix index said ``cached_blocks``. Returns the
    log and where the request went."""
    subjects = Subjects(PREFIX)
    config = PolicyConfig(dispatch_policy=policy)
    events: list[tuple[str, Body]] = [
        (subjects.instance("prefilling"), joined("prefilling", 400)),
        (subjects.instance("decoding"), joined("decoding", 400)),
        (subjects.sched("tick"), SchedulerTick(epoch=1, takeover=True, policy=encode_policy(config))),
        (subjects.req("r"), RequestArrived(request_id="r", num_prompt_tokens=64, max_tokens=16)),
    ]
    loads: list[tuple[str, Body]] = [
        (subjects.load("prefilling"), _report("prefilling", 100, prefill_blocks=90)),
        (subjects.load("decoding"), _report("decoding", 200)),
    ]
    view = initial_state()
    for seq, (_, body) in enumerate(events, 1):
        view = evolve(view, Position(f"{PREFIX}_events", seq), body)
    for seq, (_, body) in enumerate(loads, 1):
        view = evolve(view, Position(f"{PREFIX}_loads", seq), body)
    request = DispatchRequest(request_id="r", num_prompt_tokens=64, block_size=16, block_hashes=(1, 2, 3, 4))
    decision = dispatch_decision(
        view, request, epoch=1, cursor=Cursor(len(events), len(loads)), policy=config,
        cached_blocks=cached_blocks, kv_seq=7 if cached_blocks else 0,
    )
    assert decision is not None and decision.policy == policy.value
    events.append((subjects.sched("dispatch"), decision))
    codec = Codec(producer="test")

    def entries(items: list[tuple[str, Body]]) -> list[LogEntry]:
        return [LogEntry(seq, 100.0 + seq, subject, codec.encode(body, time=100.0 + seq))
                for seq, (subject, body) in enumerate(items, 1)]

    return RecordedLog(PREFIX, entries(events), entries(loads)), decision.instance_id


@pytest.mark.parametrize(
    ("policy", "chosen", "cached"),
    [
        # the superseded rules that do not count the prefill in flight start the request where it
        # waits behind it; shoal's default does not
        ("freeness_after_admit", "prefilling", ()),
        ("queue_aware", "prefilling", ()),
        ("blocks_ahead", "prefilling", ()),
        ("blocks_ahead_growth", "prefilling", ()),
        ("prefill_ahead_saturated", "decoding", ()),
        ("prefill_ahead", "decoding", ()),
        # the cache-aware rules, with 3 of the request's 4 blocks cached on ``prefilling``: Dynamo's cost
        # (90 + 1 prefill blocks + 104 decode blocks against 4 + 204) and llm-d's scores (prefix share
        # and KV utilisation) take it there; shoal's predicted TTFT (90 in flight + 1 against 4) does not
        ("kv", "prefilling", (("prefilling", 3),)),
        ("prefix", "prefilling", (("prefilling", 3),)),
        ("predicted_ttft", "decoding", (("prefilling", 3),)),
        ("kv", "prefilling", ()),
        ("prefix", "prefilling", ()),
        ("predicted_ttft", "decoding", ()),
    ],
)
def test_a_log_recorded_under_any_rule_replays_its_decisions_exactly(
    tmp_path: Path, policy: str, chosen: str, cached: tuple[tuple[str, int], ...]
) -> None:
    log, placed = _recorded_log(DispatchPolicy(policy), cached)
    assert placed == chosen
    recorded = encode_policy(PolicyConfig(dispatch_policy=DispatchPolicy(policy)))
    assert decode_policy(recorded).dispatch_policy is DispatchPolicy(policy)
    path = tmp_path / "old.log"
    write_log(path, log)
    result = CliRunner().invoke(cli, ["replay", "--file", str(path), "--policy", "prefill_ahead", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["mismatches"] == [] and report["decisions_equal"] == report["decisions_recomputed"] == 1
    assert report["policies"]["1"]["dispatch_policy"] == policy
    [row] = report["dispatches"]
    assert (row["policy"], row["instance_id"], row["recomputed_equal"]) == (policy, chosen, True)

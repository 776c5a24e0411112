"""``shoal bench prefix``'s pure parts: the sessions (each turn's prompt extends the last one's), what
it reads from the answers and the agents' ``/metrics``, how it sums up a side, and the command lines
it runs (the runs themselves need the servers)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from frontend.bench_prefix_report import (
    CacheCounters,
    combine_rounds,
    compare_prediction,
    paired_ratios,
    paired_to_reference,
    parse_cache_counters,
)
from frontend.bench_prefix_runner import Sides, policy_sides, up_command
from frontend.bench_prefix_sessions import (
    TurnRecord,
    Workload,
    build_sessions,
    cached_tokens_of,
    chat_messages,
    first_token_chunk,
    summarize,
)
from frontend.bench_prefix_sim import SIM_POLICIES, simulate_command
from frontend.bench_prefix_vllm import Repetition, repetition_client_command, vllm_serve_command
from frontend.bench_vllm_serve import EngineOptions


def test_sessions_share_their_group_system_prompt_and_every_round_has_its_own() -> None:
    workload = Workload(groups=2, sessions_per_group=3, turns=4)
    first = build_sessions(workload, 0)
    assert first == build_sessions(workload, 0)  # both sides of a round send the same sessions
    assert len(first) == 6 and all(len(s.users) == 4 and len(s.think_s) == 3 for s in first)
    systems = {s.group: {t.system for t in first if t.group == s.group} for s in first}
    assert all(len(texts) == 1 for texts in systems.values()) and systems[0] != systems[1]
    assert len({s.users for s in first}) == 6
    later = build_sessions(workload, 1)
    assert not {s.system for s in first} & {s.system for s in later}  # a warm cache serves no later round
    assert all(0 <= s.start_s <= workload.ramp_s and max(s.think_s) <= 3 * workload.think_s for s in first)


def test_each_turn_prompt_is_the_conversation_so_far_and_a_new_question() -> None:
    session = build_sessions(Workload(turns=3), 0)[0]
    one = chat_messages(session, [])
    two = chat_messages(session, ["first answer"])
    three = chat_messages(session, ["first answer", "second answer"])
    assert [m["role"] for m in one] == ["system", "user"]
    assert two[: len(one)] == one and two[len(one)] == {"role": "assistant", "content": "first answer"}
    assert three[: len(two)] == two and three[-1] == {"role": "user", "content": session.users[2]}
    with pytest.raises(ValueError, match="3 turns"):
        chat_messages(session, ["a", "b", "c"])
    with pytest.raises(ValueError):
        Workload(turns=0)


def test_cached_tokens_come_from_the_prompt_tokens_details_of_usage() -> None:
    assert cached_tokens_of({"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 64}}) == 64
    assert cached_tokens_of({"prompt_tokens": 90}) is None
    assert cached_tokens_of({"prompt_tokens_details": None}) is None
    assert cached_tokens_of({"prompt_tokens_details": {"cached_tokens": True}}) is None


def test_the_first_token_is_not_the_role_announcement() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    token = {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]}
    last = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3}}
    assert [first_token_chunk(c) for c in (role, token, last, usage)] == [False, True, True, False]


def _turn(turn: int, ttft_ms: float, prompt: int, cached: int | None, error: str = "") -> TurnRecord:
    return TurnRecord("s", 0, turn, 0.0, ttft_ms / 1000, 1.0, prompt, cached, 8, error)


def test_a_side_sums_up_ttft_by_turn_and_the_hit_rate_of_answered_turns() -> None:
    records = [
        _turn(0, 400, 100, 0),
        _turn(1, 100, 150, 96),
        _turn(2, 120, 200, 144),
        _turn(3, 0, 0, 0, "HTTP 503"),
    ]
    summary = summarize(records)
    assert summary["requests"] == 4 and summary["errors"] == 1
    assert summary["ttft_p50_first_turn_ms"] == pytest.approx(400)
    assert summary["ttft_p50_later_turns_ms"] in (pytest.approx(100), pytest.approx(120))
    assert summary["hit_rate"] == pytest.approx(240 / 450)
    assert summary["ttft_p50_by_turn_ms"] == {
        "1": pytest.approx(400),
        "2": pytest.approx(100),
        "3": pytest.approx(120),
    }
    silent = summarize([_turn(0, 400, 100, None), _turn(1, 100, 150, 96)])
    assert silent["hit_rate"] is None and silent["cached_tokens"] is None  # not a rate of 0
    rounds = combine_rounds([summary, {**summary, "ttft_p50_ms": 1000.0, "hit_rate": 0.2}, summary])
    assert rounds["ttft_p50_ms"] == summary["ttft_p50_ms"] and rounds["requests"] == 12


def test_the_agents_counters_add_up_over_labels_without_their_timestamps() -> None:
    page = "\n".join(
        [
            "# HELP shoal_prefix_cache_queries_total Prompt tokens looked up",
            "# TYPE shoal_prefix_cache_queries_total counter",
            'shoal_prefix_cache_queries_total{instance="agent-0"} 300.0',
            'shoal_prefix_cache_queries_total{instance="agent-1"} 100.0',
            'shoal_prefix_cache_queries_created{instance="agent-0"} 1.7e9',
            'shoal_prefix_cache_hits_total{instance="agent-0"} 150.0',
            "shoal_prefix_cache_blocks 12",
        ]
    )
    counters = parse_cache_counters(page)
    assert counters == CacheCounters(400.0, 150.0) and counters.hit_rate == pytest.approx(0.375)
    assert parse_cache_counters("shoal_agent_kv_blocks 64\n") is None
    vllm = parse_cache_counters("vllm_prefix_cache_queries_total 64.0\nvllm_prefix_cache_hits_total 32.0\n")
    assert vllm is not None and (vllm - CacheCounters(32.0, 32.0)).hit_rate == 0.0


def test_paired_ratios_are_off_over_on_within_each_round() -> None:
    on = [
        {"ttft_p50_ms": 100.0, "ttft_p99_ms": 400.0, "ttft_p50_later_turns_ms": 50.0},
        {"ttft_p50_ms": 200.0, "ttft_p99_ms": 800.0, "ttft_p50_later_turns_ms": 100.0},
    ]
    off = [
        {"ttft_p50_ms": 500.0, "ttft_p99_ms": 800.0, "ttft_p50_later_turns_ms": 500.0},
        {"ttft_p50_ms": 1000.0, "ttft_p99_ms": 1600.0, "ttft_p50_later_turns_ms": 1000.0},
    ]
    paired = paired_ratios(on, off)
    assert paired["ttft_p50_ratios"] == [5.0, 5.0] and paired["ttft_p99_ratio"] == 2.0
    assert paired["ttft_p50_later_turns_ratio"] == 10.0
    with pytest.raises(ValueError, match="rounds"):
        paired_ratios(on, off[:1])


def test_only_the_side_without_the_cache_is_told_no_prefix_cache(tmp_path: Path) -> None:
    on = up_command("torch", "small", 2, 8001, tmp_path, prefix_cache=True)
    off = up_command("torch", "small", 2, 8002, tmp_path, prefix_cache=False)
    assert "--no-prefix-cache" not in on and off[-1] == "--no-prefix-cache"
    for command in (on, off):
        assert command[command.index("up") + 1 :][:6] == [
            "--engine",
            "torch",
            "--model",
            "small",
            "--instances",
            "2",
        ]


def test_each_policy_gets_its_own_cluster_and_every_round_another_goes_first(tmp_path: Path) -> None:
    sides = policy_sides("prefill_ahead, infaas++,round_robin,infaas++")
    assert sides.names == ("prefill_ahead", "infaas++", "round_robin")  # in order, no repeats
    command = sides.command("infaas++", "torch", "small", 4, 8001, tmp_path, 1)
    assert command[-2:] == ["--policy", "infaas++"] and "--no-prefix-cache" not in command
    orders = [sides.order(r) for r in range(3)]
    assert [o[0] for o in orders] == ["prefill_ahead", "infaas++", "round_robin"]
    assert all(sorted(o) == sorted(sides.names) for o in orders)
    assert Sides(("on", "off")).order(1) == ("off", "on")  # two sides alternate
    with pytest.raises(click.BadParameter, match="unknown policies"):
        policy_sides("prefill_ahead,nearest")


def test_policies_are_paired_with_the_first_and_set_beside_the_simulator() -> None:
    runs = {
        "a": [{"ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0, "ttft_p50_later_turns_ms": 50.0}] * 3,
        "b": [{"ttft_p50_ms": 150.0, "ttft_p99_ms": 100.0, "ttft_p50_later_turns_ms": 100.0}] * 3,
    }
    paired = paired_to_reference(runs, ["a", "b"])
    assert list(paired) == ["b"] and paired["b"]["ttft_p50_ratio"] == 1.5
    live = {"a": {"pooled": {"ttft_p50_ms": 200.0, "ttft_p99_ms": 400.0, "hit_rate": 0.8}}}
    predicted = {"a": {"ttft_p50_ms": 180.0, "ttft_p99_ms": 500.0, "hit_rate": 0.8}}
    row = compare_prediction(live, predicted)["a"]
    assert row["ttft_p50_predicted_over_live"] == pytest.approx(0.9)
    assert row["live_ttft_p50_ms"] == 200.0 and row["predicted_ttft_p99_ms"] == 500.0


def test_the_simulator_runs_each_live_policy_as_its_own_setup(tmp_path: Path) -> None:
    def argv(policy: str) -> list[str]:
        command = simulate_command(
            policy, tmp_path / "t.jsonl.gz", tmp_path / "p.json", 4, tmp_path / "o.json"
        )
        return command[command.index("simulate") :]

    shoal = argv("prefill_ahead")
    assert shoal[shoal.index("--policy") + 1] == "shoal" and "--dispatch" not in shoal
    kv = argv("kv")
    assert kv[kv.index("--policy") + 1] == "kv" and "--dispatch" not in kv
    cost = argv("predicted_ttft")
    assert cost[cost.index("--policy") + 1] == "shoal-cost"
    assert argv("infaas++")[argv("infaas++").index("--policy") + 1] == "infaas"
    assert kv[kv.index("--instances") + 1] == "4" and "--prefix-cache" in kv and "--cores" not in kv
    shared = simulate_command(
        "kv", tmp_path / "t.jsonl", tmp_path / "p.json", 4, tmp_path / "o.json", cores=2
    )
    assert shared[-2:] == ["--cores", "2"]
    assert set(SIM_POLICIES) >= {"prefill_ahead", "infaas++", "round_robin", "kv", "prefix"}


def test_the_vllm_mode_runs_prefix_repetition_against_a_caching_vllm(tmp_path: Path) -> None:
    options = EngineOptions(
        Path("/ckpt"), max_model_len=2048, block_size=32, kv_cache_bytes=2**30, dtype="auto"
    )
    assert "--enable-prefix-caching" in vllm_serve_command(options, 8000)
    client = repetition_client_command(
        "http://h:1", options, Repetition(num_prompts=8, num_prefixes=2), tmp_path, "r.json"
    )
    assert client[client.index("--dataset-name") + 1] == "prefix_repetition"
    assert client[client.index("--prefix-repetition-num-prefixes") + 1] == "2"
    assert client[client.index("--num-prompts") + 1] == "8"


@pytest.mark.e2e
def test_bench_prefix_serves_cached_tokens_only_with_the_cache_on(tmp_path: Path) -> None:
    """Two one-agent ``shoal up`` clusters of torch ``tiny``: the second session of a group finds the
    system prompt cached with the cache on, and nothing is ever cached with ``--no-prefix-cache``."""
    import json
    import subprocess
    import sys

    out = tmp_path / "prefix.json"
    options = (
        "--model tiny --instances 1 --rounds 1 --groups 1 --sessions 2 --turns 2 --system-words 30 "
        "--user-words 4 --answer-tokens 4 --think 0.05 --ready-timeout 120 --run-timeout 120"
    )
    command = [sys.executable, "-c", "from frontend.cli import main; main()", "bench", "prefix"]
    command += [*options.split(), "--json", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert results["on"]["errors"] == 0 and results["off"]["errors"] == 0, finished.stderr[-2000:]
    assert results["on"]["requests"] == results["off"]["requests"] == 4
    assert results["on"]["hit_rate_source"] == "usage"
    assert results["on"]["hit_rate"] > 0.0 and results["off"]["hit_rate"] == 0.0


@pytest.mark.e2e
def test_bench_prefix_policies_runs_each_policy_and_predicts_it(tmp_path: Path) -> None:
    """Two one-agent clusters of torch ``tiny``, one per policy: both serve every turn with cached
    tokens on the later turns, the sessions trace is written, and shoal simulate predicts both."""
    import json
    import subprocess
    import sys

    out, trace = tmp_path / "policies.json", tmp_path / "trace.jsonl.gz"
    options = (
        "--policies prefill_ahead,round_robin --model tiny --instances 1 --rounds 1 --groups 1 --sessions 2 "
        "--turns 2 --system-words 30 --user-words 4 --answer-tokens 4 --think 0.05 --ready-timeout 120 "
        "--run-timeout 120"
    )
    command = [sys.executable, "-c", "from frontend.cli import main; main()", "bench", "prefix"]
    command += [*options.split(), "--json", str(out), "--trace-out", str(trace), "--log-dir", str(tmp_path)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    document = json.loads(out.read_text())
    for policy in ("prefill_ahead", "round_robin"):
        assert document["results"][policy]["errors"] == 0, finished.stdout[-2000:]
        assert document["results"][policy]["hit_rate"] > 0.0
        # one agent's steps measured alone, beside busy neighbours, and alone on the machine's cores shared
        for profile in ("alone", "shared", f"alone-on-{document['prediction']['cores']}-cores"):
            assert document["prediction"]["predicted"][profile][policy]["requests"] == 4
    assert trace.is_file() and document["results"]["prompts_alike"] == 1.0

"""Recorded chat sessions (``shoal bench prefix --policies``' trace) replayed by the simulator: closed
loop (a later turn waits for the answer before it), the live prompts' shared blocks found in the
simulated caches, and bad rows rejected with their line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from agents.engines.profile import load_profile
from frontend.bench_prefix_sim import number_blocks, write_trace
from frontend.cli import cli
from scheduler.sim.config import SimConfig, policy_setup
from scheduler.sim.session_trace import is_session_trace, read_session_trace, session_trace_workload
from scheduler.sim.simulator import Simulator

A10 = load_profile("llama-7b-a10")  # 16-token blocks


def _turn(session: str, turn: int, chain: list[int], length: int, **more: Any) -> dict[str, Any]:
    return {
        "round": 0,
        "session": session,
        "turn": turn,
        "start_s": more.get("start_s", 0.0),
        "think_s": more.get("think_s", 0.0),
        "input_length": length,
        "output_length": more.get("output_length", 8),
        "block_tokens": 16,
        "chain": chain,
    }


def _two_sessions(tmp_path: Path) -> Path:
    """Two sessions of one group: a 64-token system prompt (4 blocks) then their own; each second turn
    repeats its first turn's blocks and adds two."""
    system = [9001, 9002, 9003, 9004]
    turns = [
        _turn("a", 0, [*system, 11], 90, start_s=0.0),
        _turn("b", 0, [*system, 21], 90, start_s=0.5),
        _turn("a", 1, [*system, 11, 12, 13], 120, think_s=2.0),
        _turn("b", 1, [*system, 21, 22, 23], 120, think_s=2.0),
    ]
    path = tmp_path / "trace.jsonl.gz"
    write_trace(turns, path)
    return path


def test_block_hashes_become_short_ids_equal_where_the_hashes_are() -> None:
    assert number_blocks([[50, 60, 70], [50, 60, 80]]) == [[0, 1, 2], [0, 1, 3]]


def test_a_recorded_session_replays_closed_loop_and_finds_its_own_and_its_group_blocks(
    tmp_path: Path,
) -> None:
    path = _two_sessions(tmp_path)
    assert is_session_trace(path) and not is_session_trace(tmp_path / "missing.jsonl")
    turns = read_session_trace(path)
    assert [t.hash_ids[:4] for t in turns] == [(0, 1, 2, 3)] * 4  # the shared system prompt
    workload = session_trace_workload(turns)
    later = [r for r in workload.requests if r.follows]
    assert len(later) == 2 and all(r.context_tokens == 0 and r.think_s == 2.0 for r in later)
    config = SimConfig(setup=policy_setup("rr"), profile=A10, num_instances=1, prefix_cache=True)
    simulator = Simulator(config, workload)
    result = simulator.run()
    assert result.num_requests == 4 and result.rejected_share == 0.0
    records = simulator.records
    first, second = records["r0:a.00"], records["r0:a.01"]
    assert second.arrival_s == pytest.approx(first.finish_s + 2.0)  # sent after the answer and the think time
    # on one instance: b's first turn finds the 4 system blocks, each second turn its first turn's 5
    assert result.prefix_cache_hit_rate == pytest.approx((64 + 80 + 80) / (90 + 90 + 120 + 120))


def test_shoal_simulate_replays_a_sessions_trace(tmp_path: Path) -> None:
    path = _two_sessions(tmp_path)
    out = tmp_path / "sim.json"
    options = ["--trace", str(path), "--profile", "llama-7b-a10", "--instances", "2", "--quiet"]
    result = CliRunner().invoke(cli, ["simulate", *options, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "sessions trace trace.jsonl.gz: 2 sessions, 4 turns" in result.output
    assert json.loads(out.read_text())["num_requests"] == 4
    refused = CliRunner().invoke(cli, ["simulate", *options, "--rate", "3"])
    assert refused.exit_code != 0 and "closed-loop" in refused.output


def test_a_turn_out_of_order_is_an_error_naming_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    write_trace([_turn("a", 0, [1], 20), _turn("a", 2, [1, 2], 40)], path)
    with pytest.raises(ValueError, match=r"line 2: turn 2 of session a follows turn 0"):
        read_session_trace(path)
    write_trace([_turn("a", 0, [1, 2, 3], 20)], path)
    with pytest.raises(ValueError, match="line 1: hash_ids cover more"):
        read_session_trace(path)


def test_instances_sharing_one_core_take_turns_computing(tmp_path: Path) -> None:
    """Two sessions opening at once on two instances: with a core each their first turns prefill side by
    side; sharing one core, each step of the two takes twice as long."""
    turns = [_turn("a", 0, [1, 2, 3, 4], 1000), _turn("b", 0, [5, 6, 7, 8], 1000)]
    path = tmp_path / "two.jsonl"
    write_trace(turns, path)
    workload = session_trace_workload(read_session_trace(path))

    def ttft(cores: int | None) -> float:
        config = SimConfig(
            setup=policy_setup("rr"), profile=A10, num_instances=2, prefix_cache=True, cores=cores
        )
        return Simulator(config, workload).run().ttft_p50_s

    assert ttft(2) == pytest.approx(ttft(None))
    assert ttft(1) == pytest.approx(2 * ttft(None), rel=0.05)
    with pytest.raises(ValueError, match="cores"):
        SimConfig(cores=0)

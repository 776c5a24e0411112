"""Prefix caching in the simulator: shared prompt tokens from Mooncake hash ids and chat sessions,
the hit rates a run reports, and the cost of a cache hit in the sim engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from agents.engines.profile import load_profile
from agents.engines.sim import SimEngine
from frontend.cli import cli
from scheduler.sim.config import SimConfig, policy_setup
from scheduler.sim.prompts import TRACE_BLOCK_TOKENS, prompt_token_ids, trace_block_segments
from scheduler.sim.sessions import SessionSpec, session_workload
from scheduler.sim.simulator import Simulator
from scheduler.sim.workload import load_trace
from schemas import SamplingParams
from schemas.block_hash import block_hashes

A10 = load_profile("llama-7b-a10")  # 16-token blocks


def _trace_prompt(request_id: str, hash_ids: list[int], input_length: int) -> list[int]:
    return prompt_token_ids(request_id, input_length, trace_block_segments(hash_ids), A10.vocab_size)


def test_equal_hash_ids_give_equal_token_blocks_and_the_last_block_is_cut_to_the_input_length() -> None:
    first = _trace_prompt("r0", [7, 8, 9], 1500)
    second = _trace_prompt("r1", [7, 8, 4], 1400)
    assert len(first) == 1500 and len(second) == 1400
    assert first[:1024] == second[:1024]  # hash ids 7 and 8: two equal 512-token blocks
    assert first[1024:1400] != second[1024:1400]
    assert all(0 <= t < A10.vocab_size for t in first)
    # the same hash id as a partial last block is the start of the same run of tokens
    assert _trace_prompt("r2", [7], 300) == first[:300]
    # at the engine's block size: the 64 blocks of 16 tokens in the shared 1,024 have equal hashes
    hashes_first, hashes_second = block_hashes(first, 16), block_hashes(second, 16)
    assert hashes_first[:64] == hashes_second[:64] and hashes_first[64] != hashes_second[64]
    # a prompt without hash ids, or past them, is its own
    assert _trace_prompt("r3", [], 600)[:512] != _trace_prompt("r4", [], 600)[:512]
    assert _trace_prompt("r5", [7], 600)[512:] != _trace_prompt("r6", [7], 600)[512:]


def _mooncake_file(folder: Path) -> Path:
    rows = [  # one instance serves them one after another: each finds what the earlier ones left
        {"timestamp": 0, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 2]},
        {"timestamp": 5000, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 3]},
        {"timestamp": 10000, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 2]},
        {"timestamp": 15000, "input_length": 800, "output_length": 4, "hash_ids": [5, 6]},
    ]
    path = folder / "conversations.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _simulate(args: list[str], out: Path) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["simulate", *args, "--json", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_a_trace_with_shared_hash_ids_hits_the_cache_and_no_prefix_cache_turns_it_off(tmp_path: Path) -> None:
    trace = _mooncake_file(tmp_path)
    args = ["--trace", str(trace), "--policy", "rr,infaas", "--instances", "1", "--requests", "4"]
    on = _simulate(args, tmp_path / "on.json")
    off = _simulate([*args, "--no-prefix-cache"], tmp_path / "off.json")
    # the second prompt finds hash ids 0 and 1 (1,024 tokens); the third all of its own but the
    # last token's block (1,488 of 1,500 at 16 tokens a block); the fourth nothing
    cached = 1024 + 1488
    for policy in ("rr", "infaas"):
        run = on[policy]
        assert run["prefix_cache"] is True and run["parameters"]["prefix_cache"] is True
        assert (run["cached_tokens"], run["prompt_tokens"]) == (cached, 3 * 1500 + 800)
        assert run["prefix_cache_hit_rate"] == pytest.approx(cached / 5300)
        assert run["prefix_cache_by_instance"]["i000"]["hit_rate"] == pytest.approx(cached / 5300)
        assert off[policy]["prefix_cache"] is False
        assert off[policy]["cached_tokens"] == 0 and off[policy]["prefix_cache_hit_rate"] == 0.0
        assert run["ttft_mean_s"] < off[policy]["ttft_mean_s"]  # the hits skip most of their prefill


def test_the_shipped_mooncake_trace_loads_with_its_blocks_and_credit() -> None:
    workload = load_trace("mooncake", num_requests=3)
    assert "Mooncake" in workload.credit and "FAST 2025" in workload.credit
    first = workload.requests[0]
    assert len(first.segments) == -(-first.num_prompt_tokens // TRACE_BLOCK_TOKENS)


def _session_spec(**overrides: Any) -> SessionSpec:
    fields: dict[str, Any] = dict(
        num_sessions=4,
        rate=0.5,
        turns=3,
        groups=2,
        system_tokens=256,
        user_tokens=64.0,
        answer_tokens=32.0,
        think_s=2.0,
        max_context_tokens=A10.max_model_len,
        seed=4,
    )
    fields.update(overrides)
    return SessionSpec(**fields)


def test_session_turns_extend_the_previous_prompt_with_its_answer_after_the_think_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts: dict[str, list[int]] = {}
    answers: dict[str, list[int]] = {}
    add_request, end_step = SimEngine.add_request, SimEngine.end_step

    def recording_add(self: SimEngine, request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> bool:
        prompts[request_id] = list(prompt)
        return add_request(self, request_id, prompt, *args, **kwargs)

    def recording_end(self: SimEngine, plan: Any, duration_s: float) -> Any:
        result = end_step(self, plan, duration_s)
        for output in result.outputs:
            answers.setdefault(output.request_id, []).extend(output.token_ids)
        return result

    monkeypatch.setattr(SimEngine, "add_request", recording_add)
    monkeypatch.setattr(SimEngine, "end_step", recording_end)
    workload = session_workload(_session_spec())
    config = SimConfig(setup=policy_setup("infaas"), profile=A10, num_instances=1, prefix_cache=True)
    sim = Simulator(config, workload)
    result = sim.run()
    assert result.num_finished == len(workload.requests) == 12
    for request in workload.requests:
        prompt = prompts[request.request_id]
        assert len(prompt) == request.num_prompt_tokens
        if not request.follows:
            continue
        before = prompts[request.follows] + answers[request.follows]
        assert prompt[: len(before)] == before and len(prompt) > len(before)
        record, previous = sim.records[request.request_id], sim.records[request.follows]
        assert record.arrival_s == pytest.approx(previous.finish_s + request.think_s)
        # on one instance the previous turn's prompt is still cached, and its answer but the last token
        assert record.num_cached_tokens >= (len(before) - 1) // 16 * 16
    system_prompts: dict[tuple[int, int], set[tuple[int, ...]]] = {}  # group's segment -> prompts' first 256
    for request in workload.requests:
        if not request.follows:
            system_prompts.setdefault(request.segments[0], set()).add(
                tuple(prompts[request.request_id][:256])
            )
    assert len(system_prompts) == 2 and all(len(firsts) == 1 for firsts in system_prompts.values())
    assert len({first for firsts in system_prompts.values() for first in firsts}) == 2
    assert 0.5 < result.prefix_cache_hit_rate < 1.0


def test_sessions_are_deterministic_for_a_seed() -> None:
    assert session_workload(_session_spec()) == session_workload(_session_spec())
    assert session_workload(_session_spec()) != session_workload(_session_spec(seed=5))
    short = session_workload(_session_spec(turns=20, max_context_tokens=800))
    assert max(r.num_prompt_tokens + r.num_output_tokens for r in short.requests[1:]) <= 800
    assert short.warnings  # sessions cut where the context would pass the limit


def test_simulate_sessions_from_the_command_line(tmp_path: Path) -> None:
    args = [
        "--sessions",
        "6",
        "--rate",
        "1",
        "--turns",
        "3",
        "--instances",
        "2",
        "--policy",
        "rr",
        "--system-tokens",
        "512",
        "--think-s",
        "1",
    ]
    run = _simulate(args, tmp_path / "sessions.json")
    assert run["num_finished"] == run["num_requests"] == 18
    assert run["prefix_cache_hit_rate"] > 0.3
    assert set(run["prefix_cache_by_instance"]) == {"i000", "i001"}
    result = CliRunner().invoke(cli, ["simulate", "--sessions", "2", "--rate", "1", "--mix", "S-S"])
    assert result.exit_code != 0 and "not several" in result.output


def test_a_cache_hit_pays_its_own_pass_and_its_attention_over_the_cached_prefix() -> None:
    engine = SimEngine("llama-3.1-8b-h100", prefix_cache=True)
    timing = engine.timing
    shared = list(range(1, 4097))
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request("a", shared, sampling)
    assert engine.step().duration_s == pytest.approx(timing.prefill_ms(4096) / 1000)
    engine.add_request("b", shared + list(range(5000, 5512)), sampling)
    step = engine.step()
    assert step.outputs[0].num_cached_tokens == 4096
    attention_ms = 2 * timing.attention_ms_per_token2 * 4096 * 512
    assert step.duration_s == pytest.approx((timing.prefill_ms(512) + attention_ms) / 1000)
    assert step.duration_s < timing.prefill_ms(4608) / 1000 / 4

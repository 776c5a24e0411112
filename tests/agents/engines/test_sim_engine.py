"""The sim engine: profiles, timing model, deterministic tokens, real time, and migration between two."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.engines import engine_class
from agents.engines.profile import (
    BUILTIN_PROFILES,
    PROFILES_DIR,
    DecodeTable,
    InvalidProfile,
    TimingModel,
    dump_profile,
    load_profile,
)
from agents.engines.protocol import (
    Engine,
    KVBuffer,
    MigrationError,
    RequestRejected,
    RequestStatus,
    StepResult,
)
from agents.engines.sim import SimEngine, sim_token_id
from schemas import SamplingParams

PROMPT = list(range(1, 23))  # 22 tokens: 6 blocks of 4 in the tiny profile


def run_alone(request_id: str, prompt: list[int], sampling: SamplingParams) -> list[int]:
    engine = SimEngine("tiny-test")
    engine.add_request(request_id, prompt, sampling)
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step().outputs for t in o.token_ids]
    return tokens


# ------------------------------------------------------------------ profiles


def test_default_profile_models_llama_7b_on_an_a10_as_in_the_paper() -> None:
    profile = load_profile("llama-7b-a10")
    assert (profile.num_blocks, profile.block_size) == (851, 16)
    assert profile.num_blocks * profile.block_size == 13_616
    assert profile.kv_bytes_per_block == 2 * 32 * 32 * 128 * 16 * 2  # K and V, fp16
    timing = TimingModel(profile)
    batch_one = timing.decode_ms(1, 300)
    assert 20 <= batch_one <= 30
    full_memory = timing.decode_ms(25, 13_616)
    assert 2.3 <= full_memory / batch_one <= 2.9
    assert timing.prefill_ms(2000) == pytest.approx(2 * timing.prefill_ms(1000), rel=0.15)
    assert "ESTIMATES" in profile.source and profile.estimated


def test_every_builtin_profile_loads_and_a_dumped_profile_reads_back(tmp_path: Path) -> None:
    for name in BUILTIN_PROFILES:
        profile = load_profile(name)
        assert profile.name == name
        path = tmp_path / f"{name}.json"
        dump_profile(profile, path)
        assert load_profile(path) == profile


def test_timing_tables_interpolate_and_extrapolate_linearly() -> None:
    profile = load_profile("tiny-test")  # decode 1 ms..3 ms over (1..16) x (0..256); prefill 0.5..3 ms
    timing = TimingModel(profile)
    assert timing.decode_ms(1, 0) == pytest.approx(1.0)
    assert timing.decode_ms(16, 256) == pytest.approx(3.0)
    assert timing.decode_ms(1, 128) == pytest.approx(1.5)
    assert timing.decode_ms(16, 512) == pytest.approx(4.0)  # past the grid: the edge slope continues
    assert timing.decode_ms(0, 0) == 0.0
    assert timing.prefill_ms(256) == pytest.approx(3.0)
    assert timing.step_s(1, 0, 256) == pytest.approx(0.004)


def test_prompts_prefilled_in_one_step_do_not_attend_to_each_other() -> None:
    """Two 8k prompts in one step cost two prompts' attention, not one 16k prompt's (the H100
    profile is the formula 5 + 0.035 n + 5.2e-7 n^2 ms)."""
    timing = TimingModel(load_profile("llama-3.1-8b-h100"))
    assert timing.attention_ms_per_token2 == pytest.approx(5.2e-7, rel=0.01)
    two = 5 + 0.035 * 16_384 + 5.2e-7 * 2 * 8192**2
    assert timing.prefill_batch_ms([8192, 8192]) == pytest.approx(two, rel=0.01)
    assert timing.prefill_ms(16_384) - two == pytest.approx(5.2e-7 * 2 * 8192**2, rel=0.02)  # ~70 ms
    assert timing.prefill_batch_ms([16_384]) == timing.prefill_ms(16_384)
    engine = SimEngine("llama-3.1-8b-h100")
    for i in range(2):
        engine.add_request(f"r{i}", [1] * 8192, SamplingParams(max_tokens=1))
    plan, seconds = engine.begin_step()
    assert len(plan.prefills) == 2
    assert seconds * 1000 == pytest.approx(two, rel=0.01)
    assert TimingModel(load_profile("tiny-test")).attention_ms_per_token2 == 0.0  # a linear table


def test_broken_profiles_are_refused_with_the_reason(tmp_path: Path) -> None:
    data = json.loads((PROFILES_DIR / "tiny-test.json").read_text())
    data["decode"]["ms"] = [[1.0, 2.0]]  # one row for two batch sizes
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidProfile, match="one row per batch size"):
        load_profile(path)
    data = json.loads((PROFILES_DIR / "tiny-test.json").read_text())
    data["surprise"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidProfile, match="surprise"):
        load_profile(path)
    with pytest.raises(InvalidProfile, match="built-in"):
        load_profile("no-such-profile")
    with pytest.raises(InvalidProfile, match="ascending"):
        unsorted = DecodeTable(batch_sizes=(4, 2), context_tokens=(0,), ms=((1.0,), (2.0,)))
        msgspec.structs.replace(load_profile("tiny-test"), decode=unsorted).validate()


# ------------------------------------------------------------------- serving


def test_sim_engine_is_an_engine_and_describes_itself() -> None:
    engine = SimEngine("tiny-test", num_blocks=10)
    assert isinstance(engine, Engine)
    assert engine_class("sim") is SimEngine
    info = engine.info
    assert (info.engine, info.num_blocks, info.block_size, info.bytes_per_block) == ("sim", 10, 4, 1024)
    assert info.kv_layout.block_size == 4
    assert info.can_migrate_to(SimEngine("tiny-test").info)
    assert not info.can_migrate_to(SimEngine("llama-7b-a10").info)


def test_tokens_are_deterministic_in_range_and_never_eos() -> None:
    sampling = SamplingParams(max_tokens=40)
    first = run_alone("req-1", PROMPT, sampling)
    assert first == run_alone("req-1", PROMPT, sampling)
    assert first != run_alone("req-2", PROMPT, sampling)
    assert len(first) == 40
    assert all(0 < t < 1000 for t in first)  # tiny-test: vocab 1000, EOS 0
    assert first != run_alone("req-1", PROMPT, SamplingParams(max_tokens=40, seed=3))
    assert first[5] == sim_token_id("req-1", None, 5, 1000, 0)


def test_virtual_clock_steps_report_the_modeled_time_without_sleeping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    engine = SimEngine("llama-7b-a10")
    engine.add_request("r", [1] * 1000, SamplingParams(max_tokens=3))
    results = [engine.step() for _ in range(3)]
    assert slept == []  # the steps' modeled time is reported for the caller's clock, not slept
    assert sum(result.duration_s for result in results) > 0.2
    timing = engine.timing
    assert results[0].duration_s == pytest.approx(timing.prefill_ms(1000) / 1000)
    assert results[1].duration_s == pytest.approx(timing.decode_ms(1, 1001) / 1000)
    assert [r.finished for r in results] == [[], [], ["r"]]
    assert engine.stats().num_free_blocks == 851


async def test_real_time_steps_sleep_the_modeled_time_and_tolerate_aborts_meanwhile() -> None:
    engine = SimEngine("tiny-test", time_scale=10.0)  # ~10-30 ms steps
    engine.add_request("keep", PROMPT, SamplingParams(max_tokens=5))
    engine.add_request("drop", PROMPT, SamplingParams(max_tokens=5))
    started = time.perf_counter()
    step = asyncio.ensure_future(engine.step_async())
    await asyncio.sleep(0)
    assert engine.abort("drop")  # while the step sleeps
    result = await step
    elapsed = time.perf_counter() - started
    assert elapsed >= result.duration_s > 0
    assert [o.request_id for o in result.outputs] == ["keep"]
    seen: list[StepResult] = []
    await engine.run_until_idle(seen.append)
    assert sum(len(r.outputs) for r in seen) == 4
    assert engine.stats().num_free_blocks == 64


def test_rejections_are_typed_and_counted_by_the_engine() -> None:
    engine = SimEngine("tiny-test")
    with pytest.raises(RequestRejected):
        engine.add_request("big", [1] * 257, SamplingParams())
    assert engine.add_request("ok", [1], SamplingParams()) is True
    assert engine.add_request("ok", [1], SamplingParams()) is False
    assert engine.stats().num_rejections == 1
    assert [e.request_id for e in engine.take_events()] == ["big"]


# ----------------------------------------------------------------- migration


def migrate(
    src: SimEngine, dst: SimEngine, request_id: str, steps_between_stages: int
) -> tuple[list[int], list[int]]:
    """Llumnix's pipelined migration: stage 0 while decoding, then suspend, copy the rest, commit.

    Returns the tokens the source emitted during the migration and the block ids held on ``dst``.
    """
    emitted: list[int] = []
    blocks = src.scheduler.blocks
    # Stage 0: the blocks that hold computed tokens now (the last one may still fill up).
    stats = src.request_stats(request_id)
    assert stats is not None and stats.status is RequestStatus.RUNNING
    computed0 = stats.num_computed_tokens
    stage0 = blocks.blocks_for_tokens(computed0)
    first = dst.reserve(stage0)
    dst.import_blocks(first.block_ids, src.export_blocks(request_id, range(stage0)))
    for _ in range(steps_between_stages):  # the request keeps decoding on the source
        emitted += [t for o in src.step().outputs if o.request_id == request_id for t in o.token_ids]
    # Last stage: drain it, copy stage 0's partial last block again plus the new blocks, commit.
    src.suspend(request_id)
    stats = src.request_stats(request_id)
    assert stats is not None and stats.num_preemptions == 0
    total = blocks.blocks_for_tokens(stats.num_computed_tokens)
    last = dst.reserve(total - stage0)
    redo = stage0 - 1 if computed0 % blocks.block_size else stage0
    targets = [*first.block_ids[redo:], *last.block_ids]
    dst.import_blocks(targets, src.export_blocks(request_id, range(redo, total)))
    request = src.scheduler.request(request_id)
    dst.admit_migrated(
        request_id,
        request.prompt_token_ids,
        request.output_token_ids,
        request.sampling,
        request.priority,
        [first, last],
    )
    assert src.release_request(request_id) >= total
    return emitted, [*first.block_ids, *last.block_ids]


def test_a_request_moves_between_two_instances_with_blocks_conserved_and_finishes_once() -> None:
    sampling = SamplingParams(max_tokens=30)
    reference = run_alone("mig", PROMPT, sampling)
    src, dst = SimEngine("tiny-test"), SimEngine("tiny-test")
    src.add_request("mig", PROMPT, sampling)
    src.add_request("stays", PROMPT, SamplingParams(max_tokens=40))
    tokens = [t for _ in range(5) for o in src.step().outputs if o.request_id == "mig" for t in o.token_ids]
    held_before = src.request_stats("mig")
    assert held_before is not None
    emitted, dst_blocks = migrate(src, dst, "mig", steps_between_stages=3)
    tokens += emitted
    # Blocks: the source holds only "stays"; the destination holds exactly the request's table.
    assert "mig" not in src.scheduler
    stays = src.request_stats("stays")
    assert stays is not None
    assert src.stats().num_free_blocks == 64 - stays.num_blocks
    moved = dst.request_stats("mig")
    assert moved is not None and moved.status is RequestStatus.RUNNING
    assert moved.num_blocks == len(dst_blocks)
    assert dst.stats().num_free_blocks == 64 - moved.num_blocks
    assert dst.stats().num_reserved_blocks == 0
    assert dst.output_token_ids("mig") == tuple(tokens)
    # It finishes exactly once, on the destination, with the tokens it would have had unmigrated.
    finishes = []
    while dst.has_unfinished() or src.has_unfinished():
        for engine in (src, dst):
            for o in engine.step().outputs:
                if o.request_id == "mig":
                    assert engine is dst
                    assert o.first_index == len(tokens)
                    tokens += o.token_ids
                    if o.finished:
                        finishes.append(o.finish_reason)
    assert finishes == ["length"]
    assert tokens == reference
    assert src.stats().num_free_blocks == dst.stats().num_free_blocks == 64


@settings(max_examples=25, deadline=None)
@given(
    prompt_len=st.integers(1, 40),
    steps_before=st.integers(1, 12),
    steps_between=st.integers(0, 6),
)
def test_migration_at_any_point_gives_the_unmigrated_tokens(
    prompt_len: int, steps_before: int, steps_between: int
) -> None:
    sampling = SamplingParams(max_tokens=25)
    prompt = list(range(1, prompt_len + 1))
    reference = run_alone("r", prompt, sampling)
    src, dst = SimEngine("tiny-test"), SimEngine("tiny-test")
    src.add_request("r", prompt, sampling)
    tokens: list[int] = []
    for _ in range(steps_before):
        tokens += [t for o in src.step().outputs for t in o.token_ids]
    if "r" not in src.scheduler or len(tokens) + steps_between >= 25:
        return  # finished before the migration would have committed
    emitted, _ = migrate(src, dst, "r", steps_between)
    tokens += emitted
    while dst.has_unfinished():
        tokens += [t for o in dst.step().outputs for t in o.token_ids]
    assert tokens == reference
    assert src.stats().num_free_blocks == dst.stats().num_free_blocks == 64


def test_import_needs_reserved_blocks_and_a_matching_buffer() -> None:
    src, dst = SimEngine("tiny-test"), SimEngine("tiny-test")
    src.add_request("r", PROMPT, SamplingParams(max_tokens=10))
    src.step()
    buffer = src.export_blocks("r", range(3))
    assert (buffer.num_blocks, buffer.nbytes, len(buffer.payload)) == (3, 3 * 1024, 24)
    assert buffer.is_simulated
    with pytest.raises(MigrationError, match="not reserved"):
        dst.import_blocks([0, 1, 2], buffer)
    reservation = dst.reserve(3)
    with pytest.raises(MigrationError, match="2 block ids"):
        dst.import_blocks(reservation.block_ids[:2], buffer)
    with pytest.raises(MigrationError, match="KV layouts differ"):
        dst.import_blocks(reservation.block_ids, KVBuffer(3, 3 * 2048, buffer.payload))
    with pytest.raises(MigrationError, match="holds 6 blocks"):
        src.export_blocks("r", [6])
    assert dst.release_reservation(reservation) == 3
    assert dst.stats().num_free_blocks == 64


def test_admitting_with_a_block_never_imported_fails_and_keeps_the_reservation() -> None:
    src, dst = SimEngine("tiny-test"), SimEngine("tiny-test")
    src.add_request("r", PROMPT, SamplingParams(max_tokens=10))
    src.step()  # 22 tokens computed: 6 blocks
    reservation = dst.reserve(6)
    dst.import_blocks(reservation.block_ids[:5], src.export_blocks("r", range(5)))
    request = src.scheduler.request("r")
    args = ("r", request.prompt_token_ids, request.output_token_ids, request.sampling, 0, [reservation])
    with pytest.raises(MigrationError, match="block 5"):
        dst.admit_migrated(*args)
    assert dst.stats().num_reserved_blocks == 6
    dst.import_blocks(reservation.block_ids[5:], src.export_blocks("r", [5]))
    dst.admit_migrated(*args)
    assert dst.stats().num_reserved_blocks == 0
    assert dst.stats().num_running == 1

"""The vllm engine through the ``Engine`` protocol, on a tiny random Llama built locally.

Serving must give vLLM's own ``LLM.generate`` greedy tokens; aborts free
blocks; stats follow vLLM's block pool. Migration between two vLLM engines
in this process, in two stages while other requests decode, must give the
tokens of an unmigrated run, and every abort path must leave the free block
counts where they started. Skipped (with the reason) where vLLM is not
installed (``./install.sh --vllm``). The checkpoint builder is tested with
the torch engine too: both engines load it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
from tokenizers import Tokenizer

from agents.engines.protocol import (
    Engine,
    FinishReason,
    MigrationError,
    RejectReason,
    RequestRejected,
    RequestStatus,
)
from agents.engines.vllm_engine import vllm_unavailable_reason
from agents.engines.vllm_engine.checkpoint import build_checkpoint
from schemas import SamplingParams, StructuredKind, StructuredOutput
from schemas.block_hash import block_hashes
from tests.agents.engines.loop_ticks import loop_ticks

# vLLM's import and start-up warn about its own dependencies (torch.jit, torch.distributed, ...)
pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning"
)

_REASON = vllm_unavailable_reason()
needs_vllm = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

PROMPT = tuple((i * 37) % 500 + 3 for i in range(70))
GREEDY = SamplingParams(max_tokens=100, ignore_eos=True)
NUM_BLOCKS = 48


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"))


#: the first engine's model thread is pinned to this CPU (as ``shoal agent`` pins it), the second is not
PINNED_CPU = min(os.sched_getaffinity(0))


def _vllm(checkpoint: Path, **overrides: Any) -> Any:
    from agents.engines.vllm_engine.engine import VllmEngine

    return VllmEngine(
        str(checkpoint),
        num_blocks=NUM_BLOCKS,
        kv_cache_bytes=64 * 2**20,
        max_model_len=512,
        dtype="float32",
        **overrides,
    )


#: prompt logprobs asked of vLLM's own run: the prompt token's and this many alternatives per position
PROMPT_LOGPROBS = 3


@pytest.fixture(scope="module")
def vllm_own(checkpoint: Path) -> tuple[list[int], list[dict[int, float] | None]]:
    """vLLM's own ``LLM.generate`` for PROMPT without prefix caching (built, and shut down, before
    the engines): its greedy tokens, and its prompt logprobs (token id -> logprob per position)."""
    if _REASON is not None:
        pytest.skip(_REASON)
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams

    llm = LLM(
        model=str(checkpoint),
        block_size=32,
        max_model_len=512,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
        num_gpu_blocks_override=NUM_BLOCKS + 1,
        enable_prefix_caching=False,  # the engines cache prefixes: their tokens must be these
    )
    params = VllmSamplingParams(
        max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=PROMPT_LOGPROBS
    )
    outputs = llm.generate({"prompt_token_ids": list(PROMPT)}, params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    prompt_logprobs = [
        None if position is None else {token: lp.logprob for token, lp in position.items()}
        for position in outputs[0].prompt_logprobs or ()
    ]
    return list(outputs[0].outputs[0].token_ids), prompt_logprobs


@pytest.fixture(scope="module")
def vllm_reference(vllm_own: tuple[list[int], Any]) -> list[int]:
    """vLLM's own greedy tokens for PROMPT."""
    return vllm_own[0]


@pytest.fixture(scope="module")
def engines(checkpoint: Path, vllm_reference: list[int]) -> Any:
    first, second = _vllm(checkpoint, cpus=(PINNED_CPU,)), _vllm(checkpoint)
    yield first, second
    first.shutdown()
    second.shutdown()


def _run(engine: Any, request_id: str, prompt: tuple[int, ...], sampling: SamplingParams) -> list[int]:
    engine.add_request(request_id, prompt, sampling)
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step().outputs:
            if output.request_id == request_id:
                tokens.extend(output.token_ids)
    return tokens


def _step_collect(engine: Any, tokens: dict[str, list[int]], steps: int = 1) -> None:
    for _ in range(steps):
        for output in engine.step().outputs:
            tokens.setdefault(output.request_id, []).extend(output.token_ids)


def test_checkpoint_loads_in_the_torch_engine(checkpoint: Path) -> None:
    from agents.engines.torch_engine import TorchEngine

    engine = TorchEngine(str(checkpoint), num_blocks=32, block_size=32)
    assert isinstance(engine, Engine)
    assert engine.info.kv_layout.head_dim == 64
    tokens = _run(engine, "r", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    assert len(tokens) == 40 and len(set(tokens)) > 10  # greedy text does not collapse to one token


@needs_vllm
def test_greedy_tokens_match_vllms_own_generate(engines: Any, vllm_reference: list[int]) -> None:
    """With the engine's prefix cache on, cold and served from the cache, as vLLM's run without one."""
    engine, _ = engines
    assert isinstance(engine, Engine)
    assert engine.vllm_config.cache_config.enable_prefix_caching
    assert _run(engine, "r1", PROMPT, GREEDY) == vllm_reference
    assert _run(engine, "r2", PROMPT, GREEDY) == vllm_reference
    stats = engine.stats()
    assert stats.prefix_cache_hits == 64 and stats.prefix_cache_queries == 2 * len(PROMPT)
    assert stats.num_free_blocks == NUM_BLOCKS


@needs_vllm
def test_abort_frees_blocks_and_stats_follow_vllm(engines: Any) -> None:
    engine, _ = engines
    info = engine.info
    assert (info.engine, info.num_blocks, info.block_size) == ("vllm", NUM_BLOCKS, 32)
    assert info.bytes_per_block == 2 * 2 * 1 * 64 * 32 * 4  # K+V, layers, kv heads, head dim, tokens, fp32
    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("b", PROMPT[:10], GREEDY)
    assert engine.stats().head_of_line_demand == 3  # 70 tokens, blocks of 32
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 2 and stats.num_waiting == 0
    held = {r.request_id: r.num_blocks for r in stats.requests}
    assert held == {"a": 3, "b": 1}
    assert stats.num_free_blocks == NUM_BLOCKS - 4
    assert engine.abort("a") and not engine.abort("a")
    assert engine.stats().num_free_blocks == NUM_BLOCKS - 1
    assert engine.request_stats("a") is None
    assert engine.abort("b")
    assert engine.stats().num_free_blocks == NUM_BLOCKS and not engine.has_unfinished()


@needs_vllm
def test_request_migrated_in_two_stages_matches_an_unmigrated_run(engines: Any) -> None:
    source, destination = engines
    expected = _run(source, "ref", PROMPT, GREEDY)
    tokens: dict[str, list[int]] = {}
    source.add_request("moving", PROMPT, GREEDY)
    source.add_request("bg1", (3, 4, 5), SamplingParams(max_tokens=150))
    destination.add_request("bg2", (6, 7), SamplingParams(max_tokens=150))
    _step_collect(source, tokens, 10)
    stats = source.request_stats("moving")
    full = stats.num_computed_tokens // 32
    stage0 = destination.reserve(full)  # stage 0: the full blocks, while the request keeps decoding
    destination.import_blocks(stage0.block_ids, source.export_blocks("moving", range(full)))
    _step_collect(source, tokens, 25)
    _step_collect(destination, tokens, 3)
    source.suspend("moving")  # last stage
    _step_collect(source, tokens, 2)
    stats = source.request_stats("moving")
    assert stats.status is RequestStatus.SUSPENDED and stats.num_blocks > full
    stage1 = destination.reserve(stats.num_blocks - full)
    destination.import_blocks(stage1.block_ids, source.export_blocks("moving", range(full, stats.num_blocks)))
    generated = source.output_token_ids("moving")
    assert list(generated) == tokens["moving"]
    destination.admit_migrated("moving", PROMPT, generated, GREEDY, 0, [stage0, stage1])
    assert source.release_request("moving") == stats.num_blocks
    while destination.has_unfinished() or source.has_unfinished():
        _step_collect(destination, tokens)
        _step_collect(source, tokens)
    assert tokens["moving"] == expected
    assert source.stats().num_free_blocks == NUM_BLOCKS == destination.stats().num_free_blocks
    assert destination.stats().num_reserved_blocks == 0


@needs_vllm
def test_kv_really_moves_a_request_admitted_without_it_diverges(engines: Any) -> None:
    source, destination = engines
    expected = _run(source, "ref", PROMPT, GREEDY)
    source.add_request("c", PROMPT, GREEDY)
    for _ in range(20):
        source.step()
    generated = source.output_token_ids("c")
    reservation = destination.reserve(source.request_stats("c").num_blocks)  # reserved, never written
    destination.admit_migrated("c", PROMPT, generated, GREEDY, 0, [reservation])
    source.abort("c")
    tokens = list(generated) + _run(destination, "none", (1,), SamplingParams(max_tokens=1))[:0]
    while destination.has_unfinished():
        for output in destination.step().outputs:
            tokens.extend(output.token_ids)
    assert tokens != expected
    assert destination.stats().num_free_blocks == NUM_BLOCKS
    # vLLM cached the unwritten blocks under the prompt's hashes: drop them, or PROMPT would hit them
    assert destination.scheduler.reset_prefix_cache()
    assert destination.take_cache_delta().cleared and destination.cached_block_hashes() == []


@needs_vllm
def test_migration_aborts_leave_free_blocks_where_they_started(engines: Any) -> None:
    source, destination = engines
    source.add_request("m", PROMPT, GREEDY)
    source.step()
    before = destination.stats().num_free_blocks
    reservation = destination.reserve(2)
    assert destination.stats().num_free_blocks == before - 2 == NUM_BLOCKS - 2
    assert destination.stats().num_reserved_blocks == 2
    destination.import_blocks(reservation.block_ids, source.export_blocks("m", [0, 1]))
    with pytest.raises(MigrationError):
        destination.import_blocks((0, 1), source.export_blocks("m", [0, 1]))  # not reserved
    assert destination.release_reservation(reservation) == 2  # abort before commit
    assert destination.stats().num_free_blocks == NUM_BLOCKS
    source.suspend("m")
    source.resume("m")  # abort after suspension: the request runs on
    source.step()
    assert source.request_stats("m").status is RequestStatus.RUNNING
    source.suspend("m")
    assert source.abort("m")  # a suspended request can still be aborted
    assert source.stats().num_free_blocks == NUM_BLOCKS and not source.has_unfinished()


@needs_vllm
def test_requests_vllm_cannot_move_faithfully_are_marked(engines: Any) -> None:
    engine, _ = engines
    engine.add_request("seeded", PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=3))
    engine.add_request("penalty", PROMPT, SamplingParams(max_tokens=5, repetition_penalty=1.2))
    engine.add_request("presence", PROMPT, SamplingParams(max_tokens=5, presence_penalty=0.5))
    engine.add_request("frequency", PROMPT, SamplingParams(max_tokens=5, frequency_penalty=-0.5))
    engine.add_request("plain", PROMPT, SamplingParams(max_tokens=5, temperature=1.0))
    assert engine.migration_blocker("seeded") is not None
    for penalised in ("penalty", "presence", "frequency"):
        assert engine.migration_blocker(penalised) is not None
    assert engine.migration_blocker("plain") is None
    for request_id in ("seeded", "penalty", "presence", "frequency", "plain"):
        engine.abort(request_id)
    assert engine.stats().num_free_blocks == NUM_BLOCKS


@needs_vllm
def test_admission_needs_no_blocks_beyond_the_reservation(engines: Any) -> None:
    """The reserved blocks become the migrated request's own: it runs on a destination left with none free."""
    source, destination = engines
    for index in range(3):  # 450 tokens each: 15 blocks each, 45 of 48
        destination.add_request(f"fill{index}", tuple(3 + (i * 7 + index) % 400 for i in range(450)), GREEDY)
    destination.step()
    assert destination.stats().num_free_blocks == 3
    source.add_request("tight", PROMPT, GREEDY)
    tokens: dict[str, list[int]] = {}
    _step_collect(source, tokens, 20)  # 70 + 20 tokens: 3 blocks
    source.suspend("tight")
    stats = source.request_stats("tight")
    assert stats.num_blocks == 3
    reservation = destination.reserve(3)
    assert destination.stats().num_free_blocks == 0
    destination.import_blocks(reservation.block_ids, source.export_blocks("tight", range(3)))
    generated = source.output_token_ids("tight")
    destination.admit_migrated("tight", PROMPT, generated, GREEDY, 0, [reservation])
    source.release_request("tight")
    assert destination.stats().num_reserved_blocks == 0
    _step_collect(destination, tokens)
    assert len(tokens["tight"]) == len(generated) + 1  # scheduled at once, not waiting for free blocks
    assert destination.request_stats("tight").num_blocks == 3
    for request_id in ("tight", "fill0", "fill1", "fill2"):
        assert destination.abort(request_id)
    assert destination.stats().num_free_blocks == NUM_BLOCKS == source.stats().num_free_blocks


@needs_vllm
def test_a_migrated_request_aborted_before_its_first_step_frees_its_blocks(engines: Any) -> None:
    source, destination = engines
    source.add_request("early", PROMPT, GREEDY)
    _step_collect(source, {}, 5)
    source.suspend("early")
    held = source.request_stats("early").num_blocks
    reservation = destination.reserve(held + 2)  # more than it needs: the rest goes back at admission
    destination.import_blocks(reservation.block_ids[:held], source.export_blocks("early", range(held)))
    destination.admit_migrated("early", PROMPT, source.output_token_ids("early"), GREEDY, 0, [reservation])
    assert source.abort("early")
    assert destination.stats().num_free_blocks == NUM_BLOCKS - held
    assert destination.stats().num_reserved_blocks == 0
    assert destination.abort("early")  # still waiting in vLLM's queue
    assert destination.stats().num_free_blocks == NUM_BLOCKS == source.stats().num_free_blocks


@needs_vllm
def test_a_migrated_request_runs_ahead_of_the_destinations_waiting_queue(engines: Any) -> None:
    """As in Llumnix, a migrated request continues at the destination's next step.

    It holds its KV blocks, so it must not wait behind a queued request the
    destination cannot admit yet (vLLM's FCFS queue stops at its head).
    """
    source, destination = engines
    for index in range(3):  # 450 tokens each: 15 blocks each, 45 of 48
        destination.add_request(f"fill{index}", tuple(3 + (i * 7 + index) % 400 for i in range(450)), GREEDY)
    destination.step()
    destination.add_request("queued", tuple(3 + i % 400 for i in range(200)), GREEDY)  # 7 blocks: no room
    destination.step()
    assert destination.request_stats("queued").status is RequestStatus.WAITING
    source.add_request("moved", PROMPT, GREEDY)
    tokens: dict[str, list[int]] = {}
    _step_collect(source, tokens, 20)
    source.suspend("moved")
    held = source.request_stats("moved").num_blocks
    reservation = destination.reserve(held)
    destination.import_blocks(reservation.block_ids, source.export_blocks("moved", range(held)))
    generated = source.output_token_ids("moved")
    destination.admit_migrated("moved", PROMPT, generated, GREEDY, 0, [reservation])
    source.release_request("moved")
    _step_collect(destination, tokens)
    assert len(tokens["moved"]) == len(generated) + 1  # it ran this step
    assert destination.request_stats("queued").status is RequestStatus.WAITING  # the queue did not move
    for request_id in ("moved", "queued", "fill0", "fill1", "fill2"):
        assert destination.abort(request_id)
    assert destination.stats().num_free_blocks == NUM_BLOCKS == source.stats().num_free_blocks


@needs_vllm
def test_a_queued_request_is_held_and_moves_without_kv(engines: Any, vllm_reference: list[int]) -> None:
    """A request still in vLLM's queue (never ran) is held out of it, queued again in its place,
    and moved without KV: the destination queues it afresh and gives vLLM's own tokens."""
    source, destination = engines
    assert source.holds_queued_requests
    for request_id in ("a", "b", "c"):
        source.add_request(request_id, PROMPT, GREEDY)
    source.suspend("b")  # not stepped yet: all three wait
    stats = source.request_stats("b")
    assert stats.status is RequestStatus.SUSPENDED and stats.num_blocks == 0
    assert source.stats().num_waiting == 2
    source.resume("b")
    assert [r.request_id for r in source.scheduler.waiting] == ["a", "b", "c"]  # back in its place
    source.suspend("c")
    tokens: dict[str, list[int]] = {}
    _step_collect(source, tokens, 3)
    assert set(tokens) == {"a", "b"}  # c sits out
    assert source.request_stats("c").num_blocks == 0
    source.release_request("c")  # the move committed: it leaves without output
    destination.add_request("c", PROMPT, GREEDY)  # the destination queues it afresh
    while destination.has_unfinished():
        _step_collect(destination, tokens)
    assert tokens["c"] == vllm_reference
    assert source.abort("a") and source.abort("b")
    assert destination.stats().num_free_blocks == NUM_BLOCKS == source.stats().num_free_blocks


def _collect(engine: Any, request_id: str, prompt: tuple[int, ...], sampling: SamplingParams) -> Any:
    """Run one request alone: its tokens and the cached-token counts its outputs carried."""
    engine.add_request(request_id, prompt, sampling)
    tokens: list[int] = []
    cached: set[int] = set()
    while engine.has_unfinished():
        for output in engine.step().outputs:
            tokens.extend(output.token_ids)
            cached.add(output.num_cached_tokens)
    return tokens, cached


@needs_vllm
def test_a_repeated_prompt_is_served_from_vllms_cache_named_by_shoals_hashes(engines: Any) -> None:
    """vLLM's own prefix cache, seen through shoal: the blocks it caches are reported by the chain
    hashes of :mod:`schemas.block_hash`, and a repeated prompt reports the tokens it did not compute."""
    engine, _ = engines
    prompt = tuple((i * 11) % 450 + 5 for i in range(100))  # 3 full blocks of 32, then 4 tokens
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.take_cache_delta()
    before = engine.stats()
    first, cached = _collect(engine, "cold", prompt, sampling)
    assert cached == {0}
    chain = block_hashes(prompt, 32)
    delta = engine.take_cache_delta()
    # the prompt's 3 full blocks; the 4th (4 prompt tokens + 7 computed outputs) is not full
    assert delta.stored == tuple(chain) and not delta.cleared
    assert set(chain) <= set(engine.cached_block_hashes())
    again, cached = _collect(engine, "warm", prompt, sampling)
    assert again == first
    assert cached == {96}  # vLLM leaves the last prompt token to compute: 99 tokens, 3 blocks
    assert not engine.take_cache_delta().stored  # nothing new: it ran on the cached blocks
    stats = engine.stats()
    assert stats.prefix_cache_queries - before.prefix_cache_queries == 200
    assert stats.prefix_cache_hits - before.prefix_cache_hits == 96
    assert stats.num_cached_blocks >= 3 and stats.num_free_blocks == NUM_BLOCKS
    # a request continued here after 3 tokens elsewhere (a rescue) is served from the cache too
    engine.add_request("rescued", prompt, sampling, output_token_ids=tuple(first[:3]))
    rescued: dict[str, list[int]] = {}
    cached = set()
    while engine.has_unfinished():
        for output in engine.step().outputs:
            rescued.setdefault(output.request_id, []).extend(output.token_ids)
            cached.add(output.num_cached_tokens)
    assert rescued["rescued"] == first[3:] and cached == {96}
    # a reset (after the agent's warm-up) forgets what no request holds and zeroes the counters
    engine.add_request("busy", prompt, sampling)
    engine.step()
    engine.reset_prefix_cache()
    stats = engine.stats()
    assert stats.prefix_cache_queries == stats.prefix_cache_hits == stats.prefix_cache_evictions == 0
    assert sorted(engine.cached_block_hashes()) == sorted(chain)  # the blocks "busy" runs on stay
    assert engine.abort("busy")
    engine.reset_prefix_cache()  # nothing in use: vLLM's own reset
    assert engine.take_cache_delta().cleared and engine.cached_block_hashes() == []
    assert _collect(engine, "after-reset", prompt, sampling) == (first, {0})


@needs_vllm
def test_a_request_sharing_cached_blocks_migrates_and_leaves_them_to_the_other(engines: Any) -> None:
    """With prefix caching on, a migrated request's leading blocks are shared with a request that
    stays: the export reads them, the release drops only the migrated request's references, and the
    destination writes only the blocks it reserved, never one its own cache holds."""
    source, destination = engines
    prefix = tuple((i * 13) % 400 + 7 for i in range(64))  # two full blocks
    stay, go = (*prefix, 11, 12, 13), (*prefix, *range(21, 51))  # go: a third block of its own
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = {"stay": _run(source, "ref-stay", stay, sampling), "go": _run(source, "ref-go", go, sampling)}
    # the destination caches the same prefix (its own copy), and keeps it through the migration
    assert _run(destination, "dest-stay", stay, sampling) == expected["stay"]
    dest_cached = set(destination.cached_block_hashes())
    assert set(block_hashes(prefix, 32)) <= dest_cached
    tokens: dict[str, list[int]] = {}
    source.add_request("stay", stay, sampling)
    source.add_request("go", go, sampling)
    _step_collect(source, tokens, 6)
    shared = source._block_ids("stay")[:2]
    assert source._block_ids("go")[:2] == shared  # both run on the cached prefix blocks
    source.suspend("go")
    held = source.request_stats("go").num_blocks
    assert held == 4  # 94 + 6 tokens
    reservation = destination.reserve(held)
    pool = destination._block_pool
    assert all(pool.blocks[b].block_hash is None for b in reservation.block_ids)  # fresh, never cached
    destination.import_blocks(reservation.block_ids, source.export_blocks("go", range(held)))
    destination.admit_migrated("go", go, source.output_token_ids("go"), sampling, 0, [reservation])
    assert source.release_request("go") == held  # its references, the shared ones included
    assert source.request_stats("stay").num_blocks == 3
    assert all(source._block_pool.blocks[b].ref_cnt == 1 for b in shared)  # still the other's
    while source.has_unfinished() or destination.has_unfinished():
        _step_collect(source, tokens)
        _step_collect(destination, tokens)
    assert tokens["stay"] == expected["stay"] and tokens["go"] == expected["go"]
    # the imported full blocks entered the destination's cache under the request's own hashes
    chain = block_hashes((*go, *expected["go"]), 32)
    assert chain[2] not in dest_cached and set(chain[:3]) <= set(destination.cached_block_hashes())
    # the destination's own cached prefix was never written: a new request served from it is right
    again, cached = _collect(destination, "dest-again", stay, sampling)
    assert again == expected["stay"] and cached == {64}
    assert source.stats().num_free_blocks == NUM_BLOCKS == destination.stats().num_free_blocks


@needs_vllm
def test_a_destination_lends_its_cached_prefix_and_only_the_rest_is_copied(engines: Any) -> None:
    """A destination that caches a migrating request's leading blocks holds them for it (shoal's
    chain hashes found in vLLM's cache); only the blocks after them travel, and the request
    continues on its own tokens."""
    source, destination = engines
    prefix = tuple((i * 17) % 400 + 9 for i in range(64))  # two full blocks
    mover = (*prefix, *range(31, 61))  # 94 tokens: a third block of its own
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = _run(source, "ref-mover", mover, sampling)
    _run(destination, "dest-prefix", (*prefix, 5, 6), SamplingParams(max_tokens=2, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    source.add_request("mover", mover, sampling)
    _step_collect(source, tokens, 6)
    source.suspend("mover")
    table = source.request_stats("mover").num_blocks
    generated = source.output_token_ids("mover")
    chain = block_hashes((*mover, *generated), 32)
    assert (table, len(chain)) == (4, 3)
    assert destination.hold_cached_blocks(block_hashes(tuple(range(900, 964)), 32)) == ()  # not cached
    free = destination.stats().num_free_blocks
    held = destination.hold_cached_blocks(chain)
    assert len(held) == 2 and destination.stats().num_free_blocks == free - 2  # no longer evictable
    destination.drop_held_blocks(held)  # a migration given up
    assert destination.stats().num_free_blocks == free
    held = destination.hold_cached_blocks(chain)
    reservation = destination.reserve(table - len(held))
    destination.import_blocks(reservation.block_ids, source.export_blocks("mover", range(len(held), table)))
    with pytest.raises(MigrationError):  # lent blocks must be the request's own prefix
        destination.admit_migrated(
            "wrong", (7,) * 94, generated, sampling, 0, [reservation], cached_block_ids=held
        )
    destination.admit_migrated("mover", mover, generated, sampling, 0, [reservation], cached_block_ids=held)
    assert source.release_request("mover") == table
    assert destination._block_ids("mover")[:2] == held
    while destination.has_unfinished():
        _step_collect(destination, tokens)
    assert tokens["mover"] == expected
    assert chain[2] in destination.cached_block_hashes()  # the copied full block entered its cache
    assert source.stats().num_free_blocks == NUM_BLOCKS == destination.stats().num_free_blocks


@needs_vllm
def test_prefix_caching_off_reports_no_cache(checkpoint: Path) -> None:
    """``prefix_cache=False`` is vLLM's ``enable_prefix_caching=False``, without cache events."""
    from agents.engines.vllm_engine.config import VllmEngineConfig
    from agents.engines.vllm_engine.engine import _engine_args

    args = _engine_args(VllmEngineConfig(model=str(checkpoint), prefix_cache=False))
    assert args.enable_prefix_caching is False and args.kv_events_config is None
    args = _engine_args(VllmEngineConfig(model=str(checkpoint)))
    assert args.enable_prefix_caching is True and args.kv_events_config.enable_kv_cache_events


@needs_vllm
def test_every_model_step_runs_on_one_thread_pinned_to_the_engines_cpus(
    engines: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM binds its CPU worker only in worker processes; in-process, the engine pins one model thread."""
    import torch

    pinned, unpinned = engines
    threads_before = torch.get_num_threads()
    seen: list[tuple[int, set[int], int]] = []
    executor = pinned.core.model_executor
    original = executor.execute_model

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append((threading.get_ident(), os.sched_getaffinity(0), torch.get_num_threads()))
        return original(*args, **kwargs)

    monkeypatch.setattr(executor, "execute_model", recording)
    tokens: dict[str, list[int]] = {"pin": []}
    pinned.add_request("pin", PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))

    async def steps() -> None:
        for _ in range(3):
            tokens["pin"].extend(t for out in (await pinned.step_async()).outputs for t in out.token_ids)

    asyncio.run(steps())
    while pinned.has_unfinished():
        tokens["pin"].extend(t for out in pinned.step().outputs for t in out.token_ids)
    assert len(tokens["pin"]) == 6
    assert len(seen) == 6  # step_async and step alike
    assert {ident for ident, _, _ in seen} != {threading.get_ident()}
    assert len({ident for ident, _, _ in seen}) == 1, "model steps ran on more than one thread"
    assert all(cpus == {PINNED_CPU} and num == 1 for _, cpus, num in seen), seen
    # the caller's thread (the agent's event loop) and torch's default elsewhere are left alone
    assert torch.get_num_threads() == threads_before
    assert PINNED_CPU in os.sched_getaffinity(0)
    assert unpinned.config.cpus == ()


def test_exclusive_steps_block_the_loop_only_when_short(
    engines: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exclusive caller's loop waits blocked for a step expected to be short; a longer one (or any
    step of a caller that is not exclusive) is awaited, so the agent keeps answering meanwhile."""
    engine = engines[1]
    tokens: dict[str, list[int]] = {}
    engine.add_request("inline", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))

    async def steps() -> list[bool]:
        ran: list[bool] = []
        async with loop_ticks() as ticks:
            for cap, exclusive in ((0.0, True), (10.0, True), (10.0, False)):
                config = dataclasses.replace(engine.config, inline_step_max_s=cap)
                monkeypatch.setattr(engine, "config", config)
                ticks.reset()
                result = await engine.step_async(exclusive=exclusive)
                ran.append(ticks.count > 0)
                for out in result.outputs:
                    tokens.setdefault(out.request_id, []).extend(out.token_ids)
        return ran

    assert asyncio.run(steps()) == [True, False, True]
    _step_collect(engine, tokens, steps=2)
    assert not engine.has_unfinished() and len(tokens["inline"]) == 5


# ----------------------------------------------- structured outputs, logit bias, prompt logprobs

#: a record the greedy random model writes for dozens of tokens (whitespace between JSON tokens is free)
RECORD = {
    "type": "object",
    "properties": {
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "kind": {"enum": ["book", "film", "song"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["year", "kind", "tags"],
    "additionalProperties": False,
}
CONSTRAINED = SamplingParams(
    max_tokens=90, structured=StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=json.dumps(RECORD))
)


def _continued(engine: Any, request_id: str, sampling: SamplingParams, generated: list[int]) -> list[int]:
    """A request taken over after ``generated`` (a rescue): all its tokens once it finishes here."""
    engine.add_request(request_id, PROMPT, sampling, output_token_ids=generated)
    tokens = list(generated)
    while engine.has_unfinished():
        for output in engine.step().outputs:
            assert output.request_id == request_id and output.first_index == len(tokens)
            tokens.extend(output.token_ids)
    return tokens


@needs_vllm
def test_a_constrained_request_continues_under_its_grammar_when_rescued_or_migrated(engines: Any) -> None:
    """vLLM's structured outputs on the engine: a continued request's grammar starts where the
    generated tokens left it (a fresh grammar would take the JSON generated so far as prompt and
    open a second object), so a rescue at any point and a migration in two stages mid-generation
    give the unmigrated greedy tokens."""
    source, destination = engines
    assert source.vllm_config.structured_outputs_config.backend == "auto"  # as `vllm serve` has it
    expected = _run(source, "ref", PROMPT, CONSTRAINED)
    assert expected != _run(source, "free", PROMPT, msgspec.structs.replace(CONSTRAINED, structured=None))
    assert len(expected) > 40
    for cut in (1, 7, 33):
        assert _continued(destination, f"rescued{cut}", CONSTRAINED, expected[:cut]) == expected
    tokens: dict[str, list[int]] = {}
    source.add_request("moving", PROMPT, CONSTRAINED)
    _step_collect(source, tokens, 10)
    full = source.request_stats("moving").num_computed_tokens // 32
    stage0 = destination.reserve(full)
    destination.import_blocks(stage0.block_ids, source.export_blocks("moving", range(full)))
    _step_collect(source, tokens, 12)
    source.suspend("moving")
    held = source.request_stats("moving").num_blocks
    stage1 = destination.reserve(held - full)
    destination.import_blocks(stage1.block_ids, source.export_blocks("moving", range(full, held)))
    generated = source.output_token_ids("moving")
    destination.admit_migrated("moving", PROMPT, generated, CONSTRAINED, 0, [stage0, stage1])
    source.release_request("moving")
    while destination.has_unfinished():
        _step_collect(destination, tokens)
    assert tokens["moving"] == expected
    assert source.stats().num_free_blocks == NUM_BLOCKS == destination.stats().num_free_blocks


@needs_vllm
@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        (StructuredKind.JSON_SCHEMA, "{not json", "Invalid JSON"),
        (StructuredKind.JSON_SCHEMA, json.dumps({"type": "strng"}), "strng"),
        (StructuredKind.REGEX, "[a-", "regex"),
        (StructuredKind.GRAMMAR, "root ::= (", "grammar"),
        (StructuredKind.CHOICE, "[]", "empty"),
        (StructuredKind.CHOICE, '"yes"', "list of strings"),
    ],
)
def test_a_constraint_vllm_refuses_is_a_rejection_and_the_engine_serves_on(
    engines: Any, kind: StructuredKind, spec: str, reason: str
) -> None:
    engine, _ = engines
    before = engine.stats().num_rejections
    bad = SamplingParams(max_tokens=8, structured=StructuredOutput(kind=kind, spec=spec))
    with pytest.raises(RequestRejected) as refused:
        engine.add_request("bad", PROMPT, bad)
    assert refused.value.reason is RejectReason.INVALID_SAMPLING and reason in refused.value.detail
    assert engine.stats().num_rejections == before + 1 and not engine.has_unfinished()
    choice = StructuredOutput(kind=StructuredKind.CHOICE, spec='["yes", "no"]')
    tokens = _run(engine, "good", PROMPT, SamplingParams(max_tokens=8, structured=choice))
    assert Tokenizer.from_file(str(engine.config.model) + "/tokenizer.json").decode(tokens) in ("yes", "no")


@needs_vllm
def test_logit_bias_and_min_p_steer_vllms_sampler_and_survive_a_rescue(engines: Any) -> None:
    engine, other = engines
    plain = _run(engine, "plain", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    forced = SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=((77, 100.0),))
    assert _run(engine, "forced", PROMPT, forced) == [77] * 12
    banned = SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=tuple((t, -100.0) for t in set(plain)))
    avoided = _run(engine, "banned", PROMPT, banned)
    assert not set(avoided) & set(plain)
    assert _continued(other, "banned-rescued", banned, avoided[:5]) == avoided
    # min_p 1: only the most likely token is left, so sampling at temperature 1 is greedy
    only_the_top = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, min_p=1.0)
    assert _run(engine, "min-p", PROMPT, only_the_top) == plain


@needs_vllm
def test_prompt_logprobs_equal_vllms_own_and_max_tokens_0_generates_nothing(
    engines: Any, vllm_own: tuple[list[int], list[dict[int, float] | None]]
) -> None:
    """Prompt logprobs (as ``echo`` with ``max_tokens`` 0 asks them) on a prompt vLLM's prefix cache
    holds: every position is computed, and equals vLLM's ``LLM.generate`` prompt logprobs."""
    engine, _ = engines
    _run(engine, "warm", PROMPT, SamplingParams(max_tokens=2))  # the prompt's blocks are cached now
    engine.add_request("echo", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=PROMPT_LOGPROBS))
    assert engine.migration_blocker("echo") is not None  # they come with its prefill, here
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step().outputs)
    (output,) = outputs
    assert (output.first_index, output.token_ids, output.finish_reason) == (0, (), FinishReason.LENGTH)
    assert output.num_cached_tokens == 0
    _, expected = vllm_own
    assert output.prompt_logprobs is not None and output.prompt_top_logprobs is not None
    assert len(output.prompt_logprobs) == len(PROMPT) == len(expected)
    assert output.prompt_logprobs[0] is None and expected[0] is None and output.prompt_top_logprobs[0] == ()
    for position in range(1, len(PROMPT)):
        wanted = expected[position]
        assert wanted is not None
        assert output.prompt_logprobs[position] == pytest.approx(wanted[PROMPT[position]], abs=1e-5)
        top = output.prompt_top_logprobs[position]
        assert len(top) == PROMPT_LOGPROBS
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        for token, value in top:
            assert value == pytest.approx(wanted[token], abs=1e-5)
    # a continued request does not ask again: they reached the client with its first output
    assert _continued(engine, "echo-rescued", SamplingParams(max_tokens=3, prompt_logprobs=2), [5])[0] == 5
    assert engine.stats().num_free_blocks == NUM_BLOCKS


@needs_vllm
def test_json_without_free_whitespace_when_the_request_asks(engines: Any) -> None:
    """vLLM's backends take whitespace from the engine's configuration; a request that asks for none
    (``any_whitespace`` false: tool calls, ``disable_any_whitespace``) gets JSON's compact form, and
    keeps it when rescued."""
    engine, other = engines
    tokenizer = Tokenizer.from_file(str(engine.config.model) + "/tokenizer.json")
    spaced = _run(engine, "spaced", PROMPT, CONSTRAINED)
    assert any(c in tokenizer.decode(spaced) for c in " \t\r\n")  # the random model loves whitespace
    compact = msgspec.structs.replace(
        CONSTRAINED, structured=msgspec.structs.replace(CONSTRAINED.structured, any_whitespace=False)
    )
    tokens = _run(engine, "compact", PROMPT, compact)
    text = tokenizer.decode(tokens)
    value = json.loads(text)
    jsonschema.validate(value, RECORD)
    assert text == json.dumps(value, separators=(",", ":"))
    assert _continued(other, "compact-rescued", compact, tokens[:6]) == tokens

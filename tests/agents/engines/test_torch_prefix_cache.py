"""TorchEngine with automatic prefix caching on the tiny preset: the same greedy text as without the
cache and as transformers, fewer prefill tokens for a repeated prompt, cached KV never overwritten,
and eviction under memory pressure that loses no request and frees no block in use."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest
import torch

from agents.engines.protocol import RequestOutput
from agents.engines.torch_engine import TorchEngine
from agents.engines.torch_engine.config import ModelConfig
from schemas import SamplingParams

BLOCK = 16


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 11 + 5) % 256 for i in range(n)]


def _run(engine: TorchEngine, request_id: str, prompt: list[int], sampling: SamplingParams) -> RequestOutput:
    """Serve one request alone to its end; its last output (num_cached_tokens, finish reason) with every
    token it generated."""
    engine.add_request(request_id, prompt, sampling)
    tokens: list[int] = []
    last: RequestOutput | None = None
    while engine.has_unfinished():
        for out in engine.step().outputs:
            assert out.request_id == request_id and out.first_index == len(tokens)
            tokens.extend(out.token_ids)
            last = out
    assert last is not None and last.finish_reason is not None
    return RequestOutput(
        request_id,
        0,
        tuple(tokens),
        last.finish_reason,
        last.num_prompt_tokens,
        num_cached_tokens=last.num_cached_tokens,
    )


def _hf_greedy(engine: TorchEngine, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' Llama with the engine's weights, greedy, no KV cache (every position recomputed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config: ModelConfig = engine.model_config
    shape: dict[str, Any] = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": False,
    }
    hf: Any = LlamaForCausalLM(LlamaConfig(**shape))  # type: ignore[no-untyped-call]
    hf.eval()
    assert engine.model is not None
    hf.load_state_dict(engine.model.state_dict(), strict=True)
    sequence = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = hf(torch.tensor([sequence])).logits[0, -1]
            sequence.append(int(logits.argmax()))
    return sequence[len(prompt) :]


def _conversation(
    engine: TorchEngine, turns: int, answer_tokens: int, sampling: SamplingParams | None = None
) -> list[tuple[list[int], RequestOutput]]:
    """Turn k's prompt is turn k-1's prompt, its answer and new user tokens; one turn after the other
    (greedy unless ``sampling`` says otherwise)."""
    sampling = sampling or SamplingParams(max_tokens=answer_tokens, ignore_eos=True)
    prompt = _prompt(37)
    history: list[tuple[list[int], RequestOutput]] = []
    for turn in range(turns):
        output = _run(engine, f"turn-{turn}", prompt, sampling)
        history.append((prompt, output))
        prompt = [*prompt, *output.token_ids, *_prompt(11 + 3 * turn, turn + 1)]
    return history


def test_multi_turn_greedy_text_is_the_same_with_the_cache_on_off_and_in_transformers() -> None:
    answer_tokens = 10
    cached = TorchEngine("tiny", num_blocks=64, prefix_cache=True)
    plain = TorchEngine("tiny", num_blocks=64, prefix_cache=False)
    with_cache = _conversation(cached, 4, answer_tokens)
    without = _conversation(plain, 4, answer_tokens)

    assert [out.token_ids for _, out in with_cache] == [out.token_ids for _, out in without]
    for prompt, out in with_cache:
        assert list(out.token_ids) == _hf_greedy(cached, prompt, answer_tokens)
    # Each later turn reuses every full block the turn before computed (its prompt and all of its
    # answer but the last token, which was sampled and never fed), up to all but its own last token.
    assert with_cache[0][1].num_cached_tokens == 0
    for (before, previous), (prompt, out) in pairwise(with_cache):
        computed_before = len(before) + len(previous.token_ids) - 1
        expected = min(computed_before // BLOCK, (len(prompt) - 1) // BLOCK) * BLOCK
        assert expected > 0 and out.num_cached_tokens == expected
    assert all(out.num_cached_tokens == 0 for _, out in without)
    stats = cached.stats()
    assert stats.prefix_cache_hits == sum(out.num_cached_tokens for _, out in with_cache)
    assert stats.prefix_cache_queries == sum(len(prompt) for prompt, _ in with_cache)
    assert plain.stats().prefix_cache_hits == 0 and plain.stats().num_cached_blocks == 0


def test_batch_invariant_cached_kv_is_bit_exact_so_seeded_sampling_is_unchanged() -> None:
    """In batch-invariant mode a position's KV depends on its tokens only, so the cached blocks hold
    what a recompute would: even temperature sampling draws the same tokens with the cache on and off."""
    sampling = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.95, seed=21)
    runs = [
        _conversation(
            TorchEngine("tiny", num_blocks=48, batch_invariant=True, prefix_cache=on), 3, 8, sampling
        )
        for on in (True, False)
    ]
    with_cache, without = runs
    assert [out.token_ids for _, out in with_cache] == [out.token_ids for _, out in without]
    assert all(out.num_cached_tokens > 0 for _, out in with_cache[1:])


@pytest.mark.parametrize(
    ("max_step_tokens", "core"),
    [(None, "thread"), (24, "thread"), (24, "process")],
    ids=["whole-prefill", "chunked", "chunked-core-process"],
)
def test_a_repeated_long_prompt_is_prefilled_from_its_cached_blocks(
    max_step_tokens: int | None, core: str
) -> None:
    """``max_step_tokens=24``: the first request's prompt is computed in chunks; the repeat's few
    uncached tokens fit one step. ``core="process"``: the step computes in a child process, on the
    KV pool it shares with this one."""
    prompt = _prompt(150, 3)
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = TorchEngine("tiny", num_blocks=64, max_step_tokens=max_step_tokens, core=core)
    try:
        first = _run(engine, "first", prompt, sampling)
        assert first.num_cached_tokens == 0

        engine.add_request("again", prompt, sampling)
        step = engine.step()
        assert step.num_prefill_tokens == len(prompt) - (len(prompt) - 1) // BLOCK * BLOCK  # 6 of 150
        (out,) = step.outputs
        assert out.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK >= len(prompt) - BLOCK
        tokens = list(out.token_ids)
        while engine.has_unfinished():
            tokens.extend(t for o in engine.step().outputs for t in o.token_ids)
        assert tokens == list(first.token_ids)
    finally:
        engine.close()


def test_cached_blocks_are_never_written_while_requests_share_them() -> None:
    """A request sharing a cached prefix computes only positions after it: the prefix's KV bytes in
    the pool stay as the first request left them while others read and extend that prefix."""
    engine = TorchEngine("tiny", num_blocks=48, max_step_tokens=40)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    prefix = _prompt(70, 5)
    _run(engine, "owner", prefix, sampling)
    cached = {block: engine.scheduler.blocks.block_hash(block) for block in range(48)}
    cached = {block: h for block, h in cached.items() if h is not None}
    assert len(cached) == (70 + 8 - 1) // BLOCK
    keys = {block: [layer[block].clone() for layer in engine.pool.keys] for block in cached}
    values = {block: [layer[block].clone() for layer in engine.pool.values] for block in cached}

    for i in range(4):  # four sharers at once: same prefix, own continuations, chunked prefills
        engine.add_request(f"sharer-{i}", [*prefix, *_prompt(20 + 9 * i, 10 + i)], sampling)
    while engine.has_unfinished():
        engine.step()
        for block, block_hash in cached.items():
            if engine.scheduler.blocks.block_hash(block) != block_hash:
                continue  # evicted and reused: no longer the prefix's
            for layer, (k, v) in enumerate(zip(engine.pool.keys, engine.pool.values, strict=True)):
                assert torch.equal(k[block], keys[block][layer]), f"cached block {block} was written"
                assert torch.equal(v[block], values[block][layer]), f"cached block {block} was written"
    assert engine.stats().prefix_cache_hits >= 4 * (70 // BLOCK) * BLOCK


def test_eviction_under_memory_pressure_loses_no_request_and_frees_no_block_in_use() -> None:
    """Ten blocks for many distinct prompts, then repeats (some of them running side by side on shared
    blocks): cached blocks are evicted to admit others, requests are preempted as they grow, and
    every request still ends with its own greedy text."""
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = {f"{kind}{i}": _prompt(20 + 5 * i, 10 * (kind == "b") + i) for kind in "ab" for i in range(4)}
    reference = TorchEngine("tiny", num_blocks=64, prefix_cache=False)
    expected = {
        rid: list(_run(reference, rid, prompt, sampling).token_ids) for rid, prompt in prompts.items()
    }

    engine = TorchEngine("tiny", num_blocks=10)
    blocks = engine.scheduler.blocks
    got: dict[str, list[int]] = {}
    finished: set[str] = set()
    most_sharers = 0
    waves = [
        ["a0", "a1", "a2", "a3"],
        ["a0", "a1", "a0", "a1"],
        ["b0", "b1", "b2", "b3"],
        ["a0", "b0", "a3", "b3"],
    ]
    for wave, ids in enumerate(waves):
        request_ids = [f"{rid}-{wave}{n}" for n, rid in enumerate(ids)]
        for rid, request_id in zip(ids, request_ids, strict=True):
            engine.add_request(request_id, prompts[rid], sampling)
        while engine.has_unfinished():
            for out in engine.step().outputs:
                tokens = got.setdefault(out.request_id, [])
                assert out.first_index == len(tokens)
                tokens.extend(out.token_ids)
                if out.finish_reason is not None:
                    finished.add(out.request_id)
            blocks.check_invariants()
            for request_id in request_ids:
                request = engine.scheduler.get(request_id)
                if request is not None and request.status.holds_blocks:
                    assert all(blocks.ref_count(b) > 0 for b in request.block_ids), request_id
                    most_sharers = max(most_sharers, *(blocks.ref_count(b) for b in request.block_ids))

    stats = engine.stats()
    assert finished == {f"{rid}-{wave}{n}" for wave, ids in enumerate(waves) for n, rid in enumerate(ids)}
    for request_id, tokens in got.items():
        assert tokens == expected[request_id.split("-")[0]], request_id
    assert stats.prefix_cache_evictions > 0 and stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0 and most_sharers >= 2  # blocks shared by running requests
    assert stats.num_free_blocks == 10 and blocks.num_allocated_blocks == 0

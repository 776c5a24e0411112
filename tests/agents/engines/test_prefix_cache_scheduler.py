"""The local scheduler's prefix cache, pure: which blocks a request reuses, which are evicted first,
what the cache delta reports, and that preempted, rescued and cache-off requests behave."""

from __future__ import annotations

from agents.engines.local_scheduler import LocalScheduler, LocalSchedulerConfig, SchedulerOutput
from agents.engines.protocol import RequestOutput
from schemas import SamplingParams
from schemas.block_hash import block_hashes

BLOCK = 4


def make(num_blocks: int, *, prefix_cache: bool = True) -> LocalScheduler:
    return LocalScheduler(
        LocalSchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_model_len=1024,
            vocab_size=100,
            prefix_cache=prefix_cache,
        )
    )


def step(sched: LocalScheduler, token: int = 7) -> tuple[SchedulerOutput, list[RequestOutput]]:
    plan = sched.schedule()
    ids = [p.request.request_id for p in plan.prefills if p.final] + [r.request_id for r in plan.decodes]
    return plan, sched.update_from_output(plan, dict.fromkeys(ids, token))


def serve(
    sched: LocalScheduler, request_id: str, prompt: list[int], max_tokens: int = 1
) -> list[RequestOutput]:
    """Add one request and step until nothing is left; every output."""
    sched.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens))
    outputs: list[RequestOutput] = []
    while sched.has_unfinished():
        outputs += step(sched)[1]
    return outputs


def tokens(n: int, salt: int) -> list[int]:
    return [(salt * 13 + i * 7) % 97 + 1 for i in range(n)]


def test_a_repeated_prompt_reuses_its_cached_blocks_and_computes_only_the_rest() -> None:
    sched = make(16)
    prompt = tokens(18, 1)
    (first,) = serve(sched, "first", prompt)
    assert first.num_cached_tokens == 0
    sched.add_request("again", prompt, SamplingParams(max_tokens=1))
    plan, (again,) = step(sched)
    assert [(p.start, p.end) for p in plan.prefills] == [(16, 18)] and plan.num_prefill_tokens == 2
    assert again.num_cached_tokens == 16
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (36, 16)


def test_a_prompt_of_whole_blocks_leaves_its_last_token_to_compute() -> None:
    sched = make(16)
    prompt = tokens(16, 2)
    serve(sched, "first", prompt)
    sched.add_request("again", prompt, SamplingParams(max_tokens=1))
    plan, (again,) = step(sched)
    assert [(p.start, p.end) for p in plan.prefills] == [(12, 16)]  # 3 of 4 blocks: it samples from 15
    assert again.num_cached_tokens == 12


def test_eviction_takes_never_cached_blocks_first_then_the_least_recently_freed_tail_first() -> None:
    sched = make(6)
    a = tokens(16, 3)
    serve(sched, "a", a)  # 4 cached blocks, freed tail first; 2 never-cached free ones
    chain = block_hashes(a, BLOCK)
    assert sched.take_cache_delta().stored == tuple(chain)
    serve(sched, "b", tokens(12, 4))  # 3 blocks: the 2 never cached, then a's last block
    delta = sched.take_cache_delta()
    assert delta.removed == (chain[3],) and sched.blocks.num_evictions == 1
    assert sched.blocks.lookup(chain) == sched.blocks.lookup(chain[:3])  # a's head survives
    sched.add_request("a-longer", [*a, 5], SamplingParams(max_tokens=1))  # could hit all 4 blocks
    plan, (out,) = step(sched)
    assert out.num_cached_tokens == 12 and (plan.prefills[0].start, plan.prefills[0].end) == (12, 17)


def test_cache_delta_is_net_since_the_last_take() -> None:
    sched = make(4)
    sched.take_cache_delta()
    d = tokens(8, 5)
    serve(sched, "d", d)  # stores 2 hashes ...
    e = tokens(16, 6)
    serve(sched, "e", e)  # ... which e's 4 blocks evict before anyone takes the delta
    delta = sched.take_cache_delta()
    assert delta.stored == tuple(block_hashes(e, BLOCK)) and delta.removed == () and not delta.cleared
    assert sched.take_cache_delta().stored == () and not sched.take_cache_delta()  # nothing since
    f = tokens(8, 7)
    serve(sched, "f", f)  # evicts e's two tail blocks
    delta = sched.take_cache_delta()
    assert delta.stored == tuple(block_hashes(f, BLOCK))
    assert set(delta.removed) == set(block_hashes(e, BLOCK)[2:])
    serve(sched, "e-again", tokens(16, 6))  # takes e's head again, stores its tail again
    assert set(sched.take_cache_delta().stored) == set(block_hashes(e, BLOCK)[2:])


def test_a_preempted_request_is_readmitted_on_its_own_cached_blocks() -> None:
    sched = make(5)
    sched.add_request("older", tokens(8, 8), SamplingParams(max_tokens=3))
    sched.add_request("newer", tokens(8, 9), SamplingParams(max_tokens=4))
    step(sched)  # both prefilled: 4 blocks, their prompt blocks cached
    own = list(sched.request("newer").block_ids)
    plan, _ = step(sched)  # older grows into the last free block; newer, growing too, is preempted
    assert plan.preempted == ["newer"]
    outputs: list[RequestOutput] = []
    readmitted: tuple[int, int, list[int]] | None = None
    while sched.has_unfinished():
        plan, out = step(sched)
        for prefill in plan.prefills:
            if prefill.request.request_id == "newer":
                readmitted = (prefill.start, prefill.end, list(prefill.request.block_ids[:2]))
        outputs += out
    assert readmitted == (8, 9, own[:2])  # its prompt's blocks are its own, not computed again
    assert sched.prefix_cache_hits == 8
    newer = [o for o in outputs if o.request_id == "newer"]
    assert len(newer) == 3 and newer[-1].finish_reason is not None
    assert all(o.num_cached_tokens == 0 for o in newer)  # reported from its first admission


def test_a_rescued_request_reuses_the_blocks_of_its_prompt_and_generated_tokens() -> None:
    """A request taken over with its generated tokens (``output_token_ids``) finds the blocks an
    earlier request with the same text computed, generated tokens included."""
    sched = make(16)
    prompt = tokens(10, 10)
    outputs = serve(sched, "original", prompt, max_tokens=8)
    generated = [t for o in outputs for t in o.token_ids]
    assert len(generated) == 8  # 17 of its 18 tokens computed: 4 full blocks cached
    sched.add_request("rescued", prompt, SamplingParams(max_tokens=8), output_token_ids=generated[:5])
    plan, (out,) = step(sched)
    assert out.num_cached_tokens == 12 and (plan.prefills[0].start, plan.prefills[0].end) == (12, 15)
    assert out.first_index == 5


def test_with_the_cache_off_nothing_is_cached_or_reused() -> None:
    sched = make(16, prefix_cache=False)
    prompt = tokens(18, 11)
    serve(sched, "first", prompt)
    sched.add_request("again", prompt, SamplingParams(max_tokens=1))
    plan, (again,) = step(sched)
    assert [(p.start, p.end) for p in plan.prefills] == [(0, 18)] and again.num_cached_tokens == 0
    assert (sched.prefix_cache_hits, sched.blocks.num_cached_blocks, sched.blocks.num_evictions) == (0, 0, 0)
    assert not sched.take_cache_delta() and sched.cached_block_hashes() == []


def test_the_load_snapshot_counts_the_cached_blocks_of_queued_prompts() -> None:
    sched = make(16)
    prompt = tokens(18, 3)
    serve(sched, "first", prompt)
    assert sched.stats().waiting_cached_blocks == 0
    sched.add_request("again", prompt, SamplingParams(max_tokens=1))  # queued until the next step
    sched.add_request("other", tokens(18, 4), SamplingParams(max_tokens=1))
    assert sched.stats().waiting_cached_blocks == 4  # 16 of "again"'s 18 tokens; none of "other"'s
    assert make(16, prefix_cache=False).stats().waiting_cached_blocks == 0

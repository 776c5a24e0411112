"""The agent's token deltas say how many prompt tokens its engine found in its prefix cache."""

from __future__ import annotations

from agents.deltas import DeltaBuffer
from agents.engines.sim import SimEngine
from schemas import GenerateRequest, SamplingParams, TokenDelta
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, greedy

#: 41 prompt tokens in blocks of 4 (tiny-test; not the warm-up's): a repeat finds 10 blocks cached
PROMPT = tuple(range(501, 542))


async def test_a_repeated_prompt_s_deltas_carry_its_cached_tokens_streamed_or_not(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        engine = SimEngine("tiny-test", num_blocks=64, time_scale=10.0, prefix_cache=True)
        await cluster.add(engine, fast_agent_config("a1"))
        cached: dict[str, list[int]] = {}
        for request_id, stream in (("first", True), ("again", True), ("again-whole", False)):
            watcher = await cluster.watch(request_id)
            request = GenerateRequest(
                request_id=request_id, token_ids=PROMPT, sampling=greedy(6), stream=stream
            )
            assert (await cluster.generate("a1", request)).accepted
            await watcher.wait_finished()
            cached[request_id] = [d.num_cached_tokens for d in watcher.deltas]
            await watcher.close()
        assert cached["first"] and set(cached["first"]) == {0}
        assert len(cached["again"]) > 1 and set(cached["again"]) == {40}  # every delta says it
        assert cached["again-whole"] == [40]  # one delta with all tokens at the end


def test_a_resent_delta_keeps_its_cached_tokens() -> None:
    buffer = DeltaBuffer(steps_per_request=4, finished_limit=1)
    buffer.open(
        "r", owner_epoch=0, stream=True, prompt_token_ids=PROMPT, sampling=SamplingParams(), priority=0
    )
    buffer.record(
        TokenDelta(
            request_id="r",
            instance_id="a",
            owner_epoch=0,
            first_index=0,
            token_ids=(7, 8),
            num_prompt_tokens=41,
            num_cached_tokens=40,
        )
    )
    resent = buffer.resend("r", 1)
    assert resent is not None and [(d.token_ids, d.num_cached_tokens) for d in resent] == [((8,), 40)]

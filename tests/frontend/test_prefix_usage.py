"""Prefix caching as a client and the scheduler see it through the frontend.

A repeated long prompt's answer says, in OpenAI's ``usage.prompt_tokens_details.cached_tokens``,
how many of its tokens the engine found in its prefix cache (torch agents, the official
``openai`` client over real HTTP), streamed or not, for completions and chat; the count stays
the first instance's when the request moves. Each dispatch the frontend asks of the scheduler
carries the prompt's block-hash chain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest

from frontend.gateway import Chain, Job, RequestStream, common_block_size
from schemas import Codec, DispatchReply, DispatchRequest, SamplingParams
from schemas.block_hash import block_hashes
from tests.frontend.cluster import Cluster, frontend_cluster

#: the torch ``tiny`` model's KV block size
BLOCK_SIZE = 16


def _prompt(tag: str) -> str:
    """About 200 bytes (byte tokenizer: tokens) that no other prompt of the session starts with."""
    return f"{tag}: " + " ".join(f"word{i}" for i in range(30))


def _cached(usage: Any) -> int:
    assert usage.prompt_tokens_details is not None, usage
    return int(usage.prompt_tokens_details.cached_tokens)


def _hit(usage: Any) -> bool:
    """All but the last (partial) block of the prompt came from the cache."""
    return usage.prompt_tokens - BLOCK_SIZE <= _cached(usage) < usage.prompt_tokens


async def _completion(client: Any, prompt: str, *, stream: bool, max_tokens: int = 2) -> Any:
    if not stream:
        return (
            await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
        ).usage
    usage = None
    chunks = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
    return usage


async def _chat(client: Any, prompt: str, *, stream: bool) -> Any:
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        return (await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)).usage
    usage = None
    chunks = await client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
    return usage


@pytest.fixture
async def one_agent(nats_url: str) -> AsyncIterator[tuple[str, Any]]:
    """The frontend's URL and an ``openai`` client of it, on one torch agent."""
    async with frontend_cluster(nats_url, instances=1, engine="torch", max_model_len=512) as cluster:
        url = await cluster.serve()
        client = cluster.openai(url)
        try:
            yield url, client
        finally:
            await client.close()


async def test_a_repeated_prompt_s_usage_counts_its_cached_tokens(one_agent: tuple[str, Any]) -> None:
    url, client = one_agent
    first = await _completion(client, _prompt("completions"), stream=True)
    assert _cached(first) == 0 and first.prompt_tokens > 10 * BLOCK_SIZE
    assert _hit(await _completion(client, _prompt("completions"), stream=False))
    assert _hit(await _completion(client, _prompt("completions"), stream=True))
    assert _cached(await _completion(client, _prompt("completions, unstreamed"), stream=False)) == 0

    assert _cached(await _chat(client, _prompt("chat"), stream=False)) == 0
    assert _hit(await _chat(client, _prompt("chat"), stream=True))
    assert _cached(await _chat(client, _prompt("chat, streamed"), stream=True)) == 0
    assert _hit(await _chat(client, _prompt("chat, streamed"), stream=False))

    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{url}/metrics")).text
    counted = re.search(r"^shoal_prompt_cached_tokens_total (\S+)$", metrics, re.MULTILINE)
    assert counted is not None and float(counted.group(1)) >= 4 * 10 * BLOCK_SIZE


async def _pin_dispatch(cluster: Cluster, order: list[str], asks: list[DispatchRequest]) -> Any:
    """Answer the frontend's dispatches as a scheduler would: the first instance of ``order`` not
    excluded; every ask is kept in ``asks``."""
    gateway = cluster.gateway
    assert gateway is not None
    codec = Codec()

    async def dispatch(data: bytes, headers: dict[str, str]) -> bytes:
        ask = codec.decode(data).body
        assert isinstance(ask, DispatchRequest)
        asks.append(ask)
        chosen = next(i for i in order if i not in ask.exclude)
        return codec.encode(DispatchReply(request_id=ask.request_id, instance_id=chosen, epoch=1), time=0.0)

    return await gateway.bus.serve(cluster.subjects.rpc_dispatch, dispatch)


async def _moved_mid_stream(cluster: Cluster, client: Any, prompt: str, move: Callable[[str], Any]) -> Any:
    """Stream ``prompt`` (60 tokens) and ``move`` it once its first token came; its usage."""
    gateway = cluster.gateway
    assert gateway is not None
    cluster.pace.min_step_s = 0.02  # still running after the move: 60 tokens >= 1.2 s
    task = asyncio.ensure_future(_completion(client, prompt, stream=True, max_tokens=60))
    async with asyncio.timeout(30):
        while not any(s.generated for s in gateway.streams.values()):
            await asyncio.sleep(0.005)
    request_id = next(rid for rid, s in gateway.streams.items() if s.generated)
    await move(request_id)
    cluster.pace.release()
    return await asyncio.wait_for(task, 60)


@pytest.mark.slow
async def test_cached_tokens_stay_the_first_instance_s_when_the_request_migrates_or_is_rescued(
    nats_url: str,
) -> None:
    """The instance it moves to has nothing cached (it reports 0): the answer keeps i0's count."""
    async with frontend_cluster(nats_url, instances=2, engine="torch", max_model_len=512) as cluster:
        service = await _pin_dispatch(cluster, ["i0", "i1"], [])
        url = await cluster.serve()
        client = cluster.openai(url)
        try:
            for prompt in (_prompt("migrated"), _prompt("rescued")):
                assert _cached(await _completion(client, prompt, stream=False)) == 0  # cached on i0

            async def migrate(request_id: str) -> None:
                outcome = await cluster.agents["i0"].migrate(request_id, "i1")
                assert outcome.migrated, outcome

            migrated = await _moved_mid_stream(cluster, client, _prompt("migrated"), migrate)
            assert migrated.completion_tokens == 60 and _hit(migrated)

            async def kill(request_id: str) -> None:
                await cluster.agents["i0"].kill()

            rescued = await _moved_mid_stream(cluster, client, _prompt("rescued"), kill)
            assert rescued.completion_tokens == 60 and _hit(rescued)
            async with httpx.AsyncClient() as http:
                metrics = (await http.get(f"{url}/metrics")).text
            assert 'shoal_rescues_total{cause="failed"} 1.0' in metrics
        finally:
            await client.close()
            await service.stop()


async def test_each_dispatch_carries_the_prompt_s_block_hash_chain(nats_url: str) -> None:
    """The chain is the instances' block size (sim tiny-test: 4) unless configured; 0 sends none."""
    async with frontend_cluster(nats_url, instances=1) as cluster, cluster.client() as client:
        asks: list[DispatchRequest] = []
        service = await _pin_dispatch(cluster, ["i0"], asks)
        gateway = cluster.gateway
        assert gateway is not None
        prompt = list(range(1, 40))
        body = {"model": "sim:tiny-test", "prompt": prompt, "max_tokens": 2, "n": 2}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert len(asks) == 2  # one per choice, the same chain
        assert all(a.block_size == 4 and a.block_hashes == tuple(block_hashes(prompt, 4)) for a in asks)
        assert len(asks[0].block_hashes) == 9

        for configured, expected in ((8, tuple(block_hashes(prompt, 8))), (0, ())):
            gateway.config = dataclasses.replace(gateway.config, prefix_block_size=configured)
            asks.clear()
            assert (await client.post("/v1/completions", json={**body, "n": 1})).status_code == 200
            assert [(a.block_size, a.block_hashes) for a in asks] == [(configured, expected)]
        await service.stop()


def test_a_rescue_s_chain_extends_the_prompt_s_over_the_tokens_generated() -> None:
    prompt = tuple(range(100, 150))
    job = Job(
        request_id="r",
        prompt_ids=prompt,
        sampling=SamplingParams(),
        chain=Chain(16, tuple(block_hashes(prompt, 16))),
    )
    stream = RequestStream(SimpleNamespace(clock=lambda: 0.0), job)  # type: ignore[arg-type]
    generated = tuple(range(30))
    assert stream._chain(generated) == Chain(16, tuple(block_hashes(prompt + generated, 16)))
    unhashed = msgspec.structs.replace(job, chain=Chain())
    assert RequestStream(SimpleNamespace(clock=lambda: 0.0), unhashed)._chain(generated) == Chain()  # type: ignore[arg-type]


def test_without_a_configured_block_size_the_chain_uses_the_one_most_instances_announce() -> None:
    assert common_block_size([16, 32, 16]) == 16
    assert common_block_size([32, 16]) == 16  # a tie: the smaller
    assert common_block_size([]) == 0

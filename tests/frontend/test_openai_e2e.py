"""The official ``openai`` client against shoal (real agents with the torch ``tiny`` model, real NATS).

Completions and chat, streaming and not, stop strings, max_tokens, seeds and
usage; a migration forced mid-stream and an agent killed mid-stream are
invisible to the client (greedy text equals an undisturbed run); a lost delta
is repaired by a resend; a client that disconnects frees its blocks.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.frontend.cluster import Cluster, disconnect_after_first_text, frontend_cluster

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"


@pytest.fixture(scope="module", params=["plain", "secure"])
async def cluster(request: pytest.FixtureRequest, nats_url: str) -> AsyncIterator[Cluster]:
    """``secure``: agents and the frontend each on their own NATS user (role permissions, mutual TLS)."""
    secure = request.getfixturevalue("secure_nats") if request.param == "secure" else None
    options: dict[str, Any] = {"engine": "torch", "max_model_len": 512, "secure": secure}
    async with frontend_cluster(nats_url, instances=2, **options) as running:
        running.base_url = await running.serve()  # type: ignore[attr-defined]
        yield running
        # every component stayed inside its role's permissions through every test
        assert all(bus.permission_violations == {} for bus in running.buses)


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[Any]:
    openai_client = cluster.openai(cluster.base_url)  # type: ignore[attr-defined]
    yield openai_client
    await openai_client.close()


async def _stream_text(client: Any, **kwargs: Any) -> tuple[str, list[str], Any]:
    parts: list[str] = []
    finish: list[str] = []
    usage = None
    stream = await client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                             stream_options={"include_usage": True}, **kwargs)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.text)
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return "".join(parts), finish, usage


async def test_completions_streaming_and_not_agree_and_count_usage(cluster: Cluster, client: Any) -> None:
    plain = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert plain.usage.prompt_tokens == len(PROMPT.encode())
    assert plain.usage.completion_tokens == 24
    assert plain.choices[0].finish_reason == "length"
    text, finish, usage = await _stream_text(client, max_tokens=24, temperature=0)
    assert text == plain.choices[0].text
    assert finish == ["length"]
    assert usage.completion_tokens == 24 and usage.total_tokens == 24 + len(PROMPT.encode())


async def test_chat_streaming_and_not(cluster: Cluster, client: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    reply = await client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12,
                                                 temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == 12
    stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                  temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(pieces) == reply.choices[0].message.content


async def test_stop_string_ends_the_text_before_it(cluster: Cluster, client: Any) -> None:
    full = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    text = full.choices[0].text
    stop = next((text[i : i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2]), None)
    assert stop is not None
    cut = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                          stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed, finish, _ = await _stream_text(client, max_tokens=40, temperature=0, stop=stop)
    assert streamed == text[: text.index(stop)] and finish == ["stop"]


async def test_stop_token_ids_end_the_text_at_that_token(cluster: Cluster, client: Any) -> None:
    # vLLM's extension: generation ends at the first of these tokens, whose text is kept (as vLLM keeps
    # a stop token that is not special). The tiny model's tokens are bytes: an ASCII character is one.
    full = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    text = full.choices[0].text
    at = next((i for i in range(2, len(text)) if text[i].isascii() and text[i].isprintable()), None)
    assert at is not None, text
    at = text.index(text[at])  # its first occurrence: the first token with that id
    cut = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                          extra_body={"stop_token_ids": [ord(text[at])]})
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (text[: at + 1], "stop")
    streamed, finish, _ = await _stream_text(client, max_tokens=40, temperature=0,
                                             extra_body={"stop_token_ids": [ord(text[at])]})
    assert (streamed, finish) == (text[: at + 1], ["stop"])


async def test_n_choices_are_each_a_request_and_stream_by_index(cluster: Cluster, client: Any) -> None:
    # choice i of a seeded request samples as a request of its own with seed + i (vLLM's rule); the
    # prompt counts once in the usage, every choice's tokens count
    asked = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0}
    three = await client.completions.create(n=3, seed=40, **asked)
    alone = [(await client.completions.create(seed=40 + i, **asked)).choices[0].text for i in range(3)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == alone and len(set(alone)) == 3
    assert (three.usage.prompt_tokens, three.usage.completion_tokens) == (len(PROMPT.encode()), 36)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    with_usage = {"include_usage": True}
    stream = await client.completions.create(n=3, seed=40, stream=True, stream_options=with_usage, **asked)
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finish.update({choice.index: choice.finish_reason} if choice.finish_reason else {})
    assert [texts[i] for i in range(3)] == alone and finish == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 36
    chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, n=2, stream=True)
    chunks = [chunk async for chunk in chat]
    roles = [c.index for chunk in chunks for c in chunk.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1]  # each choice opens with its role


async def test_several_prompts_are_answered_in_order_n_choices_each(cluster: Cluster, client: Any) -> None:
    prompts = [PROMPT, "Another prompt"]
    asked = {"model": "tiny", "max_tokens": 10, "temperature": 0}
    alone = [(await client.completions.create(prompt=p, **asked)).choices[0].text for p in prompts]
    batch = await client.completions.create(prompt=prompts, n=2, **asked)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [alone[0], alone[0], alone[1], alone[1]]  # greedy: n alike
    assert batch.usage.prompt_tokens == sum(len(p.encode()) for p in prompts)  # each prompt once
    assert batch.usage.completion_tokens == 40
    ids = await client.completions.create(prompt=[list(PROMPT.encode())], **asked)  # token ids, in a list
    assert ids.choices[0].text == alone[0]
    texts: dict[int, str] = {}
    async for chunk in await client.completions.create(prompt=prompts, stream=True, **asked):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: alone[0], 1: alone[1]}


async def test_logprobs_with_alternatives_streamed_or_not(cluster: Cluster, client: Any) -> None:
    asked = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
             "temperature": 0, "logprobs": True, "top_logprobs": 4}
    whole = (await client.chat.completions.create(**asked)).choices[0].logprobs.content
    streamed = [t for chunk in [c async for c in await client.chat.completions.create(stream=True, **asked)]
                for choice in chunk.choices if choice.logprobs for t in choice.logprobs.content]
    assert len(whole) == 8
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]
    for token in whole:  # greedy: the pick is the most likely; the 4 come most likely first
        values = [a.logprob for a in token.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert (token.top_logprobs[0].token, values[0]) == (token.token, token.logprob)
    completion = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                                 logprobs=2)
    lp = completion.choices[0].logprobs
    assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))


async def test_seeds_reproduce_sampled_text(cluster: Cluster, client: Any) -> None:
    runs = [await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0,
                                            seed=seed) for seed in (7, 7, 8)]
    texts = [r.choices[0].text for r in runs]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


async def _owner_after_first_token(cluster: Cluster, before: set[str]) -> tuple[str, str]:
    gateway = cluster.gateway
    assert gateway is not None
    for _ in range(400):
        for request_id, stream in list(gateway.streams.items()):
            if request_id not in before and stream.generated and stream.owner_id:
                return request_id, stream.owner_id
        await asyncio.sleep(0.005)
    raise AssertionError("no request produced a token")


async def test_migration_mid_stream_is_invisible(cluster: Cluster, client: Any) -> None:
    reference, _, _ = await _stream_text(client, max_tokens=150, temperature=0)
    before = set(cluster.gateway.streams)  # type: ignore[union-attr]
    cluster.pace.min_step_s = 0.01  # still running when the migration ends: 150 tokens >= 1.5 s
    task = asyncio.ensure_future(_stream_text(client, max_tokens=150, temperature=0))
    request_id, owner = await _owner_after_first_token(cluster, before)
    other = next(i for i in cluster.agents if i != owner)
    outcome = await cluster.agents[owner].migrate(request_id, other)
    cluster.pace.release()
    text, finish, usage = await task
    assert outcome.migrated, outcome
    assert text == reference
    assert usage.completion_tokens == 150 and finish == ["length"]
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{cluster.base_url}/metrics")).text  # type: ignore[attr-defined]
    observed = re.search(r"^shoal_migrations_observed_total (\S+)$", metrics, re.MULTILINE)
    assert observed is not None and float(observed.group(1)) >= 1


async def test_lost_delta_is_repaired_by_resend(cluster: Cluster, client: Any) -> None:
    reference, _, _ = await _stream_text(client, max_tokens=30, temperature=0)
    dropped: list[str] = []
    originals = {}
    for instance_id, agent in cluster.agents.items():
        original = agent.bus.publish
        originals[instance_id] = original

        async def lossy(
            subject: str, data: bytes, *, headers: Any = None, _original: Any = original, _agent: Any = agent
        ) -> None:
            if ".tokb." in subject and not dropped:  # the frontend's subject: one batch per step
                envelope = _agent.codec.decode_or_none(data)
                deltas = getattr(envelope.body, "deltas", ()) if envelope is not None else ()
                if any(delta.first_index == 5 for delta in deltas):
                    dropped.append(subject)
                    return
            await _original(subject, data, headers=headers)

        agent.bus.publish = lossy  # type: ignore[method-assign]
    try:
        text, _, usage = await _stream_text(client, max_tokens=30, temperature=0)
    finally:
        for instance_id, agent in cluster.agents.items():
            agent.bus.publish = originals[instance_id]  # type: ignore[method-assign]
    assert dropped, "the test did not drop a delta"
    assert text == reference and usage.completion_tokens == 30


async def test_client_disconnect_aborts_and_frees_blocks(cluster: Cluster, client: Any) -> None:
    url = cluster.base_url  # type: ignore[attr-defined]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True, "temperature": 0}
    cluster.pace.min_step_s = 0.01  # still running when the client hangs up: 400 tokens >= 4 s
    try:
        await disconnect_after_first_text(cluster, url, body, polls=200)
    finally:
        cluster.pace.release()
    assert not any(agent.engine.has_unfinished() for agent in cluster.agents.values())
    free = [agent.engine.stats().num_free_blocks for agent in cluster.agents.values()]
    total = [agent.engine.stats().num_total_blocks for agent in cluster.agents.values()]
    assert free == total

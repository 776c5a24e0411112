"""Structured outputs, logit_bias and min_p with the official ``openai`` client against shoal (real
agents with the torch ``tiny`` model, real NATS).

50 random JSON schemas (seeded: nested objects, arrays, enums, bounded integers and numbers,
strings with maxLength) answered through chat completions, streamed and not: every answer parses
and validates. ``json_object``, vLLM's ``regex`` and ``choice``, the client's ``parse`` with a
pydantic model, a bad schema's 400, logit_bias and min_p changing what a greedy or sampled request
returns, and a constrained greedy request migrated mid-generation returning the unmigrated text.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import AsyncIterator
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.frontend.cluster import Cluster, frontend_cluster

pytestmark = pytest.mark.slow

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Give me the record as JSON."}]
PROMPT = "Once upon a time"

#: The random model's likeliest token is often a whitespace byte, which JSON allows between any two
#: tokens: unbiased, it repeats one until max_tokens. -100 takes them out wherever anything else fits.
NO_WHITESPACE = {str(ord(c)): -100 for c in " \t\n\r"}
#: A string that may hold anything ends only when '"' comes; this makes it come soon.
CLOSE_STRINGS = {str(ord('"')): 6, str(ord("}")): 6}

_WORDS = ("id", "name", "size", "tags", "kind", "score", "owner", "items", "level", "note", "rank", "flag")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A JSON schema a random model finishes: every string, array and number is bounded, objects are
    closed and require all their properties, nesting stops at depth 3."""
    kinds = ["integer", "number", "string", "boolean", "enum"] + (
        ["object", "array"] * 2 if depth < 3 else []
    )
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "object":
        names = rng.sample(_WORDS, rng.randint(1, 3))
        return {
            "type": "object",
            "properties": {name: random_schema(rng, depth + 1) for name in names},
            "required": names,
            "additionalProperties": False,
        }
    if kind == "array":
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 2),
        }
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, 42, "x y"], rng.randint(2, 4))}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        low = rng.choice([-10.5, 0, 1, 100])
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([0.5, 1, 1000])}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    return {"type": "boolean"}


@pytest.fixture(scope="module")
async def cluster(nats_url: str) -> AsyncIterator[Cluster]:
    options = {"num_blocks": 1024, "max_model_len": 2048}
    async with frontend_cluster(
        nats_url, instances=2, engine="torch", engine_options=options, max_model_len=2048
    ) as running:
        running.base_url = await running.serve()  # type: ignore[attr-defined]
        yield running


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[Any]:
    openai_client = cluster.openai(cluster.base_url)  # type: ignore[attr-defined]
    yield openai_client
    await openai_client.close()


def _json_schema(schema: dict[str, Any], name: str = "record") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def _chat_stream(client: Any, **kwargs: Any) -> tuple[str, list[str]]:
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kwargs)
    parts, finish = [], []
    async for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return "".join(parts), finish


async def test_fifty_random_schemas_streamed_and_not_parse_and_validate(client: Any) -> None:
    rng = random.Random(39)
    schemas = [random_schema(rng) for _ in range(50)]
    options = [
        {
            "response_format": _json_schema(s),
            "max_tokens": 440,
            "temperature": 1.0,
            "seed": i,
            "logit_bias": NO_WHITESPACE,
        }
        for i, s in enumerate(schemas)
    ]
    # 40 at once: more than the two agents' batches (32 each) could be refused for want of KV blocks
    slots = asyncio.Semaphore(40)

    async def plain(o: dict[str, Any]) -> Any:
        async with slots:
            return await client.chat.completions.create(model=MODEL, messages=MESSAGES, **o)

    async def streamed(o: dict[str, Any]) -> tuple[str, list[str]]:
        async with slots:
            return await _chat_stream(client, **o)

    replies, streams = await asyncio.gather(
        asyncio.gather(*(plain(o) for o in options)), asyncio.gather(*(streamed(o) for o in options))
    )
    unfinished = [
        (schema, reply.choices[0].message.content)
        for schema, reply in zip(schemas, replies, strict=True)
        if reply.choices[0].finish_reason != "stop"
    ]
    assert not unfinished, (len(unfinished), unfinished[:3])
    for schema, reply, (text, finish) in zip(schemas, replies, streams, strict=True):
        content = reply.choices[0].message.content
        jsonschema.validate(json.loads(content), schema)
        assert finish == ["stop"]
        assert text == content  # the same seed: the stream reassembles into the same JSON


async def test_json_object_returns_an_object(client: Any) -> None:
    reply = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=440,
        temperature=1.0,
        seed=3,
        logit_bias={**NO_WHITESPACE, **CLOSE_STRINGS},
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].text
    assert isinstance(json.loads(reply.choices[0].text), dict)


async def test_regex_and_choice_through_structured_outputs(client: Any) -> None:
    regex = "[a-z]{3}-[0-9]{2,4}"
    choices = ["yes", "no", "maybe later"]
    for temperature in (0.0, 1.0):
        matched = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=32,
            temperature=temperature,
            seed=1,
            extra_body={"structured_outputs": {"regex": regex}},
        )
        assert re.fullmatch(regex, matched.choices[0].text), matched.choices[0].text
        assert matched.choices[0].finish_reason == "stop"
        chosen = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=32,
            temperature=temperature,
            seed=1,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert chosen.choices[0].message.content in choices
        assert chosen.choices[0].finish_reason == "stop"


class Pet(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    tags: list[Literal["small", "loud"]] = Field(max_length=2)


async def test_parse_with_a_pydantic_model(client: Any) -> None:
    completion = await client.chat.completions.parse(
        model=MODEL,
        messages=MESSAGES,
        response_format=Pet,
        max_tokens=440,
        temperature=1.0,
        seed=5,
        logit_bias=NO_WHITESPACE,
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet)
    assert pet == Pet.model_validate_json(completion.choices[0].message.content)


async def test_a_bad_schema_is_a_400_naming_response_format(client: Any) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            response_format=_json_schema({"type": "objekt"}, "broken"),
        )
    error = caught.value.body
    assert error["param"] == "response_format"  # type: ignore[index]
    assert "broken" in error["message"] and "objekt" in error["message"]  # type: ignore[index]


async def test_logit_bias_forces_and_forbids_a_token(client: Any) -> None:
    forced = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={"97": 100}
    )
    assert forced.choices[0].text == "a" * 8
    # a prompt whose greedy first token is a printable ASCII byte (so its id is its code)
    prompts = [f"{PROMPT} {k}" for k in range(12)]
    firsts = await asyncio.gather(
        *(client.completions.create(model=MODEL, prompt=p, max_tokens=1, temperature=0) for p in prompts)
    )
    prompt, first = next(
        (p, r.choices[0].text)
        for p, r in zip(prompts, firsts, strict=True)
        if len(r.choices[0].text) == 1 and r.choices[0].text.isprintable() and r.choices[0].text.isascii()
    )
    banned = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(ord(first)): -100}
    )
    assert banned.choices[0].text != first


async def test_min_p_one_keeps_only_the_most_likely_token(client: Any) -> None:
    greedy = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    sampled = await asyncio.gather(
        *(
            client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=16,
                temperature=1.0,
                seed=seed,
                extra_body={"min_p": 1.0},
            )
            for seed in range(3)
        )
    )
    assert {r.choices[0].text for r in sampled} == {greedy.choices[0].text}
    free = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=0)
    assert free.choices[0].text != greedy.choices[0].text  # min_p is what made them greedy


async def _owner_after_first_token(cluster: Cluster, before: set[str]) -> tuple[str, str]:
    for _ in range(2000):
        for request_id, stream in list(cluster.gateway.streams.items()):  # type: ignore[union-attr]
            if request_id not in before and stream.generated and stream.owner_id:
                return request_id, stream.owner_id
        await asyncio.sleep(0.005)
    raise AssertionError("no request produced a token")


async def test_a_constrained_request_migrated_mid_generation_returns_the_unmigrated_text(
    cluster: Cluster, client: Any
) -> None:
    # at least 60 strings: the grammar constrains every one of the 150 tokens
    schema = {
        "type": "object",
        "properties": {
            "words": {"type": "array", "minItems": 60, "items": {"type": "string", "maxLength": 6}}
        },
        "required": ["words"],
        "additionalProperties": False,
    }
    # compact JSON: greedy, a random model could otherwise repeat the whitespace JSON allows
    options = {
        "extra_body": {"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
        "max_tokens": 150,
        "temperature": 0,
    }
    reference, _ = await _chat_stream(client, **options)
    before = set(cluster.gateway.streams)  # type: ignore[union-attr]
    cluster.pace.min_step_s = 0.01  # still running when the migration ends: 150 tokens >= 1.5 s
    task = asyncio.ensure_future(_chat_stream(client, **options))
    try:
        request_id, owner = await _owner_after_first_token(cluster, before)
        other = next(i for i in cluster.agents if i != owner)
        outcome = await cluster.agents[owner].migrate(request_id, other)
    finally:
        cluster.pace.release()
    text, finish = await task
    assert outcome.migrated, outcome
    assert text == reference and finish == ["length"]
    assert text.startswith("{") and '"words"' in text


async def test_a_constrained_request_rescued_after_its_agent_dies_returns_the_same_text(
    nats_url: str,
) -> None:
    schema = {"type": "array", "minItems": 60, "items": {"type": "integer", "minimum": 0, "maximum": 999}}
    options = {
        "extra_body": {"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
        "max_tokens": 120,
        "temperature": 0,
    }
    async with frontend_cluster(nats_url, instances=2, engine="torch") as cluster:
        client = cluster.openai(await cluster.serve())
        try:
            reference, _ = await _chat_stream(client, **options)
            before = set(cluster.gateway.streams)  # type: ignore[union-attr]
            cluster.pace.min_step_s = 0.02  # still running when its agent dies: 120 tokens >= 2.4 s
            task = asyncio.ensure_future(_chat_stream(client, **options))
            try:
                _, owner = await _owner_after_first_token(cluster, before)
                await cluster.agents[owner].kill()
            finally:
                cluster.pace.release()
            text, finish = await asyncio.wait_for(task, 60)
        finally:
            await client.close()
    assert text == reference and finish == ["length"]
    assert text.startswith("[") and text.count(",") >= 20

"""Tool calling with the official ``openai`` client: real agents running the torch engine on a random
Llama checkpoint whose chat template renders tools (Qwen 2.5's Hermes style), real NATS,
``--tool-call-parser hermes``; the same on vLLM engine agents where vLLM is installed.

``tool_choice`` required and named are enforced by the engine's grammar mask, so even a random model
returns a call whose arguments validate against the tool's schema; streamed deltas reassemble into the
same call; a conversation goes on with the call and its result; a greedy tool-calling request forced to
migrate mid-generation, or rescued after its agent dies, returns the same call as one that is not.
Each ``--tool-call-parser`` (hermes, llama3_json, mistral) serves ``tool_choice`` auto on sim agents.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from agents.engines.vllm_engine import vllm_unavailable_reason
from tests.frontend.cluster import Cluster, frontend_cluster
from tests.frontend.tool_checkpoint import build_tool_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings(  # vLLM's imports warn (as in test_openai_vllm)
        "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning"
    ),
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}  # type: ignore[index]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo this week?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tool_checkpoint(tmp_path_factory.mktemp("tools")))


@pytest.fixture(scope="module", params=["torch", "vllm"])
def engine(request: pytest.FixtureRequest) -> str:
    """The torch engine, or the vLLM engine where vLLM is installed (e2e: vLLM starts processes)."""
    if request.param == "vllm" and (reason := vllm_unavailable_reason()) is not None:
        pytest.skip(reason)
    return str(request.param)


@pytest.fixture(scope="module")
async def cluster(engine: str, nats_url: str, checkpoint: str) -> AsyncIterator[Cluster]:
    options = {"model": checkpoint, "max_model_len": 4096, "num_blocks": 256}
    async with frontend_cluster(
        nats_url,
        instances=2,
        engine=engine,
        engine_options=options,
        max_model_len=4096,
        tool_call_parser="hermes",
    ) as running:
        running.base_url = await running.serve()  # type: ignore[attr-defined]
        running.engine_options = options  # type: ignore[attr-defined]
        yield running
        if engine == "vllm":
            for agent in running.agents.values():
                agent.engine.shutdown()


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[Any]:
    openai_client = cluster.openai(cluster.base_url)  # type: ignore[attr-defined]
    yield openai_client
    await openai_client.close()


def _valid(calls: list[Any], *, id_length: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call, after checking its arguments against its tool's schema
    (``id_length``: ids of that many letters and digits, as Mistral's; else vLLM's ``chatcmpl-tool-``)."""
    out = []
    for call in calls:
        assert call.type == "function"
        if id_length is None:
            assert call.id.startswith("chatcmpl-tool-")
        else:
            assert len(call.id) == id_length and call.id.isalnum()
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


async def _streamed(client: Any, **asked: Any) -> tuple[str, list[tuple[str, str, str]], list[str]]:
    """Content, (id, name, arguments) per call as a client joins the deltas, and the finish reasons."""
    stream = await client.chat.completions.create(model=asked.pop("model"), stream=True, **asked)
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    finish: list[str] = []
    async for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # the first delta of a call: its id, type and name
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = [delta.id, delta.function.name, ""]
                else:
                    assert delta.id is None and not delta.function.name
                calls[delta.index][2] += delta.function.arguments or ""
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return "".join(content), [(c[0], c[1], c[2]) for _, c in sorted(calls.items())], finish


def _asked(cluster: Cluster, **changes: Any) -> dict[str, Any]:
    asked: dict[str, Any] = {
        "model": cluster.config.model_name,
        "messages": MESSAGES,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 200,
    }
    asked.update(changes)
    return asked


async def test_required_returns_valid_calls_streamed_or_not(cluster: Cluster, client: Any) -> None:
    asked = _asked(cluster, tool_choice="required", parallel_tool_calls=False)
    reply = await client.chat.completions.create(**asked)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _valid(choice.message.tool_calls)
    assert len(calls) == 1
    content, streamed, finish = await _streamed(client, **asked)
    assert content == "" and finish == ["tool_calls"]
    assert [(name, json.loads(arguments)) for _, name, arguments in streamed] == calls
    assert [args for _, _, args in streamed] == [c.function.arguments for c in choice.message.tool_calls]


async def test_named_function_returns_its_call(cluster: Cluster, client: Any) -> None:
    for name in ("get_time", "get_weather"):
        asked = _asked(cluster, tool_choice={"type": "function", "function": {"name": name}})
        reply = await client.chat.completions.create(**asked)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        [(called, _)] = _valid(choice.message.tool_calls)
        assert called == name
        _, streamed, finish = await _streamed(client, **asked)
        assert finish == ["tool_calls"]
        assert [(n, a) for _, n, a in streamed] == [(name, choice.message.tool_calls[0].function.arguments)]


async def test_a_conversation_goes_on_with_the_call_and_its_result(cluster: Cluster, client: Any) -> None:
    first = await client.chat.completions.create(
        **_asked(cluster, tool_choice="required", parallel_tool_calls=False)
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", "high": 21})},
    ]
    answer = await client.chat.completions.create(**_asked(cluster, messages=messages, max_tokens=16))
    choice = answer.choices[0]  # tool_choice auto: the hermes parser reads the free text
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert isinstance(choice.message.content, str) or choice.message.tool_calls
    assert "</s>" not in (choice.message.content or "")  # special tokens shown to the parser, but not EOS
    # the call and its result are in the prompt: the template rendered them
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20
    again = await client.chat.completions.create(
        **_asked(cluster, messages=messages, tool_choice="required", parallel_tool_calls=False)
    )
    _valid(again.choices[0].message.tool_calls)


async def test_auto_finds_the_calls_the_model_writes(cluster: Cluster, client: Any) -> None:
    # tool_choice auto leaves the output free and the hermes parser reads it; a regex (vLLM's
    # structured_outputs, allowed beside auto as in vLLM) makes the random model write text and a call
    call = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'
    asked = _asked(
        cluster, tool_choice="auto", extra_body={"structured_outputs": {"regex": "Checking\\.\\n" + call}}
    )
    reply = await client.chat.completions.create(**asked)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [(name, arguments)] = _valid(choice.message.tool_calls)
    assert name == "get_time" and arguments["zone"] in ("UTC", "CET")
    content, streamed, finish = await _streamed(client, **asked)
    assert (content, finish) == ("Checking.", ["tool_calls"])
    assert [(n, a) for _, n, a in streamed] == [("get_time", choice.message.tool_calls[0].function.arguments)]


async def test_tokenize_counts_the_prompt_with_its_tools(cluster: Cluster, client: Any) -> None:
    reply = await client.chat.completions.create(**_asked(cluster, tool_choice="none", max_tokens=1))
    async with httpx.AsyncClient(base_url=cluster.base_url) as http:  # type: ignore[attr-defined]
        counted = (await http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})).json()
        without = (await http.post("/tokenize", json={"messages": MESSAGES})).json()
    assert counted["count"] == reply.usage.prompt_tokens > without["count"]


async def test_tool_choice_none_answers_text(cluster: Cluster, client: Any) -> None:
    reply = await client.chat.completions.create(**_asked(cluster, tool_choice="none", max_tokens=12))
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and reply.usage.completion_tokens <= 12


async def test_bad_tool_requests_are_400s_naming_the_field(cluster: Cluster, client: Any) -> None:
    bad = [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ]
    for changes, param in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(**_asked(cluster, **changes))
        assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


async def _owner_after_tokens(cluster: Cluster, before: set[str], count: int) -> tuple[str, str]:
    gateway = cluster.gateway
    assert gateway is not None
    for _ in range(1000):
        for request_id, stream in list(gateway.streams.items()):
            if request_id not in before and len(stream.generated) >= count and stream.owner_id:
                return request_id, stream.owner_id
        await asyncio.sleep(0.005)
    raise AssertionError(f"no request produced {count} tokens")


async def test_migration_mid_call_returns_the_same_call(cluster: Cluster, client: Any) -> None:
    asked = _asked(cluster, tool_choice="required", parallel_tool_calls=False)
    _, reference, _ = await _streamed(client, **asked)
    before = set(cluster.gateway.streams)  # type: ignore[union-attr]
    cluster.pace.min_step_s = 0.02  # still generating when the migration ends
    task = asyncio.ensure_future(_streamed(client, **asked))
    try:
        request_id, owner = await _owner_after_tokens(cluster, before, 8)  # inside the call's JSON
        other = next(i for i in cluster.agents if i != owner)
        outcome = await cluster.agents[owner].migrate(request_id, other)
    finally:
        cluster.pace.release()
    _, migrated, finish = await task
    assert outcome.migrated, outcome
    assert finish == ["tool_calls"]
    assert [(n, a) for _, n, a in migrated] == [(n, a) for _, n, a in reference]


async def test_rescue_after_the_agent_dies_mid_call_returns_the_same_call(
    cluster: Cluster, client: Any
) -> None:
    asked = _asked(cluster, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    _, reference, _ = await _streamed(client, **asked)
    rescues = cluster.gateway.metrics.rescues  # type: ignore[union-attr]
    rescued_before = sum(
        sample.value
        for metric in rescues.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )
    before = set(cluster.gateway.streams)  # type: ignore[union-attr]
    cluster.pace.min_step_s = 0.02  # still generating when its agent dies
    task = asyncio.ensure_future(_streamed(client, **asked))
    try:
        _, owner = await _owner_after_tokens(cluster, before, 6)  # inside the arguments
        await cluster.agents[owner].kill()
    finally:
        cluster.pace.release()
    _, rescued, finish = await asyncio.wait_for(task, 60)
    rescued_after = sum(
        sample.value
        for metric in rescues.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )
    assert rescued_after == rescued_before + 1
    assert finish == ["tool_calls"]
    assert [(n, a) for _, n, a in rescued] == [(n, a) for _, n, a in reference]
    await cluster.add_agent(f"{owner}-again", **cluster.engine_options)  # type: ignore[attr-defined]
    await cluster.wait_instances(2)


#: what a model of each family writes for one call (after some text where the format allows it)
FAMILY_ANSWERS = {
    "hermes": r"Checking\.\n<tool_call>\n"
    + r'\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>',
    "llama3_json": r'<\|python_tag\|>\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}',
    "mistral": r'Checking\.\[TOOL_CALLS\]\[\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\]',
}


@pytest.mark.parametrize("parser", sorted(FAMILY_ANSWERS))
async def test_each_tool_call_parser_serves_tool_choice_auto(nats_url: str, parser: str) -> None:
    # sim agents (their answers held to the family's format by a regex); the frontend runs
    # --tool-call-parser, and finds the call whole and streamed
    async with frontend_cluster(nats_url, instances=1, engine="sim", tool_call_parser=parser) as running:
        client = running.openai(await running.serve())
        try:
            asked = {
                "model": running.config.model_name,
                "messages": MESSAGES,
                "tools": TOOLS,
                "max_tokens": 150,
                "temperature": 0,
                "extra_body": {"structured_outputs": {"regex": FAMILY_ANSWERS[parser]}},
            }
            reply = await client.chat.completions.create(**asked)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == (None if parser == "llama3_json" else "Checking.")
            [(name, arguments)] = _valid(
                choice.message.tool_calls, id_length=9 if parser == "mistral" else None
            )
            assert name == "get_time" and arguments["zone"] in ("UTC", "CET")
            content, streamed, finish = await _streamed(client, **asked)
            assert (content or None, finish) == (choice.message.content, ["tool_calls"])
            # the sim's pick differs between requests: the streamed call is checked on its own
            [(call_id, name, arguments_text)] = streamed
            assert name == "get_time" and json.loads(arguments_text)["zone"] in ("UTC", "CET")
            assert len(call_id) == 9 if parser == "mistral" else call_id.startswith("chatcmpl-tool-")
        finally:
            await client.close()

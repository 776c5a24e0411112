"""The official ``openai`` client's Responses API against shoal (torch ``tiny`` agents, real NATS).

``responses.create`` plain and streamed (typed events in order, deltas joining to the final text),
with a function tool, with ``text.format``; stored responses retrieved, deleted, and continued
with ``previous_response_id`` by a frontend started after the first one went away; the bucket's
TTL; unknown ids and refused options.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest

from agents.engines.tokenizer import render_chat
from bus import JetStreamBus
from frontend.app import create_app
from frontend.gateway import Gateway
from frontend.tokenization import load_frontend_tokenizer
from tests.frontend.cluster import Cluster, bus_config, frontend_cluster

pytestmark = pytest.mark.slow

TTL_S = 3600.0
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
#: The random model's likeliest token is often a whitespace byte, which JSON allows between any two
#: tokens: unbiased, it repeats one until the budget ends. -100 takes them out where anything else fits.
NO_WHITESPACE = {str(ord(c)): -100 for c in " \t\n\r"}
#: A string that may hold anything ends only when '"' comes; this makes it come soon.
CLOSE_STRINGS = {str(ord('"')): 6, str(ord("}")): 6}
TOOL = {"type": "function", "name": "get_weather", "description": "the forecast", "parameters": WEATHER}


@pytest.fixture(scope="module")
async def cluster(nats_url: str) -> AsyncIterator[Cluster]:
    async with frontend_cluster(
        nats_url,
        instances=1,
        engine="torch",
        max_model_len=512,
        responses_ttl_s=TTL_S,
        tool_call_parser="hermes",
    ) as running:
        running.base_url = await running.serve()  # type: ignore[attr-defined]
        yield running


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[Any]:
    openai_client = cluster.openai(cluster.base_url)  # type: ignore[attr-defined]
    yield openai_client
    await openai_client.close()


async def test_plain_response_answers_as_chat_with_the_same_messages(client: Any) -> None:
    response = await client.responses.create(
        model="tiny", input="hi", instructions="be brief", max_output_tokens=16, temperature=0
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    chat = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=16,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.usage.input_tokens_details.cached_tokens >= 0
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


async def test_streamed_events_arrive_in_order_and_the_deltas_join_to_the_text(client: Any) -> None:
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "input": "Once upon a time",
        "max_output_tokens": 24,
        "temperature": 0,
    }
    whole = await client.responses.create(**kwargs)
    stream = await client.responses.create(stream=True, **kwargs)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text == events[-4].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"


async def test_a_required_function_tool_returns_a_call_whose_arguments_validate(client: Any) -> None:
    response = await client.responses.create(
        model="tiny",
        input="weather in Paris?",
        tools=[TOOL],
        tool_choice="required",
        max_output_tokens=200,
        temperature=0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        assert call.call_id.startswith("call_")
    stream = await client.responses.create(
        model="tiny",
        input="weather in Paris?",
        tools=[TOOL],
        tool_choice="required",
        max_output_tokens=200,
        temperature=0,
        stream=True,
    )
    events = [event async for event in stream]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == "".join(done) == "".join(call.arguments for call in calls)
    # the tool's result in a follow-up turn: the conversation goes on
    follow = await client.responses.create(
        model="tiny",
        previous_response_id=response.id,
        tools=[TOOL],
        tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C, sunny"}],
        max_output_tokens=8,
        temperature=0,
    )
    assert follow.output[0].type == "message"
    assert follow.usage.input_tokens > response.usage.input_tokens


async def test_a_named_function_streams_its_call_as_typed_events(client: Any) -> None:
    stream = await client.responses.create(
        model="tiny",
        input="weather in Oslo?",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        temperature=0,
        stream=True,
    )
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    (call,) = events[-1].response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert events[2].item.id == call.id and events[2].item.call_id == call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert (
        "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        == call.arguments
    )


async def test_text_format_json_schema_gives_json_that_validates(client: Any) -> None:
    response = await client.responses.create(
        model="tiny",
        input="a forecast as JSON",
        max_output_tokens=200,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "forecast", "schema": WEATHER, "strict": True}},
        extra_body={"logit_bias": {**NO_WHITESPACE, **CLOSE_STRINGS}},  # chat's extension, for a random model
    )
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    assert response.text.format.type == "json_schema"
    json_mode = await client.responses.create(
        model="tiny",
        input="any JSON object",
        max_output_tokens=200,
        temperature=0,
        text={"format": {"type": "json_object"}},
        extra_body={"logit_bias": {**NO_WHITESPACE, **CLOSE_STRINGS}},
    )
    assert isinstance(json.loads(json_mode.output_text), dict)
    with pytest.raises(openai.BadRequestError) as both:  # a forced tool choice constrains the output already
        await client.responses.create(
            model="tiny",
            input="x",
            tools=[TOOL],
            tool_choice="required",
            text={"format": {"type": "json_object"}},
        )
    assert both.value.body["param"] == "text.format"


async def test_stored_responses_are_retrieved_and_deleted_and_unknown_ids_are_404(client: Any) -> None:
    response = await client.responses.create(
        model="tiny", input="hi", max_output_tokens=4, metadata={"case": "store"}
    )
    again = await client.responses.retrieve(response.id)
    assert (again.id, again.output_text, again.metadata) == (
        response.id,
        response.output_text,
        {"case": "store"},
    )
    follow = await client.responses.create(
        model="tiny",
        previous_response_id=response.id,
        max_output_tokens=2,
        input=[
            {"role": "user", "content": "one"},
            {"role": "user", "content": [{"type": "input_text", "text": "two"}]},
        ],
    )
    listed = await client.responses.input_items.list(follow.id)  # its own input, the last first
    assert [item.content[0].text for item in listed.data] == ["two", "one"] and not listed.has_more
    first = await client.responses.input_items.list(follow.id, order="asc", limit=1)
    assert [item.content[0].text for item in first.data] == ["one"] and first.has_more
    await client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_0123456789abcdef")
    unstored = await client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model="tiny", input="hi", previous_response_id="resp_nothere")
    assert missing.value.body["param"] == "previous_response_id"


async def test_refused_options_are_a_400_naming_them(client: Any) -> None:
    for extra, param in (
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            await client.responses.create(model="tiny", input="hi", **extra)
        assert error.value.body["param"] == param


async def test_the_bucket_keeps_responses_for_the_configured_ttl(cluster: Cluster, client: Any) -> None:
    await client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    bus = cluster.buses[-1]
    info = await bus.client.jsm().stream_info(f"KV_{cluster.subjects.responses_bucket}")
    assert info.config.max_age == pytest.approx(TTL_S)


async def test_a_conversation_continues_on_a_frontend_started_after_the_first_went_away(
    nats_url: str,
) -> None:
    async with frontend_cluster(nats_url, instances=1, engine="torch", max_model_len=512) as cluster:
        first_url = await cluster.serve()
        first = cluster.openai(first_url)
        turn_one = await first.responses.create(
            model="tiny", input="Hello there", max_output_tokens=12, temperature=0
        )
        await first.close()
        # the frontend goes away: its HTTP server, gateway and bus connection
        assert cluster.server is not None and cluster.gateway is not None
        cluster.server.should_exit = True
        await cluster.server_task
        cluster.server = None
        await cluster.gateway.stop()
        await cluster.buses[-1].close()
        # a new one on the same NATS: a new bus, gateway and app
        bus = JetStreamBus(bus_config(cluster.url, cluster.subjects, "frontend-2"))
        await bus.connect()
        cluster.buses.append(bus)
        cluster.gateway = Gateway(bus, cluster.config)
        await cluster.gateway.start()
        cluster.app = create_app(cluster.config, gateway=cluster.gateway)
        await cluster.wait_instances(1)
        second = cluster.openai(await cluster.serve())
        stored = await second.responses.retrieve(turn_one.id)
        assert stored.output_text == turn_one.output_text
        turn_two = await second.responses.create(
            model="tiny",
            input="And then?",
            previous_response_id=turn_one.id,
            max_output_tokens=12,
            temperature=0,
        )
        # the prompt held the earlier turn: it is the chat prompt of the whole conversation, and the
        # answer is the one chat gives that conversation
        messages = [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": turn_one.output_text},
            {"role": "user", "content": "And then?"},
        ]
        tokenizer = load_frontend_tokenizer(cluster.config.model)
        prompt = render_chat(tokenizer, messages)
        assert turn_two.usage.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
        chat = await second.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0
        )
        assert turn_two.output_text == chat.choices[0].message.content
        assert turn_two.previous_response_id == turn_one.id
        # the earlier turn's prompt is a prefix of this one's: the agent's prefix cache held it
        assert turn_two.usage.input_tokens_details.cached_tokens > 0
        await second.close()

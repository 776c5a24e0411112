"""Responses API items and output, without a cluster: input items become the chat messages a template
renders, bad items are a 400 naming their place, and the output builder turns text (and tool calls
in it) into OpenAI's items and stream events in order."""

from __future__ import annotations

import json

import pytest

from frontend.errors import APIError
from frontend.responses_api.items import chat_messages, normalize_input
from frontend.responses_api.models import ResponsesRequest, refuse_options
from frontend.responses_api.objects import EventStream
from frontend.responses_api.output import OutputBuilder
from frontend.tools import get_parser


def test_a_tool_conversation_becomes_chat_messages_with_tool_calls_and_results() -> None:
    items = normalize_input(
        [
            {"role": "user", "content": "weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "It is 18C."}],
            },
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "and "}, {"type": "input_text", "text": "now?"}],
            },
        ]
    )
    assert [item["type"] for item in items] == [
        "message",
        "function_call",
        "function_call",
        "function_call_output",
        "message",
        "message",
    ]
    messages = chat_messages(items, "be brief")
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1] == {"role": "user", "content": "weather in Paris?"}
    assert messages[2]["role"] == "assistant"
    assert [call["id"] for call in messages[2]["tool_calls"]] == ["call_1", "call_2"]  # one turn, two calls
    assert messages[2]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"Paris"}',
    }
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C"}
    assert messages[4] == {"role": "assistant", "content": "It is 18C."}
    assert messages[5] == {"role": "user", "content": "and now?"}


def test_a_string_input_is_one_user_message() -> None:
    assert chat_messages(normalize_input("hi"), None) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content"),
        ([{"role": "wizard", "content": "x"}], "input[0].role"),
        ([{"role": "user", "content": "ok"}, {"type": "reasoning", "summary": []}], "input[1]"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ],
)
def test_an_item_shoal_cannot_read_is_a_400_naming_its_place(
    raw: list[dict[str, object]], param: str
) -> None:
    with pytest.raises(APIError) as error:
        normalize_input(raw)
    assert (error.value.status, error.value.param) == (400, param)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ],
)
def test_options_that_would_change_the_answer_are_refused_by_name(
    extra: dict[str, object], param: str
) -> None:
    body = ResponsesRequest.model_validate({"model": "tiny", "input": "hi", **extra})
    with pytest.raises(APIError) as error:
        refuse_options(body)
    assert (error.value.status, error.value.param) == (400, param)
    refuse_options(
        ResponsesRequest.model_validate(
            {"model": "tiny", "input": "hi", "reasoning": None, "include": [], "service_tier": "auto"}
        )
    )


def _events(chunks: list[bytes]) -> list[dict[str, object]]:
    return [json.loads(chunk.split(b"data: ", 1)[1]) for chunk in chunks]


def test_plain_text_streams_as_one_message_item_in_order() -> None:
    events = EventStream()
    builder = OutputBuilder(events)
    out = [*builder.feed("Hel"), *builder.feed("lo"), *builder.finish()]
    kinds = [event["type"] for event in _events(out)]
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [event["sequence_number"] for event in _events(out)] == list(range(len(out)))
    (message,) = builder.output
    assert message["status"] == "completed" and message["content"][0]["text"] == "Hello"


def test_tool_calls_in_the_text_become_function_call_items_with_their_argument_deltas() -> None:
    events = EventStream()
    builder = OutputBuilder(events, get_parser("hermes").streaming())
    text = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    out = [event for cut in range(0, len(text), 7) for event in builder.feed(text[cut : cut + 7])]
    out += builder.finish()
    message, call = builder.output
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me check."
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("call_")
    decoded = _events(out)
    deltas = "".join(
        str(e["delta"]) for e in decoded if e["type"] == "response.function_call_arguments.delta"
    )
    done = [e for e in decoded if e["type"] == "response.function_call_arguments.done"]
    assert deltas == call["arguments"] and done[0]["arguments"] == call["arguments"]
    # the message item is done before the call's item is added
    kinds = [e["type"] for e in decoded]
    assert kinds.index("response.output_item.done") < kinds.index("response.output_item.added", 3)


def test_an_answer_cut_by_the_budget_is_incomplete_and_an_empty_one_is_still_a_message() -> None:
    builder = OutputBuilder()
    builder.feed("partial")
    builder.finish(complete=False)
    assert builder.output[0]["status"] == "incomplete"
    empty = OutputBuilder()
    empty.finish()
    assert empty.output[0]["content"][0]["text"] == ""

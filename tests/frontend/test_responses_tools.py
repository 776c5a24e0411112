"""A tool conversation through the Responses API on a checkpoint whose chat template renders tools
(Qwen 2.5's Hermes template, random weights, torch agent, real NATS), with the official ``openai`` client.

The model calls the tool (``tool_choice`` required: a call whose arguments validate), the client
sends the result back as a ``function_call_output`` item after ``previous_response_id``, and the
model answers: the prompt of that turn is exactly the chat route's prompt of the same conversation
(the tools, the assistant's call, the tool's result), and the greedy answer is chat's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import jsonschema
import pytest

from tests.frontend.cluster import Cluster, frontend_cluster
from tests.frontend.tool_checkpoint import build_tool_checkpoint

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "the forecast", "parameters": WEATHER}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER},
}


@pytest.fixture(scope="module")
async def cluster(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    model = str(build_tool_checkpoint(tmp_path_factory.mktemp("tools")))
    options = {"model": model, "max_model_len": 4096, "num_blocks": 256}
    async with frontend_cluster(
        nats_url,
        instances=1,
        engine="torch",
        engine_options=options,
        max_model_len=4096,
        tool_call_parser="hermes",
    ) as running:
        running.base_url = await running.serve()  # type: ignore[attr-defined]
        yield running


async def test_a_call_its_result_and_the_answer_render_as_chat_does(cluster: Cluster) -> None:
    client = cluster.openai(cluster.base_url)  # type: ignore[attr-defined]
    try:
        model = cluster.config.model_name
        call_turn = await client.responses.create(
            model=model,
            input="weather in Paris?",
            instructions="be brief",
            tools=[TOOL],
            tool_choice="required",
            max_output_tokens=120,
            temperature=0,
        )
        calls = [item for item in call_turn.output if item.type == "function_call"]
        assert calls and calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
        answer = await client.responses.create(
            model=model,
            previous_response_id=call_turn.id,
            tools=[TOOL],
            tool_choice="auto",
            input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C, sunny"}],
            max_output_tokens=16,
            temperature=0,
        )
        messages = [
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for call in calls
                ],
            },
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18C, sunny"},
        ]
        chat = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[CHAT_TOOL],
            tool_choice="auto",
            max_tokens=16,
            temperature=0,
        )
        assert answer.usage.input_tokens == chat.usage.prompt_tokens
        # the same answer: text, or (the hermes parser finding a call in it) the same calls
        assert answer.output_text == (chat.choices[0].message.content or "")
        answered_calls = [(i.name, i.arguments) for i in answer.output if i.type == "function_call"]
        chat_calls = [
            (c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls or []
        ]
        assert answered_calls == chat_calls
    finally:
        await client.close()

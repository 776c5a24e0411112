"""Chat prompts with tools: the checkpoint's chat template renders the tools, the assistant's tool calls
and the tool results exactly as transformers' ``apply_chat_template`` renders them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agents.engines.tokenizer import ByteTokenizer
from frontend.errors import APIError
from frontend.openai_models import ChatMessage
from frontend.tokenization import chat_prompt_ids
from frontend.tools import parse_tools
from tests.frontend.tool_checkpoint import HERMES_TOOL_TEMPLATE

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city (°C)",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "chatcmpl-tool-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": '{"temperature": 21}'},
]


def _tokenizer() -> ByteTokenizer:
    tokenizer = ByteTokenizer(512)
    tokenizer.chat_template = HERMES_TOOL_TEMPLATE
    return tokenizer


def _rendered(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    parsed = [ChatMessage.model_validate(m) for m in messages]
    chat_tools = None if tools is None else [tool.chat_dict() for tool in parse_tools(tools)]
    return bytes(chat_prompt_ids(_tokenizer(), parsed, tools=chat_tools)).decode()


def _transformers(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    conversation = json.loads(json.dumps(messages))
    for message in conversation:  # as vLLM hands them to the template: arguments as objects
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if message["content"] is None:
            message["content"] = ""
    rendered: str = render_jinja_template(
        conversations=[conversation],
        tools=tools,
        chat_template=HERMES_TOOL_TEMPLATE,
        add_generation_prompt=True,
    )[0][0]
    return rendered


def test_tools_calls_and_results_render_as_transformers_renders_them() -> None:
    text = _rendered(CONVERSATION, TOOLS)
    assert text == _transformers(CONVERSATION, TOOLS)
    assert '"name": "get_weather"' in text and "Weather in a city (°C)" in text  # tools, non-ASCII kept
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_without_tools_the_template_shows_none() -> None:
    messages = CONVERSATION[:2]
    text = _rendered(messages, None)
    assert text == _transformers(messages, None) and "<tools>" not in text


def test_tool_call_arguments_that_are_not_json_are_a_400() -> None:
    bad = json.loads(json.dumps(CONVERSATION))
    bad[2]["tool_calls"][0]["function"]["arguments"] = "{city: Zürich"
    with pytest.raises(APIError) as caught:
        _rendered(bad, TOOLS)
    assert caught.value.status == 400 and caught.value.param == "messages"

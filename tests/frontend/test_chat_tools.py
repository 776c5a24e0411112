"""Tool calling's chat side without a cluster: what ``tool_choice`` needs from the server's configuration,
and how ``parallel_tool_calls: false`` keeps one call of an ``auto`` answer, whole or streamed."""

from __future__ import annotations

from typing import Any

import pytest

from bus.cli_config import from_argv
from frontend.chat_tools import ChatTools
from frontend.cli_serve import ServeCliConfig
from frontend.errors import APIError
from frontend.openai_models import ChatCompletionRequest
from frontend.turns import Piece
from frontend.up import UpConfig
from schemas import FinishReason

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
TWO_CALLS = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>' + (
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
)


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], **fields}
    )


def test_auto_without_a_parser_is_a_400_that_names_the_flag() -> None:
    for choice in (None, "auto"):  # no tool_choice with tools means auto
        with pytest.raises(APIError) as caught:
            ChatTools.of(_request(tool_choice=choice), None)
        assert caught.value.status == 400 and caught.value.param == "tool_choice"
        assert "--tool-call-parser" in caught.value.message
    for choice in ("required", "none", {"type": "function", "function": {"name": "f"}}):
        assert ChatTools.of(_request(tool_choice=choice), None) is not None
    tools = ChatTools.of(_request(tool_choice="none"), None)
    assert tools is not None and tools.parser is None and tools.structured is None
    assert ChatTools.of(_request(tools=None), None) is None


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    tools = ChatTools.of(_request(parallel_tool_calls=False), "hermes")
    assert tools is not None
    message = tools.message(0, TWO_CALLS, FinishReason.STOP, None)
    assert [c["function"]["arguments"] for c in message["message"]["tool_calls"]] == ['{"a": 1}']
    assert message["finish_reason"] == "tool_calls"
    chunks = tools.chunks()
    assert chunks is not None
    chunk = chunks.chunk(
        "id", 0, "m", Piece(TWO_CALLS, (), (), FinishReason.STOP), None, index=0, with_usage_field=False
    )
    assert chunk is not None and {d["index"] for d in chunk["choices"][0]["delta"]["tool_calls"]} == {0}
    both = ChatTools.of(_request(), "hermes")
    assert (
        both is not None
        and len(both.message(0, TWO_CALLS, FinishReason.STOP, None)["message"]["tool_calls"]) == 2
    )


def test_a_call_cut_by_max_tokens_finishes_with_length() -> None:
    tools = ChatTools.of(_request(), "hermes")
    assert tools is not None
    message = tools.message(0, '<tool_call>{"name": "f", "arguments": {"a": ', FinishReason.LENGTH, None)
    assert message["finish_reason"] == "length"


def test_the_flag_reaches_the_frontend_from_shoal_serve_and_shoal_up() -> None:
    serve = from_argv(ServeCliConfig, ["--tool-call-parser", "mistral"])
    assert serve.frontend_config().tool_call_parser == "mistral"
    assert from_argv(ServeCliConfig, []).frontend_config().tool_call_parser is None
    up = from_argv(UpConfig, ["--tool-call-parser", "llama3_json"])
    assert up.tool_call_parser == "llama3_json"

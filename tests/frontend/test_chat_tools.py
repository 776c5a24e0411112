"""Tool calling's chat side without a cluster: what ``tool_choice`` needs from the server's configuration,
and how ``parallel_tool_calls: false`` keeps one call of an ``auto`` answer, whole or streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agents.engines.tokenizer import HFTokenizer
from bus.cli_config import from_argv
from frontend.chat_tools import ChatTools
from frontend.cli_serve import ServeCliConfig
from frontend.detokenize import IncrementalDetokenizer
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


def test_a_forced_choice_over_a_schema_the_grammar_cannot_enforce_is_a_400_naming_tools() -> None:
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": bad}}
    with pytest.raises(APIError) as caught:
        ChatTools.of(_request(tools=[tool], tool_choice="required"), None)
    assert caught.value.status == 400 and caught.value.param == "tools" and "regex" in caught.value.message


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
    up = from_argv(UpConfig, ["--tool-call-parser", "llama3_json", "--responses-ttl", "60"])
    assert (up.tool_call_parser, up.responses_ttl) == ("llama3_json", 60.0)


def _mistral_like_tokenizer(folder: Path) -> HFTokenizer:
    """A byte-level BPE whose ``[TOOL_CALLS]`` is a special token, as in Mistral's tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "[TOOL_CALLS]"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(['get_weather {"city": "Paris"} hello'] * 4, trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return HFTokenizer(folder)


def test_a_special_token_marker_reaches_the_parser_and_the_end_of_sequence_does_not(tmp_path: Path) -> None:
    tokenizer = _mistral_like_tokenizer(tmp_path)
    answer = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    ids = [*tokenizer.encode(answer, add_special_tokens=False), *tokenizer.eos_token_ids]
    assert (
        tokenizer.decode(ids) == 'Sure.[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    )  # skipped
    tools = ChatTools.of(
        _request(tools=[{"type": "function", "function": {"name": "get_weather"}}]), "mistral"
    )
    assert tools is not None and tools.keeps_special_tokens
    detokenizer = IncrementalDetokenizer(
        tokenizer, skip_special_tokens=False, hidden_ids=tokenizer.eos_token_ids
    )
    text = "".join(detokenizer.push([token_id]) for token_id in ids) + detokenizer.flush()
    assert text == answer  # the marker shown, the end-of-sequence token not
    message = tools.message(0, text, FinishReason.STOP, None)["message"]
    assert message["content"] == "Sure."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    forced = ChatTools.of(_request(tool_choice="required"), None)
    assert forced is not None and not forced.keeps_special_tokens  # constrained JSON: plain text

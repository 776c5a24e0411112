"""Structured-output requests, logit_bias and min_p: what the frontend accepts, what it sends the
engines, and the 400 (naming the field) for what they could not enforce."""

from __future__ import annotations

import json
from typing import Any

import pytest

from frontend.errors import APIError
from frontend.openai_models import ChatCompletionRequest, CompletionRequest, sampling_of
from frontend.structured import json_schema_output
from schemas import SamplingParams, StructuredKind, StructuredOutput

_CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
_VOCAB = 259  # the byte tokenizer's: 256 bytes, BOS, EOS, PAD


def _chat(**fields: Any) -> SamplingParams:
    return sampling_of(ChatCompletionRequest(**_CHAT, **fields), max_tokens=64, vocab_size=_VOCAB)


def _completion(**fields: Any) -> SamplingParams:
    return sampling_of(CompletionRequest(model="m", prompt="x", **fields), max_tokens=64, vocab_size=_VOCAB)


def _error(**fields: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        _chat(**fields)
    assert caught.value.status == 400
    return caught.value


_PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_text_and_no_format_are_free_text() -> None:
    assert _chat().structured is None
    assert _chat(response_format={"type": "text"}).structured is None


def test_json_schema_response_format_carries_the_schema_in_order() -> None:
    structured = _chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": _PERSON, "strict": True},
        }
    ).structured
    assert structured is not None and structured.kind is StructuredKind.JSON_SCHEMA
    assert json.loads(structured.spec) == _PERSON
    assert list(json.loads(structured.spec)["properties"]) == ["name", "age"]  # generation order kept
    assert structured.any_whitespace


def test_json_object_on_both_endpoints() -> None:
    expected = StructuredOutput(kind=StructuredKind.JSON_OBJECT)
    assert _chat(response_format={"type": "json_object"}).structured == expected
    assert _completion(response_format={"type": "json_object"}).structured == expected


@pytest.mark.parametrize(
    ("fields", "kind", "spec"),
    [
        ({"structured_outputs": {"regex": "[a-z]{3}"}}, StructuredKind.REGEX, "[a-z]{3}"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredKind.CHOICE, '["yes", "no"]'),
        (
            {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
            StructuredKind.GRAMMAR,
            'root ::= "a" | "b"',
        ),
        (
            {"structured_outputs": {"json": {"type": "integer"}}},
            StructuredKind.JSON_SCHEMA,
            '{"type":"integer"}',
        ),
        (
            {"structured_outputs": {"json": '{"type": "integer"}'}},
            StructuredKind.JSON_SCHEMA,
            '{"type":"integer"}',
        ),
        ({"structured_outputs": {"json_object": True}}, StructuredKind.JSON_OBJECT, ""),
        ({"guided_regex": "[0-9]+"}, StructuredKind.REGEX, "[0-9]+"),
        ({"guided_choice": ["a", "b"]}, StructuredKind.CHOICE, '["a", "b"]'),
        ({"guided_json": {"type": "boolean"}}, StructuredKind.JSON_SCHEMA, '{"type":"boolean"}'),
        ({"guided_grammar": 'start: "x"'}, StructuredKind.GRAMMAR, 'start: "x"'),
    ],
)
def test_vllm_structured_outputs_and_guided_fields(
    fields: dict[str, Any], kind: StructuredKind, spec: str
) -> None:
    structured = _completion(**fields).structured
    assert structured == StructuredOutput(kind=kind, spec=spec)


def test_vllm_options_compact_whitespace_and_closed_objects() -> None:
    structured = _completion(
        structured_outputs={
            "json": {"type": "object", "properties": {"a": {"type": "object"}}},
            "disable_any_whitespace": True,
            "disable_additional_properties": True,
        }
    ).structured
    assert structured is not None and not structured.any_whitespace
    assert json.loads(structured.spec) == {
        "type": "object",
        "properties": {"a": {"type": "object", "additionalProperties": False}},
        "additionalProperties": False,
    }


@pytest.mark.parametrize(
    ("fields", "param", "reason"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
            "Invalid type: objekt",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"not": {}}}}},
            "response_format",
            "not",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
                }
            },
            "response_format",
            "minimum",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
            "response_format",
            "schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"$ref": "#/$defs/missing"}},
                }
            },
            "response_format",
            "missing",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", "look-around"),
        (
            {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
            "structured_outputs.grammar",
            "undefined",
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not JSON"),
        (
            {"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "regex, choice"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"guided_json": "[1, 2]"}, "guided_json", "object or a boolean"),
        ({"guided_json": False}, "guided_json", "accepts nothing"),
        (
            {"guided_json": {"type": "string"}, "response_format": {"type": "json_object"}},
            "guided_json",
            "at most one",
        ),
        (
            {"guided_json": {"type": "string"}, "guided_whitespace_pattern": " "},
            "guided_whitespace_pattern",
            "not supported",
        ),
    ],
)
def test_a_constraint_the_engines_could_not_build_is_a_400_naming_the_field(
    fields: dict[str, Any], param: str, reason: str
) -> None:
    error = _error(**fields)
    assert error.param == param, error.message
    assert reason in error.message, error.message
    assert error.code == "invalid_parameter"


def test_the_schema_name_is_in_the_message() -> None:
    error = _error(
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": {"type": 5}}}
    )
    assert "response_format 'person'" in error.message


def test_json_schema_output_is_the_interface_for_tools_and_the_responses_api() -> None:
    output = json_schema_output(_PERSON, strict=True, param="tools[0].function.parameters")
    assert output.kind is StructuredKind.JSON_SCHEMA and json.loads(output.spec) == _PERSON
    assert json_schema_output(True, strict=None, param="text.format").spec == "{}"
    with pytest.raises(APIError) as caught:
        json_schema_output({"type": "objekt"}, strict=False, param="text.format")
    assert caught.value.param == "text.format"


def test_a_constraint_from_tool_choice_excludes_response_format() -> None:
    tool = json_schema_output({"type": "object"}, strict=True, param="tools")
    request = ChatCompletionRequest(**_CHAT)
    assert sampling_of(request, max_tokens=8, structured=tool).structured == tool
    both = ChatCompletionRequest(**_CHAT, response_format={"type": "json_object"})
    with pytest.raises(APIError) as caught:
        sampling_of(both, max_tokens=8, structured=tool)
    assert caught.value.param == "response_format"
    free = ChatCompletionRequest(**_CHAT, response_format={"type": "text"})
    assert sampling_of(free, max_tokens=8, structured=tool).structured == tool


def test_logit_bias_and_min_p_reach_the_sampling_parameters() -> None:
    sampling = _completion(logit_bias={"65": 100, "10": -100.0, "0": 0.5}, min_p=0.05)
    assert sampling.logit_bias == ((65, 100.0), (10, -100.0), (0, 0.5))
    assert sampling.min_p == 0.05
    assert _completion().logit_bias == () and _completion().min_p == 0.0


@pytest.mark.parametrize("key", ["259", "-1", "abc", "1.5", "", "\u0663"])
def test_a_logit_bias_key_that_is_no_token_id_of_the_vocabulary_is_a_400(key: str) -> None:
    with pytest.raises(APIError) as caught:
        _completion(logit_bias={key: 1})
    assert caught.value.param == "logit_bias"
    assert repr(key) in caught.value.message


def test_out_of_range_values_fail_validation() -> None:
    from pydantic import ValidationError

    for fields in (
        {"logit_bias": {"5": 101}},
        {"min_p": -0.1},
        {"min_p": 1.01},
        {"response_format": {"type": "structural_tag"}},
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(**_CHAT, **fields)

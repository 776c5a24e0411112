"""Tool calling's pure parts: tools and tool_choice as requests give them, the constraint a forced choice
puts on the output, and each model family's parser, whole and streamed.

A streamed answer, cut anywhere, must reassemble into exactly the content and calls of the whole
answer, and the calls must be the ones the model wrote (name, and arguments that parse to the same
JSON): hypothesis writes answers in each format and cuts them at random.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend.errors import APIError
from frontend.tools import (
    ToolChoice,
    assemble,
    calls_from_constrained,
    constrained_parser,
    get_parser,
    parse_tool_choice,
    parse_tools,
    tool_choice_output,
)
from schemas import StructuredKind

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "name": "search",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
}

_names = st.sampled_from(["get_weather", "search", "f", "lookup_user.v2"])
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=8),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_arguments = st.dictionaries(st.text(max_size=6), _json, max_size=4)
_calls = st.lists(st.tuples(_names, _arguments), min_size=1, max_size=3)
#: content that cannot be taken for a call in any format
_content = st.text(
    alphabet=st.characters(blacklist_characters="<[{", blacklist_categories=("Cs",)), max_size=20
)
_spaces = st.sampled_from(["", " ", "\n", " \n  "])


def _cuts(data: st.DataObject, text: str) -> list[str]:
    points = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _streamed(parser_stream: Any, pieces: list[str]) -> tuple[str | None, list[dict[str, Any]]]:
    outputs = [parser_stream.feed(piece) for piece in pieces]
    outputs.append(parser_stream.finish())
    for _, deltas in outputs:
        for delta in deltas:  # OpenAI's shape: the first delta of a call names it, the rest add arguments
            if "id" in delta:
                assert delta["type"] == "function" and set(delta["function"]) == {"name", "arguments"}
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
    return assemble(outputs)


def _same_calls(got: list[dict[str, Any]], wrote: list[tuple[str, dict[str, Any]]]) -> None:
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == wrote
    assert all(c["type"] == "function" and c["id"] for c in got)


def _without_ids(calls: list[dict[str, Any]]) -> list[Any]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _check(
    parser_name: str, text: str, wrote: list[tuple[str, dict[str, Any]]], content: str, data: st.DataObject
) -> None:
    parser = get_parser(parser_name)
    whole_content, whole_calls = parser.extract(text)
    _same_calls(whole_calls, wrote)
    streamed_content, streamed_calls = _streamed(parser.streaming(), _cuts(data, text))
    assert streamed_content == whole_content
    assert _without_ids(streamed_calls) == _without_ids(whole_calls)
    assert "".join((whole_content or "").split()) == "".join(content.split())


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=_calls,
    before=_content,
    after=_content,
    space=_spaces,
    indent=st.sampled_from([None, 2]),
    data=st.data(),
)
def test_hermes_calls_stream_as_they_extract(
    calls: list[tuple[str, dict[str, Any]]],
    before: str,
    after: str,
    space: str,
    indent: int | None,
    data: st.DataObject,
) -> None:
    objects = [json.dumps({"name": name, "arguments": args}, indent=indent) for name, args in calls]
    body = "".join(f"<tool_call>{space}{call}{space}</tool_call>{space}" for call in objects)
    _check("hermes", before + body + after, calls, before + after, data)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=_calls,
    tag=st.booleans(),
    key=st.sampled_from(["parameters", "arguments"]),
    separator=st.sampled_from([";", "; ", " ;\n"]),
    ensure_ascii=st.booleans(),
    data=st.data(),
)
def test_llama3_json_calls_stream_as_they_extract(
    calls: list[tuple[str, dict[str, Any]]],
    tag: bool,
    key: str,
    separator: str,
    ensure_ascii: bool,
    data: st.DataObject,
) -> None:
    body = separator.join(
        json.dumps({"name": name, key: args}, ensure_ascii=ensure_ascii) for name, args in calls
    )
    _check("llama3_json", ("<|python_tag|>" if tag else "") + body, calls, "", data)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(calls=_calls, before=_content, v11=st.booleans(), args_tag=st.booleans(), data=st.data())
def test_mistral_calls_stream_as_they_extract(
    calls: list[tuple[str, dict[str, Any]]], before: str, v11: bool, args_tag: bool, data: st.DataObject
) -> None:
    if v11:
        body = "".join(
            f"[TOOL_CALLS]{name}{'[ARGS]' if args_tag else ''}{json.dumps(args)}" for name, args in calls
        )
    else:
        body = "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args} for name, args in calls])
    _check("mistral", before + body, calls, before, data)


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=60), data=st.data())
def test_any_text_streams_as_it_extracts(text: str, data: st.DataObject) -> None:
    # whatever a model writes (a random one writes anything), the streamed answer is the whole one
    for name in ("hermes", "llama3_json", "mistral"):
        parser = get_parser(name)
        content, calls = parser.extract(text)
        streamed_content, streamed_calls = _streamed(parser.streaming(), _cuts(data, text))
        assert (streamed_content, _without_ids(streamed_calls)) == (content, _without_ids(calls))


_FRAGMENTS = [
    *'{}[]":,;\\ \na1',
    *('{"', '"name": "f"', '"arguments"', '"parameters"', ": {", "null", "\\a", '\\"', "\\u00e9"),
    *("<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[TOOL", "[ARGS]", "<|python_tag|>"),
]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(fragments=st.lists(st.sampled_from(_FRAGMENTS), max_size=40), data=st.data())
def test_json_like_text_streams_as_it_extracts(fragments: list[str], data: st.DataObject) -> None:
    # near-calls, broken calls, bad escapes, stray tags: never an error, and the same either way
    text = "".join(fragments)
    for name in ("hermes", "llama3_json", "mistral"):
        parser = get_parser(name)
        content, calls = parser.extract(text)
        streamed_content, streamed_calls = _streamed(parser.streaming(), _cuts(data, text))
        assert (streamed_content, _without_ids(streamed_calls)) == (content, _without_ids(calls))
    tools = parse_tools([{"type": "function", "function": {"name": "f"}}])
    for choice in (ToolChoice("required"), ToolChoice("function", "f")):
        parser = constrained_parser(tools, choice)
        whole = parser.extract(text)
        streamed = _streamed(parser.streaming(), _cuts(data, text))
        assert (streamed[0], _without_ids(streamed[1])) == (whole[0], _without_ids(whole[1]))


def test_text_that_is_not_a_call_is_content() -> None:
    assert get_parser("hermes").extract("no calls here\n") == ("no calls here\n", [])
    assert get_parser("hermes").extract("<tool_call>not json</tool_call> then") == (
        "<tool_call>not json</tool_call> then",
        [],
    )
    assert get_parser("llama3_json").extract('Use {"name": "f"} like this') == (
        'Use {"name": "f"} like this',
        [],
    )
    assert get_parser("llama3_json").extract('{"city": "Paris"}') == ('{"city": "Paris"}', [])
    assert get_parser("mistral").extract("plain [TOOL_ text") == ("plain [TOOL_ text", [])
    for bad_escape in ('{"\\a": 1}', '{"name": "\\q"}'):  # not JSON: content, never an error
        assert get_parser("llama3_json").extract(bad_escape) == (bad_escape, [])
        assert get_parser("hermes").extract(f"<tool_call>{bad_escape}") == (f"<tool_call>{bad_escape}", [])
    assert get_parser("mistral").extract("a [TOOL_CALLS] (not a call)") == ("a [TOOL_CALLS] (not a call)", [])


def test_an_unclosed_call_ends_with_the_answer() -> None:
    # the model stopped (EOS, or max_tokens) inside a call: what it wrote is the call, as vLLM's
    content, calls = get_parser("hermes").extract('<tool_call>\n{"name": "f", "arguments": {"x": 1}}')
    assert content is None and _without_ids(calls) == [("f", '{"x": 1}')]
    content, calls = get_parser("hermes").extract('<tool_call>{"name": "f"}</tool_call>')
    assert _without_ids(calls) == [("f", "{}")]


def test_hermes_streams_the_name_first_then_argument_fragments() -> None:
    stream = get_parser("hermes").streaming()
    assert stream.feed("Checking. <tool") == ("Checking.", [])
    content, deltas = stream.feed('_call>{"name": "get_weather", "argu')
    assert content == "" and len(deltas) == 1
    header = deltas[0]
    assert header["id"].startswith("chatcmpl-tool-") and len(header["id"]) == len("chatcmpl-tool-") + 32
    assert header == {
        "index": 0,
        "id": header["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert stream.feed('ments": {"city": "Pa') == (
        "",
        [{"index": 0, "function": {"arguments": '{"city": "Pa'}}],
    )
    assert stream.feed('ris"}}</tool_call>') == ("", [{"index": 0, "function": {"arguments": 'ris"}'}}])
    assert stream.finish() == ("", [])


def test_mistral_ids_are_nine_letters_or_digits() -> None:
    _, calls = get_parser("mistral").extract('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()


def test_unknown_parser_names_the_choices() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_parser("nope")


def test_tools_in_chat_and_responses_shapes() -> None:
    tools = parse_tools([WEATHER, SEARCH])
    assert [tool.name for tool in tools] == ["get_weather", "search"]
    assert tools[0].chat_dict() == WEATHER
    assert tools[1].chat_dict()["function"]["parameters"] == SEARCH["parameters"]
    assert parse_tools(None) == parse_tools([]) == []  # clients send an empty list for none
    no_parameters = parse_tools([{"type": "function", "function": {"name": "now"}}])[0]
    assert no_parameters.parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    "bad",
    [
        "x",
        [{"type": "code_interpreter"}],
        [{"type": "function", "function": {"name": "a b"}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
        [{"type": "function", "function": {"name": "f", "parameters": []}}],
        [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
    ],
)
def test_bad_tools_are_a_400_naming_tools(bad: Any) -> None:
    with pytest.raises(APIError) as caught:
        parse_tools(bad)
    assert caught.value.status == 400 and caught.value.param == "tools"


def test_tool_choice_forms() -> None:
    tools = parse_tools([WEATHER, SEARCH])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("auto", []) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    assert parse_tool_choice({"type": "function", "function": {"name": "search"}}, tools) == ToolChoice(
        "function", "search"
    )
    assert parse_tool_choice({"type": "function", "name": "search"}, tools) == ToolChoice(
        "function", "search"
    )
    for bad in ("sometimes", {"type": "function", "function": {"name": "other"}}, {"type": "function"}):
        with pytest.raises(APIError) as caught:
            parse_tool_choice(bad, tools)
        assert caught.value.param == "tool_choice"
    with pytest.raises(APIError):
        parse_tool_choice("required", [])


def test_required_constraint_is_an_array_of_named_calls() -> None:
    tools = parse_tools([WEATHER, SEARCH])
    assert tool_choice_output(tools, ToolChoice("auto")) is None
    assert tool_choice_output(tools, ToolChoice("none")) is None
    output = tool_choice_output(tools, ToolChoice("required"))
    assert output is not None and output.kind is StructuredKind.JSON_SCHEMA
    schema = json.loads(output.spec)
    good = [
        {"name": "get_weather", "parameters": {"city": "Oslo"}},
        {"name": "search", "parameters": {"q": "x"}},
    ]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(tool_choice_output(tools, ToolChoice("required"), parallel_tool_calls=False).spec)  # type: ignore[union-attr]
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    named = tool_choice_output(tools, ToolChoice("function", "get_weather"))
    assert named is not None and json.loads(named.spec) == WEATHER["function"]["parameters"]  # type: ignore[index]


def test_shared_definitions_move_to_the_root() -> None:
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    tool = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/point"}},
                "required": ["to"],
                "$defs": {"point": point},
            },
        },
    }
    schema = json.loads(tool_choice_output(parse_tools([tool]), ToolChoice("required")).spec)  # type: ignore[union-attr]
    assert schema["$defs"] == {"point": point}
    jsonschema.validate([{"name": "move", "parameters": {"to": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "move", "parameters": {"to": {}}}], schema)


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(calls=_calls, indent=st.sampled_from([None, 1]), data=st.data())
def test_constrained_required_output_streams_as_it_extracts(
    calls: list[tuple[str, dict[str, Any]]], indent: int | None, data: st.DataObject
) -> None:
    tools = parse_tools([{"type": "function", "function": {"name": name}} for name in {n for n, _ in calls}])
    text = json.dumps([{"name": name, "parameters": args} for name, args in calls], indent=indent)
    whole = calls_from_constrained(text, tools, ToolChoice("required"))
    _same_calls(whole, calls)
    content, streamed = _streamed(
        constrained_parser(tools, ToolChoice("required")).streaming(), _cuts(data, text)
    )
    assert content is None and _without_ids(streamed) == _without_ids(whole)


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(args=_arguments, space=_spaces, data=st.data())
def test_constrained_named_output_is_the_arguments(
    args: dict[str, Any], space: str, data: st.DataObject
) -> None:
    tools = parse_tools([WEATHER])
    choice = ToolChoice("function", "get_weather")
    text = space + json.dumps(args) + space
    whole = calls_from_constrained(text, tools, choice)
    _same_calls(whole, [("get_weather", args)])
    stream = constrained_parser(tools, choice).streaming()
    first = stream.feed("")  # the call's name is known before the model writes anything
    assert first == (
        "",
        [
            {
                "index": 0,
                "id": first[1][0]["id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            }
        ],
    )
    outputs = [first, *(stream.feed(piece) for piece in _cuts(data, text)), stream.finish()]
    content, streamed = assemble(outputs)
    assert content is None and _without_ids(streamed) == _without_ids(whole)


def test_constrained_named_output_streams_the_arguments() -> None:
    tools = parse_tools([WEATHER])
    stream = constrained_parser(tools, ToolChoice("function", "get_weather")).streaming()
    pieces = [stream.feed(piece) for piece in ['{"ci', 'ty": "Oslo"', "}"]]
    pieces.append(stream.finish())
    content, calls = assemble(pieces)
    assert content is None and _without_ids(calls) == [("get_weather", '{"city": "Oslo"}')]
    assert pieces[0][1][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}

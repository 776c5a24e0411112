"""agents/engines/grammar.py on its own: the constraint kinds, the wording of what does not compile, the
masks and the sim's pick among the allowed ids."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.engines.grammar import GrammarCompiler, allowed_ids, grammar_problem, nth_allowed
from schemas import StructuredKind, StructuredOutput

EOS = 257


def allowed_text(compiler: GrammarCompiler, structured: StructuredOutput, generated: bytes = b"") -> set[str]:
    ids = compiler.build(structured, list(generated)).allowed_token_ids()
    return {chr(int(i)) if i < 256 else "<eos>" if i == EOS else f"<{int(i)}>" for i in ids}


def test_each_kind_allows_what_it_should_at_its_start_and_ends_with_eos() -> None:
    grammars = GrammarCompiler.for_bytes(320)
    assert allowed_text(grammars, StructuredOutput(kind=StructuredKind.JSON_OBJECT)) == {"{"}
    choice = StructuredOutput(kind=StructuredKind.CHOICE, spec=json.dumps(["yes", "no", "nope"]))
    assert allowed_text(grammars, choice) == {"y", "n"}
    assert allowed_text(grammars, choice, b"no") == {"p", "<eos>"}  # "no" may end or go on
    matcher = grammars.build(choice, list(b"nop"))
    assert matcher.accept(ord("e")) and matcher.is_complete()
    assert allowed_text(grammars, choice, b"nope") == {"<eos>"}
    gbnf = StructuredOutput(kind=StructuredKind.GRAMMAR, spec='root ::= "a" [0-9]')
    lark = StructuredOutput(kind=StructuredKind.GRAMMAR, spec='start: "a" /[0-9]/')
    assert allowed_text(grammars, gbnf, b"a") == allowed_text(grammars, lark, b"a") == set("0123456789")
    anything = StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec="true")  # any JSON value
    assert {"{", "[", '"', "1", "t", "n"} <= allowed_text(grammars, anything)


def test_whitespace_is_allowed_between_json_tokens_only_with_any_whitespace() -> None:
    grammars = GrammarCompiler.for_bytes(320)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    loose = StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=schema)
    compact = StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=schema, any_whitespace=False)
    assert allowed_text(grammars, compact, b"{") == {'"'}
    assert allowed_text(grammars, loose, b"{") == {'"', " ", "\n", "\r", "\t"}


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        (
            StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec="{"),
            "structured output (json_schema) is invalid: ",
        ),
        (StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec="false"), "the schema false admits no value"),
        (StructuredOutput(kind=StructuredKind.REGEX, spec="(a"), "structured output (regex) is invalid: "),
        (StructuredOutput(kind=StructuredKind.CHOICE, spec='["a", 1]'), "a non-empty JSON list of strings"),
        (StructuredOutput(kind=StructuredKind.GRAMMAR, spec="start: missing"), "structured output (grammar)"),
    ],
)
def test_what_does_not_compile_is_named_the_same_with_and_without_a_vocabulary(
    structured: StructuredOutput, message: str
) -> None:
    problem = grammar_problem(structured)
    assert problem is not None and message in problem
    with pytest.raises(ValueError) as caught:
        GrammarCompiler.for_bytes(320).build(structured)
    assert message in str(caught.value)
    assert grammar_problem(StructuredOutput(kind=StructuredKind.REGEX, spec="[a-z]+")) is None


@given(
    st.lists(st.booleans(), min_size=1, max_size=200),
    st.integers(min_value=0, max_value=2**64 - 1),
)
def test_the_nth_allowed_id_is_the_one_at_the_draw_among_the_allowed_ids(bits: list[bool], draw: int) -> None:
    vocab = len(bits)
    padded = bits + [True] * (-vocab % 32)  # set bits past the vocabulary must not count
    mask = np.packbits(np.array(padded, dtype=np.uint8), bitorder="little").view(np.int32)
    ids = allowed_ids(mask, vocab)
    assert nth_allowed(mask, vocab, draw) == (int(ids[draw % len(ids)]) if len(ids) else None)

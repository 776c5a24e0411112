"""The local scheduler with structured outputs: each request's grammar is built at admission (from its
generated tokens when it arrives with some), advanced once per sampled token, and ends the request
when it is complete; bad constraints are refused with the reason."""

from __future__ import annotations

import json

import pytest
from llguidance import LLTokenizer

from agents.engines.grammar import GrammarCompiler, GrammarMatcher
from agents.engines.local_scheduler import LocalScheduler, LocalSchedulerConfig
from agents.engines.protocol import FinishReason, RejectReason, RequestRejected
from schemas import SamplingParams, StructuredKind, StructuredOutput

EOS = 257
VOCAB = 320
REGEX = StructuredOutput(kind=StructuredKind.REGEX, spec="(ab|cd){6}")
SCHEMA = StructuredOutput(
    kind=StructuredKind.JSON_SCHEMA,
    spec=json.dumps(
        {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "s": {"enum": ["x", "yz"]}},
            "required": ["n", "s"],
            "additionalProperties": False,
        }
    ),
    any_whitespace=False,
)


def make(num_blocks: int = 64, *, constraints: GrammarCompiler | None = None) -> LocalScheduler:
    config = LocalSchedulerConfig(
        num_blocks=num_blocks, block_size=4, max_model_len=512, vocab_size=VOCAB, eos_token_id=EOS
    )
    grammars = GrammarCompiler.for_bytes(VOCAB) if constraints is None else constraints
    return LocalScheduler(config, constraints=grammars)


def highest_allowed(sched: LocalScheduler, request_id: str) -> int:
    """A sampler that obeys the grammar: the highest id it allows below the specials (else EOS)."""
    constraint = sched.request(request_id).constraint
    assert isinstance(constraint, GrammarMatcher)
    allowed = [int(t) for t in constraint.allowed_token_ids() if t < 256]
    return max(allowed) if allowed else EOS


def run(
    sched: LocalScheduler, generated: dict[str, list[int]] | None = None
) -> tuple[dict[str, list[int]], dict[str, FinishReason]]:
    """Step until idle; each request's tokens (after those it was added with, ``generated``)."""
    tokens = {request_id: list(given) for request_id, given in (generated or {}).items()}
    finish: dict[str, FinishReason] = {}
    while sched.has_unfinished():
        plan = sched.schedule()
        ids = [p.request.request_id for p in plan.prefills if p.final] + [r.request_id for r in plan.decodes]
        for out in sched.update_from_output(plan, {i: highest_allowed(sched, i) for i in ids}):
            got = tokens.setdefault(out.request_id, [])
            assert out.first_index == len(got)
            got.extend(out.token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    return tokens, finish


def test_a_complete_grammar_finishes_the_request_even_with_ignore_eos_and_min_tokens() -> None:
    sched = make()
    sched.add_request(
        "r", [1, 2, 3], SamplingParams(max_tokens=100, min_tokens=50, ignore_eos=True, structured=REGEX)
    )
    tokens, finish = run(sched)
    assert bytes(tokens["r"]) == b"cd" * 6  # the last token completes it: no EOS is generated
    assert finish["r"] is FinishReason.STOP
    assert sched.num_constraint_refusals == 0


def test_max_tokens_still_cuts_a_constrained_request() -> None:
    sched = make()
    sched.add_request("r", [1, 2, 3], SamplingParams(max_tokens=5, structured=REGEX))
    tokens, finish = run(sched)
    assert bytes(tokens["r"]) == b"cdcdc" and finish["r"] is FinishReason.LENGTH


def test_preemption_by_recompute_does_not_feed_the_grammar_twice() -> None:
    reference, _ = run_pair(make())
    sched = make(num_blocks=7)  # two requests that outgrow the pool: one is preempted and recomputed
    tokens, finish = run_pair(sched)
    assert sched.num_preemptions > 0
    assert tokens == reference
    assert json.loads(bytes(tokens["json"])) == {"n": 9, "s": "yz"}
    assert bytes(tokens["regex"]) == b"cd" * 6 and set(finish.values()) == {FinishReason.STOP}


def run_pair(sched: LocalScheduler) -> tuple[dict[str, list[int]], dict[str, FinishReason]]:
    sched.add_request("json", [7] * 6, SamplingParams(max_tokens=40, structured=SCHEMA))
    sched.add_request("regex", [8] * 6, SamplingParams(max_tokens=40, structured=REGEX))
    return run(sched)


def test_a_request_with_generated_tokens_resumes_its_grammar_where_they_end() -> None:
    sched = make()
    generated = list(b'{"n":3,"s":"')
    sched.add_request(
        "r", [1, 2], SamplingParams(max_tokens=40, structured=SCHEMA), output_token_ids=generated
    )
    tokens, finish = run(sched, {"r": generated})
    assert bytes(tokens["r"]) == b'{"n":3,"s":"yz"}' and finish["r"] is FinishReason.STOP


def test_generated_tokens_the_grammar_refuses_are_a_rejection_naming_the_token() -> None:
    sched = make()
    with pytest.raises(RequestRejected, match=r"generated token 2 \(id 101\) does not follow") as caught:
        sched.add_request("r", [1], SamplingParams(structured=REGEX), output_token_ids=list(b"abe"))
    assert caught.value.reason is RejectReason.INVALID_SAMPLING
    assert "r" not in sched and sched.num_rejections == 1


@pytest.mark.parametrize(
    ("structured", "words"),
    [
        (StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec='{"type": "frog"}'), "json_schema"),
        (StructuredOutput(kind=StructuredKind.REGEX, spec="a(b"), "unclosed group"),
        (StructuredOutput(kind=StructuredKind.CHOICE, spec="[]"), "non-empty JSON list of strings"),
        (StructuredOutput(kind=StructuredKind.GRAMMAR, spec="root ::= missing"), "missing"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_with_the_reason(
    structured: StructuredOutput, words: str
) -> None:
    sched = make()
    with pytest.raises(RequestRejected, match=words) as caught:
        sched.add_request("r", [1], SamplingParams(structured=structured))
    assert caught.value.reason is RejectReason.INVALID_SAMPLING
    assert f"structured output ({structured.kind.value}) is invalid" in str(caught.value)
    sched.add_request("ok", [1], SamplingParams(max_tokens=2))  # others are unaffected


def test_without_a_compiler_constraints_are_refused_and_bias_ids_are_checked() -> None:
    config = LocalSchedulerConfig(num_blocks=8, block_size=4, max_model_len=64, vocab_size=VOCAB)
    sched = LocalScheduler(config)
    with pytest.raises(RequestRejected, match="does not enforce structured outputs"):
        sched.add_request("r", [1], SamplingParams(structured=REGEX))
    with pytest.raises(RequestRejected, match=r"logit_bias token id 320 is outside 0..319"):
        sched.add_request("b", [1], SamplingParams(logit_bias=((5, 1.0), (320, -1.0))))


def test_a_sampled_token_the_grammar_refuses_ends_the_request_and_is_counted() -> None:
    sched = make()
    sched.add_request("r", [1, 2], SamplingParams(max_tokens=10, structured=REGEX))
    plan = sched.schedule()
    (out,) = sched.update_from_output(plan, {"r": ord("z")})
    assert out.finish_reason is FinishReason.STOP and sched.num_constraint_refusals == 1
    assert not sched.has_unfinished()


def test_compiled_grammars_are_cached_per_constraint_in_a_bounded_lru() -> None:
    grammars = GrammarCompiler.for_bytes(VOCAB, cache_size=2)
    sched = make(constraints=grammars)
    for index in range(3):
        sched.add_request(f"a{index}", [1], SamplingParams(structured=REGEX))
    assert grammars.num_compiled == 1
    loose = StructuredOutput(kind=SCHEMA.kind, spec=SCHEMA.spec, any_whitespace=True)
    for structured in (SCHEMA, loose):  # the whitespace option is part of the key
        grammars.check(structured)
    assert grammars.num_compiled == 3  # two kept: REGEX, the least recently used, was dropped
    grammars.check(loose)
    assert grammars.num_compiled == 3
    grammars.check(REGEX)
    assert grammars.num_compiled == 4


def test_a_vocabulary_that_does_not_load_refuses_constrained_requests_only() -> None:
    calls: list[int] = []

    def missing() -> LLTokenizer:
        calls.append(1)
        raise FileNotFoundError("no tokenizer.json in /nowhere")

    sched = make(constraints=GrammarCompiler(missing, VOCAB))
    for _ in range(2):
        with pytest.raises(RequestRejected, match=r"vocabulary does not load \(no tokenizer.json in"):
            sched.add_request("r", [1], SamplingParams(structured=REGEX))
    assert len(calls) == 1  # the same answer the second time, without loading again
    assert sched.add_request("free", [1], SamplingParams(max_tokens=2))

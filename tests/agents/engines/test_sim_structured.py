"""The sim engine's structured outputs: its hashed picks among the ids the grammar allows give valid
JSON, regex matches and choices, the same with or without a migration; the sampling parameters it has
no model for (logit bias, min-p) change nothing."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from agents.engines.protocol import FinishReason, RejectReason, RequestRejected
from agents.engines.sim import SimEngine
from schemas import SamplingParams, StructuredKind, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["a", "b", "c"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 4},
        "inner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "scores", "inner"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]
CONSTRAINTS = {
    "json": StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=json.dumps(SCHEMA)),
    "compact-json": StructuredOutput(
        kind=StructuredKind.JSON_SCHEMA, spec=json.dumps(SCHEMA), any_whitespace=False
    ),
    "regex": StructuredOutput(kind=StructuredKind.REGEX, spec=REGEX),
    "choice": StructuredOutput(kind=StructuredKind.CHOICE, spec=json.dumps(CHOICES)),
}
PROMPT = list(b"hello there")


def check(name: str, tokens: list[int]) -> None:
    text = bytes(t for t in tokens if t < 256).decode("utf-8")
    if name.endswith("json"):
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "regex":
        assert re.fullmatch(REGEX, text)
    else:
        assert text in CHOICES


def run(engine: SimEngine, tokens: dict[str, list[int]]) -> dict[str, FinishReason]:
    finish: dict[str, FinishReason] = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            got = tokens.setdefault(out.request_id, [])
            assert out.first_index == len(got)
            got.extend(out.token_ids)
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    return finish


def alone(request_id: str, sampling: SamplingParams) -> list[int]:
    engine = SimEngine("tiny-test")
    engine.add_request(request_id, PROMPT, sampling)
    tokens: dict[str, list[int]] = {}
    assert run(engine, tokens) == {request_id: FinishReason.STOP}
    return tokens[request_id]


@pytest.mark.parametrize("name", CONSTRAINTS)
def test_constrained_sim_output_is_valid_for_every_request(name: str) -> None:
    engine = SimEngine("tiny-test")
    for index in range(8):
        engine.add_request(
            f"{name}-{index}", PROMPT, SamplingParams(max_tokens=250, structured=CONSTRAINTS[name])
        )
    tokens: dict[str, list[int]] = {}
    finish = run(engine, tokens)
    assert set(finish.values()) == {FinishReason.STOP}
    for got in tokens.values():
        check(name, got)
    assert len({tuple(got) for got in tokens.values()}) > 1  # the picks differ by request


@pytest.mark.parametrize("name", ["json", "regex"])
def test_a_constrained_sim_request_is_the_same_whether_or_not_it_migrates(name: str) -> None:
    sampling = SamplingParams(max_tokens=250, structured=CONSTRAINTS[name])
    reference = alone("moving", sampling)
    for steps in (1, 3, len(reference) // 2):
        source, destination = SimEngine("tiny-test"), SimEngine("tiny-test")
        source.add_request("moving", PROMPT, sampling)
        tokens: dict[str, list[int]] = {}
        for _ in range(steps):
            for out in source.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
        source.suspend("moving")
        request = source.scheduler.request("moving")
        buffer = source.export_blocks("moving", range(len(request.block_ids)))
        reservation = destination.reserve(buffer.num_blocks)
        destination.import_blocks(reservation.block_ids, buffer)
        destination.admit_migrated(
            "moving", request.prompt_token_ids, request.output_token_ids, sampling, 0, [reservation]
        )
        source.release_request("moving")
        assert run(destination, tokens) == {"moving": FinishReason.STOP}
        assert tokens["moving"] == reference
    check(name, reference)
    rescued = SimEngine("tiny-test")  # a rescue: the prompt and the tokens delivered so far
    rescued.add_request("moving", PROMPT, sampling, output_token_ids=reference[:5])
    tokens = {"moving": reference[:5]}
    run(rescued, tokens)
    assert tokens["moving"] == reference


def test_logit_bias_and_min_p_change_no_sim_answer() -> None:
    plain = SamplingParams(max_tokens=250, structured=CONSTRAINTS["json"])
    reference = alone("r", plain)
    biased = SamplingParams(
        max_tokens=250, structured=CONSTRAINTS["json"], min_p=0.5, logit_bias=((65, 100.0),)
    )
    assert alone("r", biased) == reference


def test_a_bad_constraint_is_refused_naming_the_problem() -> None:
    bad = StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec='{"type": "object", "minProperties": "x"}')
    with pytest.raises(RequestRejected, match=r"structured output \(json_schema\) is invalid") as caught:
        SimEngine("tiny-test").add_request("r", PROMPT, SamplingParams(structured=bad))
    assert caught.value.reason is RejectReason.INVALID_SAMPLING

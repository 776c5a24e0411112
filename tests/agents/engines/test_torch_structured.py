"""The torch engine's structured outputs, logit bias and min-p on the tiny preset: constrained greedy
text validates, and stays the same when the request migrates mid-generation or is restarted from its
prompt and generated tokens (rescue); the sampler's processors follow vLLM's semantics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from agents.engines.protocol import FinishReason, RejectReason, RequestRejected
from agents.engines.tokenizer import HFTokenizer
from agents.engines.torch_engine import TorchEngine
from agents.engines.torch_engine.loader import load_model
from agents.engines.torch_engine.sampling import noise_seed
from schemas import SamplingParams, StructuredKind, StructuredOutput

PROMPT = list(b"Reply with the record as JSON: ")

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -50, "maximum": 50},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "inner": {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "level": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["ok", "level"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "kind", "tags", "inner"],
    "additionalProperties": False,
}
JSON = StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=json.dumps(SCHEMA), any_whitespace=False)
REGEX = r"[a-z]{2,6}-[0-9]{2,4}(\.(com|org))?"
CHOICES = ["positive", "negative", "neutral"]


def engine(**options: object) -> TorchEngine:
    return TorchEngine("tiny", **{"num_blocks": 64, "batch_invariant": True, **options})


def drain(
    target: TorchEngine, tokens: dict[str, list[int]], finish: dict[str, FinishReason] | None = None
) -> None:
    while target.has_unfinished():
        for out in target.step().outputs:
            got = tokens.setdefault(out.request_id, [])
            assert out.first_index == len(got)
            got.extend(out.token_ids)
            if finish is not None and out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason


def generate(sampling: SamplingParams, prompt: list[int] = PROMPT, request_id: str = "r") -> list[int]:
    target = engine()
    target.add_request(request_id, prompt, sampling)
    tokens: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    drain(target, tokens, finish)
    assert finish[request_id] is FinishReason.STOP  # the grammar ended it, not max_tokens
    return tokens[request_id]


def text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8")


@pytest.mark.parametrize("prompt", [PROMPT, list(b"Give the second record as JSON please. "), list(b"zzzz")])
def test_greedy_json_schema_output_validates(prompt: list[int]) -> None:
    tokens = generate(SamplingParams(max_tokens=200, structured=JSON), prompt)
    jsonschema.validate(json.loads(text(tokens)), SCHEMA)


def test_greedy_regex_choice_and_grammar_outputs_match() -> None:
    regex = StructuredOutput(kind=StructuredKind.REGEX, spec=REGEX)
    assert re.fullmatch(REGEX, text(generate(SamplingParams(max_tokens=40, structured=regex))))
    choice = StructuredOutput(kind=StructuredKind.CHOICE, spec=json.dumps(CHOICES))
    assert text(generate(SamplingParams(max_tokens=40, structured=choice))) in CHOICES
    gbnf = StructuredOutput(kind=StructuredKind.GRAMMAR, spec='root ::= "yes" | "no" | "maybe"')
    assert text(generate(SamplingParams(max_tokens=40, structured=gbnf))) in ("yes", "no", "maybe")
    # a seeded random request follows the grammar too
    seeded = SamplingParams(max_tokens=200, structured=JSON, temperature=1.0, seed=7)
    jsonschema.validate(json.loads(text(generate(seeded))), SCHEMA)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=200, structured=JSON),
        SamplingParams(max_tokens=200, structured=JSON, temperature=0.8, top_p=0.9, seed=11),
    ],
    ids=["greedy", "seeded"],
)
def test_a_constrained_request_migrated_mid_generation_continues_to_the_same_text(
    sampling: SamplingParams,
) -> None:
    reference = generate(sampling)
    source, destination = engine(), engine()
    source.add_request("r", PROMPT, sampling)
    destination.add_request("resident", list(b"another request here"), SamplingParams(max_tokens=30))
    tokens: dict[str, list[int]] = {}
    for _ in range(12):  # into the JSON: it is not complete yet
        for target in (source, destination):
            for out in target.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
    source.suspend("r")
    request = source.scheduler.request("r")
    assert 0 < request.num_output_tokens < len(reference)
    table = source.block_ids("r")
    buffer = source.export_blocks("r", range(len(table)))
    reservation = destination.reserve(buffer.num_blocks)
    destination.import_blocks(reservation.block_ids, buffer)
    destination.admit_migrated(
        "r", request.prompt_token_ids, request.output_token_ids, sampling, 0, [reservation]
    )
    source.release_request("r")
    finish: dict[str, FinishReason] = {}
    drain(destination, tokens, finish)
    assert tokens["r"] == reference and finish["r"] is FinishReason.STOP
    jsonschema.validate(json.loads(text(tokens["r"])), SCHEMA)


def test_a_rescue_from_the_prompt_and_generated_tokens_gives_the_same_text() -> None:
    sampling = SamplingParams(max_tokens=200, structured=JSON)
    reference = generate(sampling)
    for cut in (1, len(reference) // 2, len(reference) - 1):
        rescued = engine()
        rescued.add_request("r", PROMPT, sampling, output_token_ids=reference[:cut])
        tokens = {"r": reference[:cut]}
        drain(rescued, tokens)
        assert tokens["r"] == reference


def test_a_rescue_whose_tokens_break_the_grammar_is_refused() -> None:
    with pytest.raises(RequestRejected, match=r"generated token 1 \(id 125\) does not follow") as caught:
        engine().add_request("r", PROMPT, SamplingParams(structured=JSON), output_token_ids=list(b"{}"))
    assert caught.value.reason is RejectReason.INVALID_SAMPLING


def test_logit_bias_plus_100_forces_a_token_and_minus_100_forbids_it() -> None:
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    first = generate_free(plain)[0]
    assert generate_free(SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=((81, 100.0),))) == [81] * 8
    banned = generate_free(SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=((first, -100.0),)))
    assert first not in banned
    # the grammar's mask wins over a bias: only allowed ids can be pushed up
    choice = StructuredOutput(kind=StructuredKind.CHOICE, spec=json.dumps(["yes", "no"]))
    assert (
        text(generate(SamplingParams(max_tokens=8, structured=choice, logit_bias=((ord("n"), 100.0),))))
        == "no"
    )
    assert (
        text(generate(SamplingParams(max_tokens=8, structured=choice, logit_bias=((ord("y"), 100.0),))))
        == "yes"
    )
    with pytest.raises(RequestRejected, match=r"logit_bias of token 5 must be in \[-100, 100\]"):
        engine().add_request("x", PROMPT, SamplingParams(logit_bias=((5, 101.0),)))
    with pytest.raises(RequestRejected, match=r"logit_bias token id 320 is outside"):
        engine().add_request("x", PROMPT, SamplingParams(logit_bias=((320, 1.0),)))


def generate_free(sampling: SamplingParams) -> list[int]:
    target = engine()
    target.add_request("r", PROMPT, sampling)
    tokens: dict[str, list[int]] = {}
    drain(target, tokens)
    return tokens["r"]


def test_min_p_keeps_the_tokens_above_its_share_of_the_most_likely_one() -> None:
    """The first sampled token of 40 seeded requests equals the exponential race over the tokens a
    direct computation on the model's logits keeps (probability >= min_p x the highest, after the
    temperature); min_p 1 keeps the most likely token alone."""
    temperature = 0.5
    with torch.inference_mode():
        logits = load_model("tiny", device="cpu", seed=0).model.dense_logits(torch.tensor(PROMPT))[-1]
    probs = (logits / temperature).softmax(-1)
    ranked = probs.sort(descending=True).values
    min_p = float((ranked[3] + ranked[4]) / 2 / ranked[0])  # keeps the four most likely
    kept = probs >= min_p * probs.max()
    assert int(kept.sum()) == 4
    target = engine()
    seeds = range(40)
    for seed in seeds:
        target.add_request(
            f"s{seed}", PROMPT, SamplingParams(max_tokens=1, temperature=temperature, min_p=min_p, seed=seed)
        )
    tokens: dict[str, list[int]] = {}
    drain(target, tokens)
    expected = {}
    for seed in seeds:
        noise = torch.empty(logits.shape[-1]).exponential_(
            generator=torch.Generator().manual_seed(noise_seed(seed, 0))
        )
        expected[f"s{seed}"] = [int((probs.masked_fill(~kept, 0.0) / noise).argmax())]
    assert tokens == expected
    assert len({t[0] for t in tokens.values()}) > 1
    greedy = generate_free(SamplingParams(max_tokens=6, ignore_eos=True))
    assert (
        generate_free(SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.5, min_p=1.0, seed=3))
        == greedy
    )
    with pytest.raises(RequestRejected, match=r"min_p must be in \[0, 1\]"):
        engine().add_request("x", PROMPT, SamplingParams(min_p=1.5))


def test_a_checkpoint_tokenizer_constrains_its_multi_byte_tokens(tmp_path: Path) -> None:
    """A BPE vocabulary: the mask is over the checkpoint's tokens, and the text they decode to validates."""
    from agents.engines.vllm_engine.checkpoint import CheckpointSpec, build_checkpoint

    folder = build_checkpoint(tmp_path / "ckpt", CheckpointSpec(dtype="float32"))
    tokenizer = HFTokenizer(folder)
    target = TorchEngine(str(folder), num_blocks=64)
    prompt = tokenizer.encode("Give me the record: ")
    target.add_request("r", prompt, SamplingParams(max_tokens=200, structured=JSON))
    tokens: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    drain(target, tokens, finish)
    assert finish["r"] is FinishReason.STOP
    assert any(len(tokenizer.decode([t])) > 1 for t in tokens["r"])  # not a byte at a time
    jsonschema.validate(json.loads(tokenizer.decode(tokens["r"])), SCHEMA)


@pytest.mark.parametrize("core", ["process"])
def test_the_process_core_samples_under_the_grammar_mask(core: str) -> None:
    """The masks cross to the engine core process with the sampling rows: the same text as in process."""
    sampling = SamplingParams(max_tokens=200, structured=JSON)
    target = engine(core=core)
    try:
        target.add_request("r", PROMPT, sampling)
        tokens: dict[str, list[int]] = {}
        drain(target, tokens)
    finally:
        target.close()
    assert tokens["r"] == generate(sampling)

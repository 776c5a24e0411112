"""An agent's delta buffer keeps a request's prompt logprobs: a resend from index 0 carries them."""

from __future__ import annotations

from agents.deltas import DeltaBuffer
from schemas import SamplingParams, TokenDelta

PROMPT_LOGPROBS = (None, -1.5, -0.25)
PROMPT_TOP = ((), ((7, -0.5),), ((8, -0.25),))


def _delta(first: int, tokens: tuple[int, ...], finish: str | None = None, **prompt: object) -> TokenDelta:
    return TokenDelta(
        request_id="r",
        instance_id="a",
        owner_epoch=0,
        first_index=first,
        token_ids=tokens,
        finish_reason=finish,
        num_prompt_tokens=3,
        **prompt,
    )  # type: ignore[arg-type]


def test_a_resend_from_zero_carries_the_prompt_logprobs() -> None:
    buffer = DeltaBuffer(steps_per_request=4, finished_limit=1)
    record = buffer.open(
        "r",
        owner_epoch=0,
        stream=False,
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(prompt_logprobs=1),
        priority=0,
    )
    record.prompt_logprobs, record.prompt_top_logprobs = PROMPT_LOGPROBS, PROMPT_TOP
    buffer.record(_delta(0, (10,)))  # a first delta without them (as an engine's resend rebuilt it)
    buffer.record(_delta(1, (11,), "length"))
    (first, last) = buffer.resend("r", 0) or []
    assert first.prompt_logprobs == PROMPT_LOGPROBS and first.prompt_top_logprobs == PROMPT_TOP
    assert last.prompt_logprobs is None
    (tail,) = buffer.resend("r", 1) or []  # not from 0: none
    assert tail.first_index == 1 and tail.prompt_logprobs is None
    buffer.close("r")
    assert (buffer.resend("r", 0) or [])[0].prompt_logprobs == PROMPT_LOGPROBS  # finished, still kept

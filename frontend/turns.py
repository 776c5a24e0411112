"""One request's text side while it runs: token chunks in, text pieces out, stop strings applied.

A :class:`Turn` wraps the gateway's :class:`~frontend.gateway.RequestStream`
(token ids in order, whichever instance produces them) with an incremental
UTF-8-safe detokenizer and a stop-string matcher, and counts what the client
gets: output tokens, and the sampled tokens' logprobs when asked for.
:func:`pieces` turns the stream into :class:`Piece` s; the last one carries
the finish reason. How a piece becomes an SSE chunk or a response body, and
how a turn is admitted and ended, is the HTTP layer's
(:mod:`frontend.routes.generation`); this module knows no HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from frontend.detokenize import IncrementalDetokenizer, StopStringMatcher
from frontend.gateway import RequestStream
from schemas import Alternatives, FinishReason

__all__ = ["Piece", "Turn", "padded_logprobs", "padded_top", "pieces"]


@dataclass
class Turn:
    """One request in progress at the HTTP layer: text state, counts, and whether it has ended."""

    stream: RequestStream
    endpoint: str
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    want_logprobs: bool
    num_prompt_tokens: int
    num_output_tokens: int = 0
    finish_reason: FinishReason | None = None
    ended: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Alternatives] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.stream.request_id


@dataclass(frozen=True)
class Piece:
    """Text released by one chunk of tokens (maybe empty), the tokens themselves, and the end."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason | None
    top_logprobs: tuple[Alternatives, ...] = ()

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


async def pieces(turn: Turn) -> AsyncIterator[Piece]:
    """Text pieces of a turn, stop strings applied; the last piece carries the finish reason."""
    while True:
        chunk = await turn.stream.next_chunk()
        if chunk is None:
            reason = turn.stream.finish_reason or FinishReason.STOP
            tail = turn.stops.push(turn.detokenizer.flush())[0] + turn.stops.flush()
            turn.finish_reason = reason
            yield Piece(tail, (), (), reason)
            return
        tokens = chunk.token_ids
        turn.num_output_tokens += len(tokens)
        logprobs = chunk.logprobs or ()
        top = chunk.top_logprobs or ()
        if turn.want_logprobs:
            turn.token_ids.extend(tokens)
            turn.logprobs.extend(logprobs)
            turn.top_logprobs.extend(top)
        text = turn.detokenizer.push(tokens)
        if chunk.finish_reason is not None:
            text += turn.detokenizer.flush()
        safe, stopped = turn.stops.push(text)
        if stopped:
            turn.finish_reason = FinishReason.STOP
            yield Piece(safe, tokens, logprobs, FinishReason.STOP, top)
            return
        if chunk.finish_reason is not None:
            safe += turn.stops.flush()
            turn.finish_reason = chunk.finish_reason
            yield Piece(safe, tokens, logprobs, chunk.finish_reason, top)
            return
        if safe or tokens:  # tokens whose text is held back still make a chunk, as in vLLM
            yield Piece(safe, tokens, logprobs, None, top)


def padded_top(token_ids: Sequence[int], top: Sequence[Alternatives]) -> tuple[Alternatives, ...]:
    """Alternatives aligned with tokens (none where the engine gave none)."""
    values = tuple(top)[: len(token_ids)]
    return values + ((),) * (len(token_ids) - len(values))


def padded_logprobs(token_ids: Sequence[int], logprobs: Sequence[float]) -> tuple[float, ...]:
    """Logprobs aligned with tokens (only called when the engine gave them; a short tail pads 0.0)."""
    values = tuple(logprobs)[: len(token_ids)]
    return values + (0.0,) * (len(token_ids) - len(values))

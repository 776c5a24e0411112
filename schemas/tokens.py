"""Token deltas published by agents (core NATS).

A request whose ``GenerateRequest`` names a ``delta_subject`` (the frontend's
``<prefix>.tokb.<frontend_id>``) gets its deltas in :class:`TokenDeltaBatch`
messages there: one message per agent step for all of that frontend's
requests. Any other request gets one :class:`TokenDelta` per step on
``<prefix>.tok.<request_id>``.
"""

from __future__ import annotations

from schemas.base import Message
from schemas.reasons import FinishReason

__all__ = ["Alternatives", "TokenDelta", "TokenDeltaBatch"]

#: the most likely tokens at one position of the output: (token id, logprob) pairs, most likely first
Alternatives = tuple[tuple[int, float], ...]


class TokenDelta(Message, frozen=True, kw_only=True, tag="token_delta"):
    """One engine step's output for one request.

    ``first_index`` is the index of ``token_ids[0]`` among the request's
    generated tokens; ``owner_epoch`` counts how many times the request has
    moved, so a receiver can drop deltas from a stale owner.
    """

    request_id: str
    instance_id: str
    owner_epoch: int
    first_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    #: per token, the most likely (token id, logprob) pairs, most likely first (``top_logprobs``)
    top_logprobs: tuple[Alternatives, ...] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    #: prompt tokens the engine found in its prefix cache (OpenAI's ``cached_tokens``)
    num_cached_tokens: int = 0
    #: ``SamplingParams.prompt_logprobs``: on the delta with ``first_index`` 0 (the first one a
    #: request publishes, sent again on a resend from 0), the logprob of each prompt token given
    #: the tokens before it (None for the first prompt token) ...
    prompt_logprobs: tuple[float | None, ...] | None = None
    #: ... and at each prompt position the most likely (token id, logprob) pairs (empty for the first)
    prompt_top_logprobs: tuple[Alternatives, ...] | None = None


class TokenDeltaBatch(Message, frozen=True, kw_only=True, tag="token_delta_batch"):
    """One agent step's deltas for every request of one frontend (``GenerateRequest.delta_subject``)."""

    instance_id: str
    deltas: tuple[TokenDelta, ...]

"""OpenAI response bodies and SSE chunks, built as plain dicts (encoded with msgspec). Pure.

Completions (``text_completion``) and chat completions (``chat.completion`` /
``chat.completion.chunk``), usage blocks (with the prompt's cached tokens), and logprobs in each endpoint's
format. Token strings for logprobs come from a ``decode_one`` function so this
module needs no tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from schemas import Alternatives

__all__ = [
    "DONE",
    "Json",
    "chat_choice",
    "chat_chunk",
    "chat_logprobs",
    "chat_response",
    "completion_choice",
    "completion_chunk",
    "completion_logprobs",
    "completion_response",
    "sse",
    "usage",
    "usage_chunk",
]

#: an OpenAI body or chunk, as a plain dict
Json = dict[str, Any]

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def sse(payload: Json) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> Json:
    """OpenAI's usage block. ``prompt_tokens_details.cached_tokens`` (prompt tokens the engine found in
    its prefix cache) is always there, 0 on a miss: OpenAI's shape (vLLM adds it only with
    ``--enable-prompt-tokens-details`` and a hit)."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Alternatives],
    decode_one: Callable[[int], str], text_offset: int,
) -> Json:
    """``top``: the most likely tokens at each position; each position's ``top_logprobs`` holds them
    and the sampled token (as vLLM's)."""
    tokens = [decode_one(t) for t in token_ids]
    offsets: list[int] = []
    at = text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": [
            {**{decode_one(t): v for t, v in alternatives}, token: lp}
            for token, lp, alternatives in zip(tokens, logprobs, top, strict=True)
        ],
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Alternatives],
    decode_one: Callable[[int], str],
) -> Json:
    """``top``: the most likely tokens at each position (each position's ``top_logprobs``)."""
    content = []
    for token_id, lp, alternatives in zip(token_ids, logprobs, top, strict=True):
        token = decode_one(token_id)
        content.append({
            "token": token, "logprob": lp, "bytes": list(token.encode("utf-8")),
            "top_logprobs": [_chat_alternative(decode_one(t), v) for t, v in alternatives],
        })
    return {"content": content}


def _chat_alternative(token: str, logprob: float) -> Json:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def completion_chunk(
    request_id: str, created: int, model: str, text: str, finish_reason: str | None,
    logprobs: Json | None = None, *, with_usage_field: bool = False, index: int = 0,
) -> Json:
    chunk: Json = {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [completion_choice(index, text, finish_reason, logprobs)],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def chat_chunk(
    request_id: str, created: int, model: str, delta: Json, finish_reason: str | None,
    logprobs: Json | None = None, *, with_usage_field: bool = False, index: int = 0,
) -> Json:
    chunk: Json = {
        "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: Json | None = None
) -> Json:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str, logprobs: Json | None = None) -> Json:
    return {
        "index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def completion_response(
    request_id: str, created: int, model: str, choices: list[Json],
    num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0,
) -> Json:
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": choices, "usage": usage(num_prompt_tokens, num_output_tokens, num_cached_tokens),
    }


def chat_response(
    request_id: str, created: int, model: str, choices: list[Json],
    num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0,
) -> Json:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": choices, "usage": usage(num_prompt_tokens, num_output_tokens, num_cached_tokens),
    }


def usage_chunk(
    request_id: str, object_: str, created: int, model: str, num_prompt_tokens: int, num_output_tokens: int,
    num_cached_tokens: int = 0,
) -> Json:
    """The last SSE chunk when ``stream_options.include_usage`` is set: no choices, the usage block."""
    return {
        "id": request_id, "object": object_, "created": created, "model": model, "choices": [],
        "usage": usage(num_prompt_tokens, num_output_tokens, num_cached_tokens),
    }

"""The Responses API's ``response`` object and the typed events of its stream, as plain dicts. Pure.

:func:`response_object` is OpenAI's shape: ``id`` (``resp_...``), ``object: "response"``,
``created_at``, ``status`` (``in_progress``, ``completed``, ``incomplete`` with
``incomplete_details.reason: "max_output_tokens"``, ``failed`` with ``error``), ``model``,
``output`` items, ``usage`` (``input_tokens`` with ``input_tokens_details.cached_tokens``,
``output_tokens``, ``total_tokens``) and the request's settings echoed (:func:`settings_of`).
:class:`EventStream` numbers the events of one stream (``sequence_number`` from 0) and encodes
each as SSE (``event:`` and ``data:`` lines, as OpenAI sends them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from frontend.responses_api.models import ResponsesRequest

__all__ = ["EventStream", "Json", "item_page", "response_object", "settings_of", "usage"]

Json = dict[str, Any]
_encode = msgspec.json.Encoder().encode


def usage(num_input_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> Json:
    return {
        "input_tokens": num_input_tokens,
        "input_tokens_details": {"cached_tokens": num_cached_tokens},
        "output_tokens": num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_input_tokens + num_output_tokens,
    }


def settings_of(body: ResponsesRequest, tools: list[Json]) -> Json:
    """The request's settings a response object repeats (``tools`` in the Responses API's flat shape)."""
    text_format: Json = {"type": "text"}
    if body.text is not None and body.text.format is not None:
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True)
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": dict(body.metadata or {}),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": text_format},
        "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
        "tools": tools,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "user": body.user,
    }


def response_object(
    response_id: str,
    created_at: int,
    model: str,
    settings: Mapping[str, Any],
    *,
    status: str,
    output: list[Json],
    usage_block: Json | None = None,
    incomplete_reason: str | None = None,
    error: Json | None = None,
) -> Json:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        "model": model,
        "output": output,
        "reasoning": {"effort": None, "summary": None},
        "usage": usage_block,
        **settings,
    }


class EventStream:
    """One stream's events, numbered in the order they are made."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def event(self, type_: str, **fields: Any) -> bytes:
        """The SSE bytes of event ``type_`` with ``fields`` and the next sequence number."""
        payload = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + type_.encode() + b"\ndata: " + _encode(payload) + b"\n\n"


def item_page(items: list[Json], *, after: str | None, limit: int, order: str) -> Json:
    """One page of a response's input items as OpenAI lists them (``order`` desc: the last first),
    starting after the item whose id is ``after`` (none such: an empty page)."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item.get("id") for item in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }

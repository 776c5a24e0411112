"""The pydantic model of a ``POST /v1/responses`` body, and the options it refuses.

:class:`ResponsesRequest` declares OpenAI's fields with their ranges (so the
OpenAPI schema documents them); unknown fields are accepted and ignored, as
on the chat route, unless the value would change the answer:
:data:`REFUSED_OPTIONS` lists those (built-in tools, reasoning, background
mode, ``include``, ...) and :func:`refuse_options` answers a 400 naming the
first one set. ``input`` items are plain dicts here; :mod:`frontend.responses_api.items`
checks them. ``text.format`` is flat, unlike chat's ``response_format``:
``{"type": "json_schema", "name", "schema", "strict"}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from frontend.errors import invalid_parameter

__all__ = ["REFUSED_OPTIONS", "ResponsesRequest", "TextConfig", "TextFormat", "refuse_options"]

_MAX_INT = 2**31 - 1


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its name, schema and strict."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=_MAX_INT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    priority: Annotated[int, Field(ge=-1000, le=1000)] | None = None


def _set(value: Any) -> bool:
    return value not in (None, False, 0, "", [], {})


def _reasoning_set(request: Mapping[str, Any]) -> bool:
    reasoning = request.get("reasoning")
    if isinstance(reasoning, Mapping):
        return any(value is not None for value in reasoning.values())
    return reasoning is not None


#: Options of the Responses API shoal does not implement whose value changes the answer, with what
#: makes the value count and the message of the 400 that names them. Options that change nothing a
#: client reads (``user``, ``service_tier``, ``safety_identifier``, ``prompt_cache_key``,
#: ``max_tool_calls`` with no built-in tools, ``stream_options``) are accepted and ignored.
REFUSED_OPTIONS: dict[str, tuple[Callable[[Mapping[str, Any]], bool], str]] = {
    "background": (lambda r: _set(r.get("background")), "background mode is not supported"),
    "reasoning": (_reasoning_set, "reasoning options are not supported: the model has no reasoning mode"),
    "include": (
        lambda r: _set(r.get("include")),
        "include is not supported (no built-in tools, no logprobs)",
    ),
    "top_logprobs": (lambda r: _set(r.get("top_logprobs")), "top_logprobs is not supported"),
    "conversation": (
        lambda r: r.get("conversation") is not None,
        "conversations are not supported; continue with previous_response_id",
    ),
    "prompt": (lambda r: r.get("prompt") is not None, "prompt templates are not supported"),
    "modalities": (
        lambda r: isinstance(r.get("modalities"), list) and "audio" in r["modalities"],
        "audio output is not supported",
    ),
}


def refuse_options(request: ResponsesRequest) -> None:
    """A 400 for the first refused option the request sets (:data:`REFUSED_OPTIONS`), for
    ``truncation: auto`` and for a ``text.verbosity`` other than the default."""
    extra = request.model_extra or {}
    for name, (is_set, message) in REFUSED_OPTIONS.items():
        if name in extra and is_set(extra):
            raise invalid_parameter(message, name)
    if request.truncation == "auto":
        raise invalid_parameter(
            "truncation 'auto' is not supported: a prompt too long is a 400", "truncation"
        )
    if request.text is not None and request.text.verbosity not in (None, "medium"):
        raise invalid_parameter("text.verbosity is not supported", "text.verbosity")

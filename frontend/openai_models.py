"""Pydantic models of the OpenAI requests the frontend accepts, and their translation to shoal's terms.

:class:`CompletionRequest` and :class:`ChatCompletionRequest` declare every
field with its range, so FastAPI's OpenAPI schema documents them and a
schema-driven fuzzer (schemathesis) can exercise them. Unknown fields are
accepted and ignored, as OpenAI clients and benchmark tools send many, unless
the value would change the answer (:data:`REFUSED_OPTIONS`: tool calling,
audio, beam search ...): such a request gets a 400 naming the field, never an
answer that ignored it. The vLLM extensions real benchmark clients send are
accepted: ``ignore_eos``, ``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids``; ``priority`` is shoal's extension
(lower runs sooner, as in vLLM). Structured outputs (``response_format``,
``structured_outputs``, ``guided_*``) are checked and translated in
:mod:`frontend.structured`; ``logit_bias`` maps token ids (as strings, OpenAI's
form) to a bias in [-100, 100]. Checks that depend on more than one field (an
unsupported option, a token id past the vocabulary) raise
:class:`~frontend.errors.APIError` in :func:`sampling_of`. Responses are built
as plain dicts in :mod:`frontend.responses`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from frontend.errors import APIError, invalid_parameter
from frontend.structured import (
    ResponseFormat,
    StructuredOutputsOptions,
    constraint_fields,
    structured_of,
)
from schemas import SamplingParams, StructuredOutput

__all__ = [
    "REFUSED_OPTIONS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "FunctionCall",
    "StreamOptions",
    "ToolCall",
    "logit_bias_of",
    "prompt_logprobs_of",
    "refuse_ignored_options",
    "sampling_of",
    "stop_strings_of",
    "wants_logprobs",
]

_MAX_INT = 2**31 - 1
_TokenId = Annotated[int, Field(ge=0, le=_MAX_INT)]
#: OpenAI's range of a logit bias
_Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Annotated[int, Field(ge=1, le=_MAX_INT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=_MAX_INT)] | None = None
    #: vLLM's: drop tokens whose probability is below min_p times the most likely one's
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    #: OpenAI's: token id (as a string) -> bias added to its logit
    logit_bias: dict[str, _Bias] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=_MAX_INT)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[_TokenId], Field(max_length=64)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    #: vLLM's: the logprob of each prompt token and this many alternatives (``prompt_logprobs`` in the answer)
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    priority: Annotated[int, Field(ge=-1000, le=1000)] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsOptions | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string or token ids, or a list of them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    #: 0 only with ``echo``: the prompt is scored and echoed, nothing generated (as in vLLM)
    max_tokens: Annotated[int, Field(ge=0, le=_MAX_INT)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = False
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    #: the arguments as JSON text
    arguments: str


class ToolCall(BaseModel):
    """A tool call of an earlier assistant message, as the client sends it back."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: an assistant message's tool calls; a ``tool`` message answers one of them by ``tool_call_id``
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=_MAX_INT)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool | None = True
    #: function tools (:func:`frontend.tools.parse_tools` checks them: a 400 naming ``tools``)
    tools: list[dict[str, Any]] | None = None
    #: "none", "auto", "required" or ``{"type": "function", "function": {"name": ...}}``
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def stop_strings_of(request: _Common, max_stop_strings: int) -> tuple[str, ...]:
    """The request's stop strings (empty ones dropped); 400 if there are too many."""
    raw = request.stop
    stops = [raw] if isinstance(raw, str) else list(raw or [])
    if len(stops) > max_stop_strings:
        raise invalid_parameter(f"at most {max_stop_strings} stop strings are supported", "stop")
    return tuple(s for s in stops if s)


def _set(value: Any) -> bool:
    return value not in (None, False, 0, "", [], {})


def _nonempty(name: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda request: _set(request.get(name))


def _tools_used(request: Mapping[str, Any], tools: str, choice: str) -> bool:
    return _set(request.get(tools)) and request.get(choice) != "none"


#: Options shoal does not implement whose value changes the answer, with what makes the value count
#: and why it is refused: a request that sets one gets a 400 naming it (vLLM's fields among them, as
#: real clients send them). Options that change nothing a client reads (``user``, ``metadata``,
#: ``store``, ``service_tier``, ``prediction`` ...) stay accepted and ignored.
REFUSED_OPTIONS: dict[str, tuple[Callable[[Mapping[str, Any]], bool], str]] = {
    "functions": (lambda r: _tools_used(r, "functions", "function_call"),
                  "function calling is not supported (functions are accepted with function_call 'none')"),
    "audio": (_nonempty("audio"), "audio output is not supported"),
    "modalities": (lambda r: isinstance(r.get("modalities"), list) and "audio" in r["modalities"],
                   "audio output is not supported"),
    "bad_words": (_nonempty("bad_words"), "bad_words is not supported"),
    "allowed_token_ids": (_nonempty("allowed_token_ids"), "allowed_token_ids is not supported"),
    "use_beam_search": (_nonempty("use_beam_search"), "beam search is not supported"),
    # vLLM's chat echo (the last message's content before the answer); completions declare their own
    "echo": (_nonempty("echo"), "echo is not supported on chat completions (it is on completions)"),
    "include_stop_str_in_output": (_nonempty("include_stop_str_in_output"),
                                   "include_stop_str_in_output is not supported"),
}


def refuse_ignored_options(request: BaseModel) -> None:
    """A 400 for the first option of :data:`REFUSED_OPTIONS` the request sets (see there)."""
    extra = request.model_extra or {}
    for name, (is_set, message) in REFUSED_OPTIONS.items():
        if name in extra and is_set(extra):
            raise invalid_parameter(message, name)


def _unsupported(condition: bool, message: str, param: str) -> None:
    if condition:
        raise invalid_parameter(message, param)


def wants_logprobs(request: CompletionRequest | ChatCompletionRequest) -> bool:
    if isinstance(request, ChatCompletionRequest):
        return bool(request.logprobs)
    return request.logprobs is not None


def logit_bias_of(request: _Common, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs; a 400 for a key that is not a token id (of the
    vocabulary, when ``vocab_size`` is known)."""
    pairs = []
    for key, bias in (request.logit_bias or {}).items():
        token = int(key) if key.strip().isascii() and key.strip().isdigit() else -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            where = "" if vocab_size is None else f" in [0, {vocab_size})"
            raise invalid_parameter(f"logit_bias key {key!r} is not a token id{where}", "logit_bias")
        pairs.append((token, float(bias)))
    return tuple(pairs)


def prompt_logprobs_of(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives at each prompt position the engine computes (None: no prompt logprobs):
    vLLM's ``prompt_logprobs``, else for an echoed completion its ``logprobs``. vLLM's 400 for
    ``prompt_logprobs`` above 0 on a stream (the answer's field is not streamed)."""
    k = request.prompt_logprobs
    if k is not None and k > 0 and request.stream:
        raise invalid_parameter("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    if k is None and isinstance(request, CompletionRequest) and request.echo:
        k = request.logprobs
    return k


def sampling_of(
    request: CompletionRequest | ChatCompletionRequest, *, max_tokens: int, vocab_size: int | None = None,
    structured: StructuredOutput | None = None,
) -> SamplingParams:
    """The engine's sampling parameters for a request whose output may be ``max_tokens`` long.

    Raises a 400 :class:`APIError` for options shoal does not support yet
    (``best_of > 1``, ``suffix``, and :data:`REFUSED_OPTIONS`; ``max_tokens`` 0 without
    ``echo``), for a bad output constraint (:func:`~frontend.structured.structured_of`) and for
    a ``logit_bias`` token id outside the vocabulary (``vocab_size``, when known).
    ``structured``: a constraint the route derived from another field (``tool_choice`` required
    or a named function); a request that also constrains its output with ``response_format`` /
    ``structured_outputs`` / ``guided_*`` is a 400 naming that field. ``n`` is the route's: each
    choice is a request.
    """
    refuse_ignored_options(request)
    if structured is not None:
        if fields := constraint_fields(request):
            raise invalid_parameter(
                f"{fields[0]} cannot be combined with tool_choice 'required' or a named function", fields[0])
    else:
        structured = structured_of(request)
    if isinstance(request, CompletionRequest):
        _unsupported((request.best_of or 1) != 1, "best_of > 1 is not supported", "best_of")
        _unsupported(request.suffix is not None, "suffix is not supported", "suffix")
        _unsupported(request.max_tokens == 0 and not request.echo,
                     "max_tokens must be at least 1 (0 only with echo)", "max_tokens")
        top_logprobs = request.logprobs or 0
    else:
        top_logprobs = request.top_logprobs or 0
        if top_logprobs and not request.logprobs:
            raise invalid_parameter("top_logprobs needs logprobs: true", "top_logprobs")
    prompt_logprobs = prompt_logprobs_of(request)
    min_tokens = request.min_tokens or 0
    if min_tokens > max_tokens:
        raise invalid_parameter(f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    top_k = request.top_k if request.top_k not in (None, 0) else -1
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=-1 if top_k is None else top_k,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            seed=None if request.seed is None else request.seed % (2**63),
            ignore_eos=bool(request.ignore_eos),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            logprobs=wants_logprobs(request),
            top_logprobs=top_logprobs,
            min_p=request.min_p or 0.0,
            logit_bias=logit_bias_of(request, vocab_size),
            structured=structured,
            prompt_logprobs=prompt_logprobs,
        )
    except (TypeError, ValueError) as exc:  # pragma: no cover - the model's ranges already hold
        raise APIError(400, f"invalid sampling parameters: {exc}") from exc

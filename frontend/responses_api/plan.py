"""What a ``POST /v1/responses`` request asks for, decided before it runs: :func:`plan_of`.

The conversation is the previous response's (``previous_response_id``: its items and output, read
from the store; 404 if it is not there) followed by this request's ``input``; ``instructions``
become the system message (those of the previous response are not carried over, as in OpenAI's
API). The chat messages are rendered with the model's chat template and the function tools
(:func:`frontend.tokenization.chat_prompt_ids`), as chat completions renders them. The token budget
is the chat route's (:func:`~frontend.routes.generation.output_budget`, ``max_output_tokens``),
the output constraint comes from ``text.format`` (``json_object`` / ``json_schema``) or from a
forced ``tool_choice`` (``required`` or a named function: a JSON schema, as vLLM's); both at once
is a 400 naming ``text.format``. Sampling is checked as chat completions checks it
(:func:`~frontend.openai_models.sampling_of`), and takes chat's sampling extensions
(:data:`SAMPLING_EXTENSIONS`: ``seed``, ``top_k``, ``min_p``, ``logit_bias`` ...) when a request
sends them. No HTTP here beyond reading the request's priority header.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from frontend.dependencies import FrontendState, check_api_key, priority_of
from frontend.errors import APIError, invalid_parameter, model_not_found
from frontend.openai_models import ChatCompletionRequest, ChatMessage, sampling_of
from frontend.responses_api.items import Item, chat_messages, new_id, normalize_input
from frontend.responses_api.models import ResponsesRequest, TextFormat, refuse_options
from frontend.responses_api.objects import EventStream, Json, response_object, settings_of
from frontend.responses_api.output import OutputBuilder
from frontend.routes.generation import output_budget
from frontend.structured import json_schema_output
from frontend.tokenization import chat_prompt_ids
from frontend.tools import (
    PARSERS,
    ToolChoice,
    ToolSpec,
    constrained_parser,
    get_parser,
    parse_tool_choice,
    parse_tools,
    tool_choice_output,
)
from schemas import SamplingParams, StructuredKind, StructuredOutput

__all__ = ["SAMPLING_EXTENSIONS", "Plan", "plan_of"]

#: Sampling fields chat completions accepts beyond OpenAI's Responses API (vLLM's and OpenAI chat's),
#: taken on a Responses request too (the ``openai`` client's ``extra_body``), with chat's checks
SAMPLING_EXTENSIONS = (
    "seed",
    "top_k",
    "min_p",
    "logit_bias",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
)


@dataclass(frozen=True)
class Plan:
    """One response to make: its id, the conversation before it, the prompt and how to sample."""

    response_id: str
    created_at: int
    model: str
    settings: Json
    #: the conversation before this response's output (stored with it)
    items: list[Item]
    #: where this request's own input starts in ``items``
    input_start: int
    prompt_ids: list[int]
    sampling: SamplingParams
    tools: list[ToolSpec]
    choice: ToolChoice
    #: the model family's parser of tool calls in free text (``tool_choice`` auto)
    tool_call_parser: str | None
    parallel_tool_calls: bool
    store: bool
    priority: int

    def output_builder(self, events: EventStream | None = None) -> OutputBuilder:
        """The builder of this response's output items (tool calls parsed when there are tools)."""
        max_calls = None if self.parallel_tool_calls else 1
        if self.choice.forced:
            stream = constrained_parser(self.tools, self.choice).streaming()
            return OutputBuilder(events, stream, max_calls=max_calls)
        if self.choice.mode == "auto" and self.tools and self.tool_call_parser is not None:
            return OutputBuilder(events, get_parser(self.tool_call_parser).streaming(), max_calls=max_calls)
        return OutputBuilder(events)

    def response(
        self,
        *,
        status: str,
        output: list[Item],
        usage_block: Json | None = None,
        incomplete_reason: str | None = None,
        error: Json | None = None,
    ) -> Json:
        return response_object(
            self.response_id,
            self.created_at,
            self.model,
            self.settings,
            status=status,
            output=output,
            usage_block=usage_block,
            incomplete_reason=incomplete_reason,
            error=error,
        )


async def plan_of(request: Request, body: ResponsesRequest, state: FrontendState) -> Plan:
    """Check ``body`` and decide everything about its response; a 4xx for what cannot be served."""
    config = state.config
    check_api_key(request, config)  # after the body validated, as on the chat route
    if body.model not in config.model_names:
        raise model_not_found(body.model)
    refuse_options(body)
    tools = parse_tools(body.tools)
    choice = parse_tool_choice(body.tool_choice, tools)
    if tools and choice.mode == "auto" and config.tool_call_parser is None:
        raise invalid_parameter(
            "tool_choice 'auto' (the default with tools) needs a tool call parser: start the server with "
            f"--tool-call-parser ({', '.join(sorted(PARSERS))}), or send tool_choice 'required', a named "
            "function or 'none'",
            "tool_choice",
        )
    items: list[Item] = []
    if body.previous_response_id is not None:
        previous = await state.responses.get(body.previous_response_id)
        if previous is None:
            raise APIError(
                404,
                f"Previous response with id '{body.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        items = previous.conversation()
    input_start = len(items)
    items += normalize_input(body.input)
    messages = chat_messages(items, body.instructions)
    if not messages:
        raise invalid_parameter("input is empty", "input")
    prompt_ids = _prompt_ids(state, messages, tools)
    budget = output_budget(
        config, state.gateway.max_model_len(), len(prompt_ids), body.max_output_tokens, "max_output_tokens"
    )
    structured = _structured(body, tools, choice)
    sampling = _sampling(body, budget, state.tokenizer.vocab_size, structured)
    flat_tools = [{"type": "function", **tool.chat_dict()["function"]} for tool in tools]
    return Plan(
        response_id=new_id("resp"),
        created_at=int(time.time()),
        model=config.model_name,
        settings=settings_of(body, flat_tools),
        items=items,
        input_start=input_start,
        prompt_ids=prompt_ids,
        sampling=sampling,
        tools=tools,
        choice=choice,
        tool_call_parser=config.tool_call_parser,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        store=body.store is not False,
        priority=priority_of(request, body.priority),
    )


def _prompt_ids(state: FrontendState, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[int]:
    """The chat route's prompt of ``messages`` (:func:`~frontend.tokenization.chat_prompt_ids`); its
    400s name ``input``, where the messages came from."""
    try:
        chat = [ChatMessage.model_validate(message) for message in messages]
        return chat_prompt_ids(state.tokenizer, chat, tools=[tool.chat_dict() for tool in tools] or None)
    except ValidationError as exc:  # pragma: no cover - the items were checked when normalized
        raise invalid_parameter(f"input: {exc.errors()[0].get('msg')}", "input") from exc
    except APIError as exc:
        raise APIError(exc.status, exc.message, param="input", code=exc.code) from exc


def _sampling(
    body: ResponsesRequest, budget: int, vocab_size: int, structured: StructuredOutput | None
) -> SamplingParams:
    """The engine's sampling parameters, checked as chat completions checks its own (``sampling_of``),
    with the sampling extensions chat accepts (:data:`SAMPLING_EXTENSIONS`) when the request sends them."""
    extra = body.model_extra or {}
    fields = {name: extra[name] for name in SAMPLING_EXTENSIONS if extra.get(name) is not None}
    try:
        chat = ChatCompletionRequest(
            model=body.model,
            messages=[ChatMessage(role="user", content="")],
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p,
            **fields,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())) or None
        raise invalid_parameter(f"{param}: {first.get('msg')}", param) from exc
    return sampling_of(chat, max_tokens=budget, vocab_size=vocab_size, structured=structured)


def _structured(body: ResponsesRequest, tools: list[ToolSpec], choice: ToolChoice) -> StructuredOutput | None:
    text_format: TextFormat | None = body.text.format if body.text is not None else None
    from_tools = tool_choice_output(tools, choice, parallel_tool_calls=body.parallel_tool_calls is not False)
    if text_format is None or text_format.type == "text":
        return from_tools
    if from_tools is not None:
        raise invalid_parameter(
            "text.format cannot be combined with tool_choice 'required' or a named function", "text.format"
        )
    if text_format.type == "json_object":
        return StructuredOutput(kind=StructuredKind.JSON_OBJECT)
    if text_format.json_schema is None:
        raise invalid_parameter("text.format of type json_schema needs a schema", "text.format.schema")
    return json_schema_output(
        text_format.json_schema, strict=text_format.strict, param="text.format", name=text_format.name
    )

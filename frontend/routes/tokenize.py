"""``POST /tokenize`` and ``POST /detokenize``: vLLM's token routes, with the served model's tokenizer.

Clients use them to count a prompt's tokens, or to turn token ids back into text, exactly as
the engines will (a router that balances by prompt length, a client that trims a conversation to
the context length). Shapes follow vLLM's:

* ``/tokenize`` takes ``prompt`` (with ``add_special_tokens``, default true) or chat
  ``messages`` (and ``tools``, rendered with the chat template; ``add_generation_prompt`` default true,
  ``add_special_tokens`` default false, as the generation route renders them), and answers
  ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` only with
  ``return_token_strs``);
* ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}`` (special tokens included).

``model`` is optional; a name the frontend does not serve is a 404. Behind the API key like the
other routes. Nothing reaches the bus: the frontend holds the tokenizer.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from frontend.dependencies import FrontendState, StateDep, check_api_key
from frontend.errors import invalid_parameter, model_not_found
from frontend.http_responses import json_response
from frontend.openai_models import ChatMessage
from frontend.tokenization import chat_prompt_ids, encode_text, token_text
from frontend.tools import parse_tools

__all__ = ["DetokenizeRequest", "TokenizeChatRequest", "TokenizeCompletionRequest", "detokenize", "router",
           "tokenize"]

router = APIRouter()

_TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    #: function tools, rendered by the chat template as the chat route renders them
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[_TokenId]


def _checked(request: Request, state: FrontendState, model: str | None) -> None:
    check_api_key(request, state.config)
    if model is not None and model not in state.config.model_names:
        raise model_not_found(model)


@router.post("/tokenize")
async def tokenize(
    request: Request, body: TokenizeCompletionRequest | TokenizeChatRequest, state: StateDep
) -> Response:
    _checked(request, state, body.model)
    tokenizer = state.tokenizer
    if isinstance(body, TokenizeChatRequest):
        tools = [tool.chat_dict() for tool in parse_tools(body.tools)] or None
        ids = chat_prompt_ids(tokenizer, body.messages, add_generation_prompt=body.add_generation_prompt,
                              tools=tools)
    else:
        ids = encode_text(tokenizer, body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
    strs = [token_text(tokenizer, token_id) for token_id in ids] if body.return_token_strs else None
    return json_response(200, {"count": len(ids), "max_model_len": state.gateway.max_model_len(),
                               "tokens": ids, "token_strs": strs})


@router.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeRequest, state: StateDep) -> Response:
    _checked(request, state, body.model)
    tokenizer = state.tokenizer
    vocab = tokenizer.vocab_size
    if any(token_id >= vocab for token_id in body.tokens):
        raise invalid_parameter(f"tokens must be in [0, {vocab})", "tokens")
    return json_response(200, {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})

"""How ``/v1/completions`` and ``/v1/chat/completions`` differ, and nothing else. Pure.

The two endpoints share one path (:mod:`frontend.routes.generation`):
validation, admission, dispatch, streaming, stop strings, usage, errors,
lifecycle events and metrics. A :class:`Flavor` is what is left: how the
prompt becomes token ids, which field bounds the output, and how chunks,
logprobs and the whole response are shaped. :data:`COMPLETIONS` and
:data:`CHAT` are the two there are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from agents.engines.tokenizer import TextTokenizer
from frontend import responses as R
from frontend.openai_models import ChatCompletionRequest, CompletionRequest
from frontend.responses import Json
from frontend.tokenization import chat_prompt_ids, completion_prompt_ids
from frontend.tools import parse_tools
from frontend.turns import Piece
from schemas import Alternatives

__all__ = ["CHAT", "COMPLETIONS", "ChatFlavor", "CompletionFlavor", "Flavor", "Reply"]

BodyT = TypeVar("BodyT", CompletionRequest, ChatCompletionRequest)


@dataclass(frozen=True)
class Reply:
    """What every chunk and response of one request repeats."""

    request_id: str
    created: int
    model: str
    include_usage: bool


class Flavor(ABC, Generic[BodyT]):
    """One endpoint's differences. ``endpoint`` labels metrics; ``id_prefix`` starts request ids."""

    endpoint: ClassVar[str]
    id_prefix: ClassVar[str]
    chunk_object: ClassVar[str]

    @abstractmethod
    def prompts(self, tokenizer: TextTokenizer, body: BodyT) -> list[list[int]]:
        """Each prompt as token ids (400 for a prompt that cannot be served)."""

    @abstractmethod
    def requested_max_tokens(self, body: BodyT) -> tuple[int | None, str]:
        """The output bound the client asked for (None: none) and the parameter that carried it."""

    def first_chunk(self, reply: Reply, index: int = 0) -> Json | None:
        """A chunk to send before any text of choice ``index`` (None: nothing)."""
        return None

    @abstractmethod
    def chunk(self, reply: Reply, piece: Piece, logprobs: Json | None, index: int = 0) -> Json:
        """The SSE chunk carrying one piece of choice ``index``'s text."""

    @abstractmethod
    def logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Alternatives],
        decode_one: Callable[[int], str], text_offset: int,
    ) -> Json:
        """Logprobs of tokens whose text starts ``text_offset`` characters into the output, with the
        most likely tokens at each position (``top``, empty where none were asked)."""

    @abstractmethod
    def choice(self, index: int, text: str, finish_reason: str, logprobs: Json | None) -> Json:
        """One choice of a (non-streaming) response."""

    @abstractmethod
    def response(
        self, reply: Reply, choices: list[Json], num_prompt_tokens: int, num_output_tokens: int,
        num_cached_tokens: int = 0,
    ) -> Json:
        """The whole (non-streaming) response body; ``num_cached_tokens``: prompt tokens found cached."""


class CompletionFlavor(Flavor[CompletionRequest]):
    """``POST /v1/completions``: prompt strings or token ids, one or several; ``text_completion`` objects."""

    endpoint = "completions"
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def prompts(self, tokenizer: TextTokenizer, body: CompletionRequest) -> list[list[int]]:
        return completion_prompt_ids(tokenizer, body.prompt)

    def requested_max_tokens(self, body: CompletionRequest) -> tuple[int | None, str]:
        return body.max_tokens, "max_tokens"

    def chunk(self, reply: Reply, piece: Piece, logprobs: Json | None, index: int = 0) -> Json:
        return R.completion_chunk(
            reply.request_id, reply.created, reply.model, piece.text, piece.finish_reason, logprobs,
            with_usage_field=reply.include_usage, index=index,
        )

    def logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Alternatives],
        decode_one: Callable[[int], str], text_offset: int,
    ) -> Json:
        return R.completion_logprobs(token_ids, logprobs, top, decode_one, text_offset)

    def choice(self, index: int, text: str, finish_reason: str, logprobs: Json | None) -> Json:
        return R.completion_choice(index, text, finish_reason, logprobs)

    def response(
        self, reply: Reply, choices: list[Json], num_prompt_tokens: int, num_output_tokens: int,
        num_cached_tokens: int = 0,
    ) -> Json:
        return R.completion_response(reply.request_id, reply.created, reply.model, choices,
                                     num_prompt_tokens, num_output_tokens, num_cached_tokens)


class ChatFlavor(Flavor[ChatCompletionRequest]):
    """``POST /v1/chat/completions``: messages through the chat template; ``chat.completion`` objects."""

    endpoint = "chat"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def prompts(self, tokenizer: TextTokenizer, body: ChatCompletionRequest) -> list[list[int]]:
        tools = [tool.chat_dict() for tool in parse_tools(body.tools)] or None  # the template renders them
        return [chat_prompt_ids(tokenizer, body.messages, tools=tools,
                                add_generation_prompt=body.add_generation_prompt is not False)]

    def requested_max_tokens(self, body: ChatCompletionRequest) -> tuple[int | None, str]:
        if body.max_completion_tokens is not None:
            return body.max_completion_tokens, "max_completion_tokens"
        return body.max_tokens, "max_tokens"

    def first_chunk(self, reply: Reply, index: int = 0) -> Json | None:
        role = {"role": "assistant", "content": ""}
        return R.chat_chunk(reply.request_id, reply.created, reply.model, role, None,
                            with_usage_field=reply.include_usage, index=index)

    def chunk(self, reply: Reply, piece: Piece, logprobs: Json | None, index: int = 0) -> Json:
        delta = {"content": piece.text} if piece.text or not piece.is_last else {}
        return R.chat_chunk(reply.request_id, reply.created, reply.model, delta, piece.finish_reason,
                            logprobs, with_usage_field=reply.include_usage, index=index)

    def logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Alternatives],
        decode_one: Callable[[int], str], text_offset: int,
    ) -> Json:
        return R.chat_logprobs(token_ids, logprobs, top, decode_one)

    def choice(self, index: int, text: str, finish_reason: str, logprobs: Json | None) -> Json:
        return R.chat_choice(index, text, finish_reason, logprobs)

    def response(
        self, reply: Reply, choices: list[Json], num_prompt_tokens: int, num_output_tokens: int,
        num_cached_tokens: int = 0,
    ) -> Json:
        return R.chat_response(reply.request_id, reply.created, reply.model, choices,
                               num_prompt_tokens, num_output_tokens, num_cached_tokens)


COMPLETIONS = CompletionFlavor()
CHAT = ChatFlavor()

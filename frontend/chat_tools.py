"""Tool calling on ``/v1/chat/completions``: what a request's tools do to its prompt, sampling and answer.

:meth:`ChatTools.of` reads ``tools``, ``tool_choice`` and ``parallel_tool_calls``
(400 naming the field that is wrong). The tools go to the chat template
(:meth:`ChatTools.rendered`). ``required`` and a named function constrain the
output to JSON (:attr:`ChatTools.structured`, vLLM's schema) and the calls are
read from that JSON; ``auto`` leaves the output free and the configured
``--tool-call-parser`` finds the calls in it (without one, auto is a 400, as
vLLM refuses it without ``--enable-auto-tool-choice``); ``none`` renders the
tools and answers text. :meth:`ChatTools.message` shapes a whole answer,
:class:`ChatToolChunks` a streamed one: ``message.tool_calls``, tool call
deltas in OpenAI's shape, and ``finish_reason: "tool_calls"`` when the model
called a tool and stopped by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend import responses as R
from frontend.errors import invalid_parameter
from frontend.openai_models import ChatCompletionRequest
from frontend.responses import Json
from frontend.structured import validate_structured
from frontend.tools import (
    PARSERS,
    ToolChoice,
    ToolParser,
    ToolSpec,
    ToolStream,
    constrained_parser,
    get_parser,
    parse_tool_choice,
    parse_tools,
    tool_choice_output,
)
from frontend.turns import Piece
from schemas import FinishReason, StructuredOutput

__all__ = ["ChatToolChunks", "ChatTools"]


@dataclass(frozen=True)
class ChatTools:
    """A chat request's tools, its ``tool_choice``, and the parser of its answer (None: plain text)."""

    tools: list[ToolSpec]
    choice: ToolChoice
    parallel_tool_calls: bool
    parser: ToolParser | None
    structured: StructuredOutput | None

    @classmethod
    def of(cls, body: ChatCompletionRequest, tool_call_parser: str | None) -> ChatTools | None:
        """The request's tool calling (None: it has no tools); 400 for bad tools or tool_choice (a
        forced choice whose schemas the grammar cannot enforce names ``tools``), and for ``auto``
        when no ``tool_call_parser`` is configured."""
        tools = parse_tools(body.tools)
        choice = parse_tool_choice(body.tool_choice, tools)
        if not tools:
            return None
        parallel = body.parallel_tool_calls is not False
        parser: ToolParser | None = None
        if choice.forced:
            parser = constrained_parser(tools, choice)
        elif choice.mode == "auto":
            if tool_call_parser is None:
                raise invalid_parameter(
                    "tool_choice 'auto' (the default with tools) needs a tool call parser: start the "
                    f"server with --tool-call-parser ({', '.join(sorted(PARSERS))}), or send tool_choice "
                    "'required', a named function or 'none'",
                    "tool_choice",
                )
            parser = get_parser(tool_call_parser)
        structured = tool_choice_output(tools, choice, parallel_tool_calls=parallel)
        if structured is not None:  # a schema the engines' grammar cannot enforce is the tools' fault
            structured = validate_structured(structured, "tools")
        return cls(tools, choice, parallel, parser, structured)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the answer's text must show special tokens (but end-of-sequence) for the parser."""
        return self.parser is not None and self.parser.keeps_special_tokens

    def rendered(self) -> list[dict[str, Any]]:
        """The tools as the chat template receives them."""
        return [tool.chat_dict() for tool in self.tools]

    def message(self, index: int, text: str, finish_reason: FinishReason, logprobs: Json | None) -> Json:
        """One choice of a whole answer: content and ``tool_calls``."""
        if self.parser is None:
            return R.chat_choice(index, text, finish_reason, logprobs)
        content, calls = self.parser.extract(text)
        calls = calls if self.parallel_tool_calls else calls[:1]
        message: Json = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(finish_reason, bool(calls)),
        }

    def chunks(self) -> ChatToolChunks | None:
        """The streaming side of one choice (None: plain text chunks)."""
        if self.parser is None:
            return None
        return ChatToolChunks(self.parser.streaming(), self.parallel_tool_calls)


def _finish_reason(reason: FinishReason, called: bool) -> str:
    return "tool_calls" if called and reason is FinishReason.STOP else str(reason)


class ChatToolChunks:
    """One streamed choice's chunks: content and tool call deltas as the parser releases them."""

    def __init__(self, stream: ToolStream, parallel_tool_calls: bool) -> None:
        self._stream = stream
        self._parallel = parallel_tool_calls

    def chunk(
        self,
        request_id: str,
        created: int,
        model: str,
        piece: Piece,
        logprobs: Json | None,
        *,
        index: int,
        with_usage_field: bool,
    ) -> Json | None:
        """The chunk for ``piece`` (None: nothing to send yet)."""
        content, deltas = self._stream.feed(piece.text)
        if piece.is_last:
            rest, more = self._stream.finish()
            content, deltas = content + rest, deltas + more
        if not self._parallel:
            deltas = [delta for delta in deltas if delta["index"] == 0]
        delta: Json = {}
        if content:
            delta["content"] = content
        if deltas:
            delta["tool_calls"] = deltas
        finish = None
        if piece.finish_reason is not None:
            finish = _finish_reason(piece.finish_reason, self._stream.num_calls > 0)
        if not delta and finish is None and logprobs is None:
            return None
        return R.chat_chunk(
            request_id,
            created,
            model,
            delta,
            finish,
            logprobs,
            with_usage_field=with_usage_field,
            index=index,
        )

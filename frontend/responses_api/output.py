"""A response's output items, built from the model's text as it comes, with their stream events. Pure.

:class:`OutputBuilder` takes the answer's text piece by piece (:meth:`~OutputBuilder.feed`) and
ends with :meth:`~OutputBuilder.finish`; :attr:`~OutputBuilder.output` is then the response's
``output``. With tools, the text goes through a tool call parser's incremental reader
(:class:`~frontend.tools.ToolStream`: the model family's parser for ``tool_choice`` auto, the
constrained-output parser for ``required`` or a named function): content becomes a ``message``
item, each call a ``function_call`` item (``call_id``, ``name``, ``arguments``), in the order the
model wrote them. Given an :class:`~frontend.responses_api.objects.EventStream`, each step also
returns the SSE events OpenAI sends for it: ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ... ``.done``,
``response.content_part.done``, ``response.output_item.done``, and for a call
``response.function_call_arguments.delta`` / ``.done``. The non-streaming route runs the same
builder without events, so both give the same items.
"""

from __future__ import annotations

from typing import Any

from frontend.responses_api.items import Item, function_call_item, new_id
from frontend.responses_api.objects import EventStream
from frontend.tools import ToolStream

__all__ = ["OutputBuilder"]


def _text_part(text: str) -> Item:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputBuilder:
    """The output items of one answer (see the module docstring)."""

    def __init__(
        self,
        events: EventStream | None = None,
        tool_stream: ToolStream | None = None,
        *,
        max_calls: int | None = None,
    ) -> None:
        self.output: list[Item] = []
        self._max_calls = max_calls  # None: every call the model makes (parallel tool calls)
        self._events = events
        self._tool_stream = tool_stream
        self._open: Item | None = None  # the item being written: a message or a call
        self._text: list[str] = []
        self._calls: dict[int, Item] = {}  # parser's call index -> its item
        self._out: list[bytes] = []

    def feed(self, text: str) -> list[bytes]:
        """Take the answer's next piece of text; the events it releases."""
        if self._tool_stream is None:
            self._content(text)
        else:
            content, deltas = self._tool_stream.feed(text)
            self._content(content)
            self._deltas(deltas)
        return self._take()

    def finish(self, *, complete: bool = True) -> list[bytes]:
        """End the answer (``complete`` False: cut by the token budget); the events left."""
        if self._tool_stream is not None:
            content, deltas = self._tool_stream.finish()
            self._content(content)
            self._deltas(deltas)
        if not self.output:
            self._open_message()
        self._close(complete)
        return self._take()

    # -- items ----------------------------------------------------------------------------------
    def _emit(self, type_: str, **fields: Any) -> None:
        if self._events is not None:
            self._out.append(self._events.event(type_, **fields))

    def _take(self) -> list[bytes]:
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._open is None or self._open["type"] != "message":
            self._close(True)
            self._open_message()
        assert self._open is not None
        self._text.append(text)
        self._emit(
            "response.output_text.delta",
            item_id=self._open["id"],
            output_index=len(self.output) - 1,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _open_message(self) -> None:
        item: Item = {
            "id": new_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._start(item)
        self._text = []
        self._emit(
            "response.content_part.added",
            item_id=item["id"],
            output_index=len(self.output) - 1,
            content_index=0,
            part=_text_part(""),
        )

    def _deltas(self, deltas: list[dict[str, Any]]) -> None:
        for delta in deltas:
            index = delta["index"]
            if self._max_calls is not None and index >= self._max_calls:
                continue
            fragment = delta.get("function", {}).get("arguments", "")
            if index not in self._calls:
                self._close(True)
                item = function_call_item(delta["function"]["name"], "", new_id("call"), status="in_progress")
                self._calls[index] = item
                self._start(item)
            item = self._calls[index]
            if fragment:
                item["arguments"] += fragment
                self._emit(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.output.index(item),
                    delta=fragment,
                )

    def _start(self, item: Item) -> None:
        self.output.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))

    def _close(self, complete: bool) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = self.output.index(item)
        status = "completed" if complete else "incomplete"
        if item["type"] == "message":
            text = "".join(self._text)
            part = _text_part(text)
            self._emit(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            self._emit(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
            item["content"] = [part]
        else:
            self._emit(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        item["status"] = status
        self._emit("response.output_item.done", output_index=index, item=dict(item))

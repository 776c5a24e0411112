"""Tool calls out of a model's text: one parser per model family's format, whole or as it streams. Pure.

A :class:`ToolParser` is chosen by name (``--tool-call-parser``, as vLLM's flag):

* ``hermes``: Hermes 2 Pro and Qwen 2.5 / 3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, text around them is content.
* ``llama3_json``: Llama 3.1 / 3.2 / 3.3: the whole answer is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``;``; an answer that does not start
  with one is content.
* ``mistral``: Mistral: ``[TOOL_CALLS]`` then ``[{"name": ..., "arguments": {...}}, ...]`` (v0.3
  tokenizers) or ``name{...}`` / ``name[ARGS]{...}`` (v11 and later), text before it is content.

:func:`constrained_parser` reads what a forced ``tool_choice`` made the model write (the arguments
of the named function, or the ``required`` array of ``{"name", "parameters"}``).

Every parser reads text through one incremental state machine (:class:`ToolStream`): ``feed``
takes the next piece of text and returns the content to show and the OpenAI tool call deltas
(``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`` when a call's name
is known, then ``{"index", "function": {"arguments": <fragment>}}``); ``finish`` ends it.
``extract`` runs the same machine over a whole text, so a streamed answer, however it is cut,
reassembles into exactly the calls and content of the whole one. A call's ``arguments`` is the
JSON text of the arguments as the model wrote it (``{}`` when it wrote none). Text that looks like
a call but never names a function is content; whitespace just before a call, and at the end of
an answer with calls, is not.
"""

from __future__ import annotations

import random
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from frontend.tools.scan import CallScanner
from frontend.tools.spec import ToolChoice, ToolSpec, make_tool_call_id

__all__ = [
    "PARSERS",
    "ToolParser",
    "ToolStream",
    "assemble",
    "constrained_parser",
    "get_parser",
]

#: a tool call or a tool call delta, in OpenAI's shape
Call = dict[str, Any]
#: what separates Llama 3's calls
_SEPARATORS = " \t\r\n;"


def mistral_tool_call_id() -> str:
    """Mistral's chat templates take only 9 letters or digits as a tool call id."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class _Emitter:
    """Content and call deltas built up during one ``feed``; whitespace next to calls is held back."""

    def __init__(self, make_id: Callable[[], str]) -> None:
        self.make_id = make_id
        self.num_calls = 0
        self.content: list[str] = []
        self.deltas: list[Call] = []
        self.held_whitespace = ""

    def text(self, text: str) -> None:
        if not text:
            return
        body = text.rstrip()
        if body:
            self.content.append(self.held_whitespace + body)
            self.held_whitespace = ""
        self.held_whitespace += text[len(body) :]

    def call_started(self) -> None:
        """Whitespace before a call is not content."""
        self.held_whitespace = ""

    def header(self, name: str) -> int:
        index = self.num_calls
        self.num_calls += 1
        self.call_started()
        self.deltas.append(
            {
                "index": index,
                "id": self.make_id(),
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        )
        return index

    def arguments(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        last = self.deltas[-1] if self.deltas else None
        if last is not None and last["index"] == index:  # one delta per call per feed
            last["function"]["arguments"] += fragment
        else:
            self.deltas.append({"index": index, "function": {"arguments": fragment}})

    def take(self) -> tuple[str, list[Call]]:
        content, deltas = "".join(self.content), self.deltas
        self.content, self.deltas = [], []
        return content, deltas

    def finish(self) -> None:
        """At the end, held whitespace is content only if no call was made."""
        if self.num_calls == 0 and self.held_whitespace:
            self.content.append(self.held_whitespace)
        self.held_whitespace = ""


class _Call:
    """One call being read: its scanner and what of it has been emitted."""

    def __init__(self, emitter: _Emitter, *, bare: bool = False, name: str | None = None) -> None:
        self.emitter = emitter
        self.scanner = CallScanner(bare=bare)
        self.name = name
        self.index: int | None = None
        self.sent = 0
        if name is not None:
            self.index = emitter.header(name)

    @property
    def named(self) -> bool:
        return self.index is not None

    def feed(self, text: str) -> int:
        taken = self.scanner.feed(text)
        self._emit()
        return taken

    def _emit(self) -> None:
        scanner = self.scanner
        if self.index is None and scanner.name is not None:
            self.index = self.emitter.header(scanner.name)
        if self.index is not None and scanner.args_start is not None:
            fragment = scanner.text[scanner.args_start + self.sent : scanner.args_end]
            self.sent += len(fragment)
            self.emitter.arguments(self.index, fragment)

    def close(self) -> None:
        """The call's text ended: a call that wrote no arguments gets ``{}``."""
        self.scanner.finish()
        self._emit()
        if self.index is not None and self.scanner.args_start is None:
            self.emitter.arguments(self.index, "{}")


class ToolStream(ABC):
    """An incremental reader of one answer: ``feed`` pieces of text, then ``finish``."""

    def __init__(self, make_id: Callable[[], str] = make_tool_call_id) -> None:
        self._out = _Emitter(make_id)
        self._buffer = ""
        self._finished = False

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content and tool call deltas that ``text`` (the answer's next piece) releases."""
        self._buffer += text
        self._advance(final=False)
        return self._out.take()

    def finish(self) -> tuple[str, list[Call]]:
        """What is left at the end of the answer."""
        if not self._finished:
            self._finished = True
            self._advance(final=True)
            self._out.finish()
        return self._out.take()

    @property
    def num_calls(self) -> int:
        return self._out.num_calls

    @abstractmethod
    def _advance(self, *, final: bool) -> None:
        """Consume what can be decided of ``self._buffer``."""


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class _HermesStream(ToolStream):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, make_id: Callable[[], str] = make_tool_call_id) -> None:
        super().__init__(make_id)
        self._call: _Call | None = None
        self._raw = ""  # the current region's text, content if it never names a function

    def _advance(self, *, final: bool) -> None:
        while True:
            if self._call is None:
                at = self._buffer.find(self.START)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, self.START)
                    self._out.text(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return
                self._out.text(self._buffer[:at])
                self._buffer = self._buffer[at + len(self.START) :]
                self._call, self._raw = _Call(self._out), self.START
                continue
            at = self._buffer.find(self.END)
            if at < 0:
                keep = 0 if final else _partial_suffix(self._buffer, self.END)
                body = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(body) :]
                self._read(body)
                if final:
                    self._close("")
                return
            body, self._buffer = self._buffer[:at], self._buffer[at + len(self.END) :]
            self._read(body)
            self._close(self.END)

    def _read(self, body: str) -> None:
        assert self._call is not None
        self._raw += body
        if not (self._call.scanner.done or self._call.scanner.failed):
            self._call.feed(body)

    def _close(self, end_tag: str) -> None:
        assert self._call is not None
        call, self._call = self._call, None
        call.close()
        if not call.named:
            self._out.text(self._raw + end_tag)
        else:
            self._out.call_started()


class _Llama3Stream(ToolStream):
    TAG = "<|python_tag|>"

    def __init__(self, make_id: Callable[[], str] = make_tool_call_id) -> None:
        super().__init__(make_id)
        self._mode = "start"  # start, calls, text
        self._call: _Call | None = None

    def _advance(self, *, final: bool) -> None:
        if self._mode == "start":
            head = self._buffer.lstrip()
            if not final and (not head or self.TAG.startswith(head)):
                return
            if head.startswith(self.TAG):
                self._mode, self._buffer = "calls", head[len(self.TAG) :]
            elif head.startswith("{"):
                self._mode, self._buffer = "calls", head
            else:
                self._mode = "text"
        if self._mode == "calls":
            self._read_calls(final=final)
        if self._mode == "text":
            self._out.text(self._buffer)
            self._buffer = ""

    def _read_calls(self, *, final: bool) -> None:
        while True:
            if self._call is None:
                self._buffer = self._buffer.lstrip(_SEPARATORS)
                if not self._buffer:
                    return
                if not self._buffer.startswith("{"):
                    self._mode = "text"
                    return
                self._call = _Call(self._out)
            taken = self._call.feed(self._buffer)
            self._buffer = self._buffer[taken:]
            scanner = self._call.scanner
            if not (scanner.done or scanner.failed or final):
                return
            call, self._call = self._call, None
            call.close()
            if not call.named:  # JSON that is not a call: the rest is content
                self._buffer = call.scanner.text + self._buffer
                self._mode = "text"
                return
            if scanner.failed:
                self._mode = "text"
                return


class _ArrayStream(ToolStream):
    """A JSON array of call objects (Mistral's v0.3 form, a ``required`` tool choice's output), after
    an optional tag; text before the tag is content (none when there is no tag)."""

    def __init__(self, make_id: Callable[[], str] = make_tool_call_id, *, tag: str = "") -> None:
        super().__init__(make_id)
        self._tag = tag
        self._mode = "text" if tag else "open"  # text, open, items, bare_name, bare_args
        self._call: _Call | None = None
        self._name = ""

    def _advance(self, *, final: bool) -> None:
        while True:
            if self._mode == "text":
                at = self._buffer.find(self._tag) if self._tag else -1
                if at < 0:
                    keep = 0 if final or not self._tag else _partial_suffix(self._buffer, self._tag)
                    self._out.text(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return
                self._out.text(self._buffer[:at])
                self._buffer = self._buffer[at + len(self._tag) :]
                self._mode = "open"
                continue
            head = self._buffer.lstrip()
            if self._mode == "open":
                if not head:
                    if final and self._tag:  # the tag ended the answer: it was text
                        self._out.text(self._tag + self._buffer)
                        self._buffer, self._mode = "", "text"
                    return
                if head.startswith("["):
                    self._mode, self._buffer = "items", head[1:]
                elif self._tag and (head[0].isalnum() or head[0] in "_-.:"):
                    self._mode, self._buffer, self._name = "bare_name", head, ""
                elif self._tag:  # the tag starts no call: it was text
                    self._out.text(self._tag)
                    self._mode = "text"
                else:
                    self._mode = "rest"
                continue
            if self._mode == "items":
                if self._call is None:
                    head = head.lstrip(",").lstrip()
                    self._buffer = head
                    if not head:
                        return
                    if head.startswith("]"):
                        self._buffer, self._mode = head[1:], "text" if self._tag else "rest"
                        continue
                    if not head.startswith("{"):
                        self._mode = "text" if self._tag else "rest"
                        continue
                    self._call = _Call(self._out)
                if not self._feed_call(final):
                    return
                continue
            if self._mode == "bare_name":
                if not self._read_name(final):
                    return
                continue
            if self._mode == "bare_args":
                if not self._feed_call(final):
                    return
                self._mode = "text"
                continue
            # rest: text after a tagless array is not content
            self._buffer = ""
            return

    def _read_name(self, final: bool) -> bool:
        """Mistral v11: the function's name up to its arguments (``{`` or ``[ARGS]``)."""
        brace, args_tag = self._buffer.find("{"), self._buffer.find("[ARGS]")
        ends = [at for at in (brace, args_tag) if at >= 0]
        if not ends:
            if final:
                self._out.text(self._tag + self._buffer)
                self._buffer, self._mode = "", "text"
                return True
            return False
        at = min(ends)
        self._name = self._buffer[:at].strip()
        self._buffer = self._buffer[at + (len("[ARGS]") if at == args_tag else 0) :]
        self._call = _Call(self._out, bare=True, name=self._name)
        self._mode = "bare_args"
        return True

    def _feed_call(self, final: bool) -> bool:
        """Feed the current call; True when it ended (its text consumed), False when it needs more."""
        call = self._call
        assert call is not None
        taken = call.feed(self._buffer)
        self._buffer = self._buffer[taken:]
        if call.scanner.done or call.scanner.failed or final:
            self._call = None
            call.close()
            if not call.named:
                self._out.text(call.scanner.text)
            return True
        return False


class _NamedStream(ToolStream):
    """The output of a named tool choice: the whole text is that function's arguments."""

    def __init__(self, name: str, make_id: Callable[[], str] = make_tool_call_id) -> None:
        super().__init__(make_id)
        self._call = _Call(self._out, bare=True, name=name)

    def _advance(self, *, final: bool) -> None:
        if self._buffer and not (self._call.scanner.done or self._call.scanner.failed):
            self._call.feed(self._buffer)
        self._buffer = ""
        if final:
            self._call.close()


class ToolParser:
    """A model family's tool call format: ``extract`` a whole answer, or ``streaming()`` one.

    ``keeps_special_tokens``: the format's markers may be special tokens (Mistral's ``[TOOL_CALLS]``,
    Llama's ``<|python_tag|>``, some models' ``<tool_call>``), so the answer's text must show special
    tokens (as vLLM sets ``skip_special_tokens: false`` for these parsers).
    """

    def __init__(
        self, name: str, make_stream: Callable[[], ToolStream], *, keeps_special_tokens: bool
    ) -> None:
        self.name = name
        self.keeps_special_tokens = keeps_special_tokens
        self._make_stream = make_stream

    def streaming(self) -> ToolStream:
        return self._make_stream()

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        """The content (None: none) and the tool calls of a whole answer."""
        stream = self.streaming()
        content, deltas = stream.feed(text)
        rest, more = stream.finish()
        return assemble([(content, deltas), (rest, more)])


def assemble(pieces: Sequence[tuple[str, Sequence[Call]]]) -> tuple[str | None, list[Call]]:
    """Content and whole tool calls from streamed ``(content, deltas)`` pieces, as a client joins them."""
    content = "".join(text for text, _ in pieces)
    calls: dict[int, Call] = {}
    for _, deltas in pieces:
        for delta in deltas:
            index = delta["index"]
            if index not in calls:
                calls[index] = {
                    "id": delta["id"],
                    "type": "function",
                    "function": {"name": delta["function"]["name"], "arguments": ""},
                }
            calls[index]["function"]["arguments"] += delta["function"].get("arguments", "")
    return (content or None), [calls[index] for index in sorted(calls)]


#: ``--tool-call-parser`` names and the parsers they choose
PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": lambda: ToolParser("hermes", _HermesStream, keeps_special_tokens=True),
    "llama3_json": lambda: ToolParser("llama3_json", _Llama3Stream, keeps_special_tokens=True),
    "mistral": lambda: ToolParser(
        "mistral", lambda: _ArrayStream(mistral_tool_call_id, tag="[TOOL_CALLS]"), keeps_special_tokens=True
    ),
}


def get_parser(name: str) -> ToolParser:
    """The parser ``--tool-call-parser name`` chooses; ValueError naming the choices for another name."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def constrained_parser(tools: Sequence[ToolSpec], choice: ToolChoice) -> ToolParser:
    """The parser of what a forced ``choice`` made the model write (:func:`.spec.tool_choice_output`)."""
    if choice.mode == "function":
        assert choice.name is not None
        name = choice.name
        return ToolParser("named", lambda: _NamedStream(name), keeps_special_tokens=False)
    if choice.mode == "required":
        return ToolParser("required", _ArrayStream, keeps_special_tokens=False)
    raise ValueError(f"tool_choice {choice.mode!r} does not constrain the output")

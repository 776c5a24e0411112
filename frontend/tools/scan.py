"""Incremental scanning of one JSON tool call as a model writes it, a character at a time. Pure.

:class:`CallScanner` reads ``{"name": "f", "arguments": {...}}`` (``parameters``
is taken for ``arguments``, as Llama 3 writes it) from text that arrives in
pieces of any size. It needs no complete JSON: it tracks nesting, strings and
escapes, reports the function name once its string is complete and the span
of the arguments value as it grows (its text as the model wrote it, trailing
whitespace excluded), and says where the object ends, so a parser can stream
argument fragments before the call is complete. With ``bare=True`` the whole
value is the arguments (a named tool choice, Mistral's ``name{...}`` form).
Text that is not a call object marks the scanner failed; the parser decides
what the text was.
"""

from __future__ import annotations

import json

__all__ = ["ARGUMENT_KEYS", "CallScanner"]

#: the keys a call object's arguments may come under
ARGUMENT_KEYS = ("arguments", "parameters")
_OPEN = {"{": "}", "[": "]"}


class CallScanner:
    """The state of one call object read so far. ``feed`` returns how much of its input the object took."""

    def __init__(self, *, bare: bool = False) -> None:
        self.bare = bare
        self.text = ""
        self.name: str | None = None
        #: where the arguments value starts in :attr:`text` (None: not yet) and where its text ends so far
        self.args_start: int | None = None
        self.args_end = 0
        self.args_done = False
        self.done = False
        self.failed = False
        self._stack: list[str] = []  # closing brackets expected, outermost first
        self._in_string = False
        self._escape = False
        self._string_start = 0
        #: what comes next at the object's level: open, key, colon, value, scalar, comma
        self._expect = "value" if bare else "open"
        self._key: str | None = None
        self._value_start = 0
        self._work = ""  # the text with the piece being read

    def feed(self, piece: str) -> int:
        """Read ``piece``; returns how many of its characters belong to the object (all of them
        unless the object ended or the text turned out not to be a call)."""
        base = len(self.text)
        taken = len(piece)
        self._work = self.text + piece
        for offset, char in enumerate(piece):
            if self.done or self.failed:
                taken = offset
                break
            self._step(char, base + offset)
        self.text = self._work[: base + taken]
        return taken

    def finish(self) -> None:
        """The text ended: a bare scalar value ends with it."""
        if self.bare and self._expect == "scalar" and not self._stack:
            self._value_end(self.args_end)

    def _in_args(self) -> bool:
        return self.bare or self._key in ARGUMENT_KEYS

    def _step(self, char: str, at: int) -> None:
        level = len(self._stack)
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if level == (0 if self.bare else 1):
                    if self._expect == "key":
                        try:
                            self._key = json.loads(self._work[self._string_start : at + 1])
                        except ValueError:  # a bad escape: not JSON
                            self.failed = True
                        self._expect = "colon"
                        return
                    if self._expect == "value":
                        self._mark(at)
                        self._value_end(at + 1)
                        return
            self._mark(at)
            return
        if char.isspace():
            return
        top = 0 if self.bare else 1
        if level < top:  # before the object
            if char == "{":
                self._stack.append("}")
                self._expect = "key"
            else:
                self.failed = True
            return
        if level == top:
            self._step_top(char, at)
            return
        self._mark(at)  # inside a nested value
        if char == '"':
            self._in_string = True
        elif char in _OPEN:
            self._stack.append(_OPEN[char])
        elif char in "}]":
            if char != self._stack[-1]:
                self.failed = True
                return
            self._stack.pop()
            if len(self._stack) == top:
                self._value_end(at + 1)

    def _step_top(self, char: str, at: int) -> None:
        """A character at the call object's own level (or a bare value's start)."""
        expect = self._expect
        if expect == "key":
            if char == '"':
                self._in_string, self._string_start = True, at
            elif char == "}" and self._key is None:
                self._close()
            else:
                self.failed = True
        elif expect == "colon":
            if char == ":":
                self._expect = "value"
            else:
                self.failed = True
        elif expect == "value":
            self._value_start = at
            if self._in_args() and self.args_start is None:
                self.args_start = at
            self._mark(at)
            if char == '"':
                self._in_string = True
            elif char in _OPEN:
                self._stack.append(_OPEN[char])
            elif char in "}],:":
                self.failed = True
            else:
                self._expect = "scalar"
        elif expect == "scalar":
            if char in ",}" and not self.bare:
                self._value_end(self.args_end if self._in_args() else at)
                self._after_value(char)
            elif char in '{}[]":,':
                self.failed = True
            else:
                self._mark(at)
        elif expect == "comma":
            self._after_value(char)

    def _after_value(self, char: str) -> None:
        if char == ",":
            self._expect, self._key = "key", None
        elif char == "}":
            self._close()
        else:
            self.failed = True

    def _close(self) -> None:
        self._stack.pop()
        self.done = True

    def _mark(self, at: int) -> None:
        """A character of a value's text: it extends the arguments when it is theirs."""
        if self._in_args() and self.args_start is not None and not self.args_done:
            self.args_end = at + 1

    def _value_end(self, end: int) -> None:
        """A value at the object's level ended at ``end``."""
        if self.bare:
            self.args_done = True
            self.done = True
            return
        if self._key == "name" and self.name is None:
            try:
                name = json.loads(self._work[self._value_start : end])
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.failed = True
                return
            self.name = name
        elif self._in_args():
            self.args_done = True
        self._expect = "comma"

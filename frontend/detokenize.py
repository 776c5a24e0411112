"""Incremental, UTF-8 safe detokenization and stop-string matching. Pure: no I/O.

:class:`IncrementalDetokenizer` turns token ids into text as they arrive. It
decodes a short window (a few tokens of context plus the new ones) and emits
only text that no longer ends in U+FFFD, so a multi-byte character split
across tokens is held back until its last byte arrives and is never emitted
half (the scheme vLLM uses, with ``prefix_offset`` / ``read_offset``). A
window that still ends in U+FFFD after :data:`MAX_HELD_TOKENS` tokens is
truly invalid output (a random model's bytes) and is emitted as decoded. Only
tokens that carry text count towards that limit: special tokens (skipped in
the text) between the bytes of one character do not force it out half.

:class:`TokenTexts` remembers the text of single tokens (one tokenizer, one
``skip_special_tokens``), which the detokenizer's window of earlier tokens
usually is: shared by a frontend's requests, it spares one decode per token.

:class:`StopStringMatcher` finds stop strings in the emitted text: it holds
back the longest tail that could still begin a stop string, cuts the text
before the first match and reports that generation should stop.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

__all__ = ["MAX_HELD_TOKENS", "Decoder", "IncrementalDetokenizer", "StopStringMatcher", "TokenTexts"]

#: A UTF-8 character has at most 4 bytes, and every token carries at least one.
MAX_HELD_TOKENS = 6
_CONTEXT_TOKENS = 4
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class TokenTexts:
    """The text of single tokens as ``tokenizer.decode([token_id])`` gives it, remembered.

    Decoding one token is a pure function of the token for a given tokenizer, so the
    remembered text is exact; at most ``max_size`` tokens are kept (the first ones seen).
    """

    __slots__ = ("_max_size", "_skip", "_texts", "_tokenizer")

    def __init__(
        self, tokenizer: Decoder, *, skip_special_tokens: bool = True, max_size: int = 1 << 17
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._max_size = max_size
        self._texts: dict[int, str] = {}

    @property
    def tokenizer(self) -> Decoder:
        return self._tokenizer

    @property
    def skip_special_tokens(self) -> bool:
        return self._skip

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=self._skip)
            if len(self._texts) < self._max_size:
                self._texts[token_id] = text
        return text


class IncrementalDetokenizer:
    """Text of a growing token sequence, delivered in safe pieces.

    ``prompt_ids``' last few tokens give the first output tokens their context
    (a sentencepiece word start depends on what precedes it); they are never emitted.
    ``hidden_ids`` are never shown, even with special tokens shown (the end-of-sequence
    tokens, when a tool call parser needs to see special tokens such as ``[TOOL_CALLS]``).
    ``token_texts``: single tokens' texts of the same tokenizer and ``skip_special_tokens``,
    shared with other requests (the text is the same with or without it).
    """

    def __init__(
        self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True,
        hidden_ids: Collection[int] = (), token_texts: TokenTexts | None = None,
    ) -> None:
        if token_texts is not None and (
            token_texts.tokenizer is not tokenizer or token_texts.skip_special_tokens != skip_special_tokens
        ):
            raise ValueError("token_texts must be of the same tokenizer and skip_special_tokens")
        self._tokenizer = tokenizer
        self._texts = token_texts
        self._skip = skip_special_tokens
        self._hidden = frozenset(hidden_ids)
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._text_parts)

    def _decode(self, ids: Sequence[int]) -> str:
        if self._hidden:
            ids = [token_id for token_id in ids if token_id not in self._hidden]
        if len(ids) == 1 and self._texts is not None:
            return self._texts.text(ids[0])
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _num_text_tokens(self, ids: Sequence[int]) -> int:
        """How many of ``ids`` carry text (a skipped special token decodes to nothing)."""
        return sum(1 for token_id in ids if self._decode([token_id]))

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the new text that is safe to show (possibly "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (at the end of generation), invalid bytes as U+FFFD."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        end = len(self._ids)
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT)):
            if self._num_text_tokens(self._ids[self._read_offset : end]) < MAX_HELD_TOKENS:
                return ""
            # Held too long: release what is complete, keep a possibly unfinished character's
            # tokens (at most 3 that carry text, with any special tokens among them).
            for keep in range(1, end - self._read_offset):
                if self._num_text_tokens(self._ids[end - keep : end]) > 3:
                    break  # otherwise: truly invalid bytes, released as U+FFFD
                candidate = self._decode(self._ids[self._prefix_offset : end - keep])
                if not candidate.endswith(_REPLACEMENT):
                    full_text, end = candidate, end - keep
                    break
        delta = full_text[len(prefix_text) :] if full_text.startswith(prefix_text) else full_text
        self._prefix_offset = max(self._read_offset, end - _CONTEXT_TOKENS)
        self._read_offset = end
        if delta:
            self._text_parts.append(delta)
        return delta


class StopStringMatcher:
    """Cuts streamed text at the first stop string (which is not included).

    ``push(text)`` returns ``(safe_text, stopped)``: the text that can be shown
    now; once a stop string is found ``stopped`` is True and later calls return
    nothing. ``flush()`` releases the held-back tail at the end of generation.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = tuple(s for s in stop_strings if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        self._pending += text
        first: tuple[int, str] | None = None
        for stop in self._stops:
            at = self._pending.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            safe = self._pending[: first[0]]
            self._pending = ""
            self.stopped = True
            self.matched = first[1]
            return safe, True
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return "", False
        safe, self._pending = self._pending[:cut], self._pending[cut:]
        return safe, False

    def flush(self) -> str:
        if self.stopped:
            return ""
        tail, self._pending = self._pending, ""
        return tail

"""Structured outputs in shoal's own engines: a grammar's token mask, through llguidance.

A :class:`schemas.StructuredOutput` (a JSON schema, any JSON object, a regular
expression, a choice among strings, or a Lark / GBNF grammar) is compiled into
an llguidance grammar over the model's vocabulary; each constrained request
then holds a :class:`GrammarMatcher` that says which tokens may come next
(:meth:`GrammarMatcher.fill_bitmask`, one bit per token id), takes each sampled
token (:meth:`GrammarMatcher.accept`) and says when the grammar is complete and
the request must stop (:meth:`GrammarMatcher.is_complete`).

The matcher's state is a function of the tokens generated so far, so it never
travels: an engine that takes a request over (migration, rescue) builds it
again by feeding it those tokens in order (:meth:`GrammarCompiler.build`); a
token the grammar refuses is an error.

:class:`GrammarCompiler` binds a vocabulary: the byte tokenizer of the random
presets and of the sim engine (ids 0..255 are bytes, 256 BOS, 257 EOS, the rest
reserved specials that a grammar never allows) or a checkpoint's
``tokenizer.json``. Compiled grammars are kept in a bounded LRU keyed by
``(kind, spec, any_whitespace)``; a request takes a copy of the compiled
matcher. What does not compile raises :class:`GrammarError` whose message names
the problem, for the client's 400 (:func:`grammar_problem` checks a constraint
without a vocabulary, for the frontend).

JSON follows vLLM's llguidance backend: ``any_whitespace`` is llguidance's
``whitespace_flexible``; ``json_object`` is the schema ``{"type": "object"}``;
a choice is a Lark alternation of the strings.

Where the mask is applied is the sampler's (:mod:`agents.engines.torch_engine.sampling`,
:mod:`agents.engines.sim`); when the grammar stops a request is the local scheduler's.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer, TokenizerWrapper
from numpy.typing import NDArray

from schemas import StructuredKind, StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "bitmask_width",
    "grammar_definition",
    "grammar_problem",
]

#: Compiled grammars a compiler keeps (least recently used dropped first).
DEFAULT_CACHE_SIZE = 256
#: Masks of a step computed in llguidance's thread pool from this many requests on, one after the
#: other below (vLLM's threshold): a mask takes microseconds, waking threads takes more.
PARALLEL_MASKS_FROM = 128
#: The longest compile error passed on to a client.
_MAX_ERROR_CHARS = 800

_BYTE_IDS = 256
_BYTE_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")


class GrammarError(ValueError):
    """A structured output that cannot be enforced; the message names the problem for the client."""


def bitmask_width(vocab_size: int) -> int:
    """32-bit words in one token mask over ``vocab_size`` ids."""
    return (vocab_size + 31) // 32


def _problem(structured: StructuredOutput, detail: str) -> str:
    detail = " ".join(detail.split())
    if len(detail) > _MAX_ERROR_CHARS:
        detail = detail[:_MAX_ERROR_CHARS] + "..."
    return f"structured output ({structured.kind.value}) is invalid: {detail}"


def _json_options(structured: StructuredOutput) -> JsonCompileOptions:
    return {"whitespace_flexible": structured.any_whitespace}


def _choice_lark(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"a choice is a JSON list of strings: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("a choice is a non-empty JSON list of strings")
    return "start: " + " | ".join(json.dumps(choice) for choice in choices)


def _schema_text(spec: str) -> str:
    """The schema as an object: ``true`` (anything) is ``{}``; ``false`` admits nothing."""
    text = spec.strip()
    if text == "true":
        return "{}"
    if text == "false":
        raise ValueError("the schema false admits no value")
    return spec


def grammar_definition(structured: StructuredOutput) -> str:
    """llguidance's grammar for ``structured`` (not yet checked against a vocabulary).

    Raises :class:`GrammarError` where the spec cannot even be read (JSON that does not parse,
    a choice that is not a list of strings, GBNF that does not translate)."""
    kind = structured.kind
    try:
        if kind is StructuredKind.JSON_SCHEMA:
            return LLMatcher.grammar_from_json_schema(
                _schema_text(structured.spec), defaults=_json_options(structured)
            )
        if kind is StructuredKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults=_json_options(structured)
            )
        if kind is StructuredKind.REGEX:
            return LLMatcher.grammar_from_regex(structured.spec)
        if kind is StructuredKind.CHOICE:
            return LLMatcher.grammar_from_lark(_choice_lark(structured.spec))
        if kind is StructuredKind.GRAMMAR:
            return llguidance.grammar_from("grammar", structured.spec)
    except (ValueError, TypeError, KeyError) as exc:
        raise GrammarError(_problem(structured, str(exc))) from None
    raise GrammarError(_problem(structured, f"unknown kind {kind!r}"))


def grammar_problem(structured: StructuredOutput) -> str | None:
    """What makes ``structured`` impossible to enforce, in the words an engine refuses it with;
    None if it compiles. Needs no vocabulary (the frontend checks requests with it)."""
    try:
        definition = grammar_definition(structured)
    except GrammarError as exc:
        return str(exc)
    error = LLMatcher.validate_grammar(definition)
    return _problem(structured, error) if error else None


class GrammarMatcher:
    """One request's position in its grammar. Built by :meth:`GrammarCompiler.build`."""

    __slots__ = ("_matcher", "kind", "vocab_size")

    def __init__(self, matcher: LLMatcher, kind: StructuredKind, vocab_size: int) -> None:
        self._matcher = matcher
        self.kind = kind
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Take the next generated token; False if the grammar refuses it (the matcher then
        refuses everything: the request cannot continue under its grammar)."""
        return bool(self._matcher.consume_token(token_id))

    def is_complete(self) -> bool:
        """The grammar admits no further token (but EOS): the request must finish. Also true after
        a refused token."""
        return bool(self._matcher.is_stopped())

    def is_accepting(self) -> bool:
        """The text so far is a whole match (EOS may come next), whether or not it could go on."""
        return bool(self._matcher.is_accepting())

    @property
    def error(self) -> str:
        """Why the matcher refuses everything, or ``""``."""
        return str(self._matcher.get_error())

    def fill_bitmask(self, out: NDArray[np.int32]) -> None:
        """Write the next position's allowed ids into ``out``: :func:`bitmask_width` int32 words,
        bit ``i % 32`` of word ``i // 32`` set if id ``i`` may come next (EOS when complete)."""
        width = bitmask_width(self.vocab_size)
        if out.dtype != np.int32 or out.shape != (width,) or not out.flags.c_contiguous:
            raise ValueError(f"a bitmask is a contiguous int32 vector of {width} words")
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def bitmask(self) -> NDArray[np.int32]:
        """The next position's mask (see :meth:`fill_bitmask`)."""
        out = np.zeros(bitmask_width(self.vocab_size), dtype=np.int32)
        self.fill_bitmask(out)
        return out

    def allowed_token_ids(self) -> NDArray[np.int64]:
        """The ids that may come next, ascending."""
        return allowed_ids(self.bitmask(), self.vocab_size)


def allowed_ids(bitmask: NDArray[np.int32], vocab_size: int) -> NDArray[np.int64]:
    """The ids set in a token mask, ascending."""
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def nth_allowed(bitmask: NDArray[np.int32], vocab_size: int, draw: int) -> int | None:
    """The allowed id at index ``draw`` modulo their number, in ascending order (the ids of
    ``allowed_ids``), found from the words' bit counts; None if the mask allows nothing."""
    words = bitmask.view(np.uint32)
    tail = vocab_size % 32
    if tail and len(words) * 32 > vocab_size:  # ids past the vocabulary do not count
        words = words.copy()
        words[-1] &= np.uint32((1 << tail) - 1)
    counts = np.cumsum(_bit_counts(words))
    if not len(counts) or counts[-1] == 0:
        return None
    index = draw % int(counts[-1])
    word = int(np.searchsorted(counts, index, side="right"))
    rank = index - (int(counts[word - 1]) if word else 0)
    bits = int(words[word])
    for _ in range(rank):
        bits &= bits - 1  # drop the lowest set bit
    return word * 32 + (bits & -bits).bit_length() - 1


def _bit_counts(words: NDArray[np.uint32]) -> NDArray[np.uint8]:
    """Set bits of each word."""
    if hasattr(np, "bitwise_count"):  # numpy 2
        counts: NDArray[np.uint8] = np.bitwise_count(words)
        return counts
    unpacked: NDArray[np.uint8] = np.unpackbits(words.view(np.uint8)).reshape(-1, 32)
    summed: NDArray[np.uint8] = unpacked.sum(axis=1, dtype=np.uint8)
    return summed


class _ByteVocabulary:
    """What llguidance's ``TokenizerWrapper`` reads of the byte tokenizer
    (:class:`agents.engines.tokenizer.ByteTokenizer`): ids 0..255 are bytes, the rest special."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < _BYTE_IDS + len(_BYTE_SPECIALS):
            raise ValueError(f"a byte vocabulary needs at least {_BYTE_IDS + len(_BYTE_SPECIALS)} ids")
        specials = [*_BYTE_SPECIALS, *(f"<|reserved_{k}|>" for k in range(vocab_size - _BYTE_IDS - 3))]
        self.tokens = [bytes([i]) for i in range(_BYTE_IDS)] + [s.encode() for s in specials]
        self.bos_token_id = _BYTE_IDS
        self.eos_token_id = _BYTE_IDS + 1
        self.special_token_ids = list(range(_BYTE_IDS, vocab_size))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


def byte_tokenizer(vocab_size: int) -> LLTokenizer:
    """llguidance's view of the byte tokenizer of ``vocab_size`` ids (EOS 257)."""
    return LLTokenizer(TokenizerWrapper(_ByteVocabulary(vocab_size)))


def checkpoint_tokenizer(folder: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> LLTokenizer:
    """llguidance's view of a checkpoint's ``tokenizer.json``, over the model's ``vocab_size`` ids
    (ids past the tokenizer's are never allowed); any of ``eos_token_ids`` ends a grammar."""
    text = (Path(folder) / "tokenizer.json").read_text(encoding="utf-8")
    eos: list[int] | None = list(eos_token_ids) or None
    return LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """Compiles structured outputs over one vocabulary and builds per-request matchers.

    The vocabulary is made on first use (a checkpoint's takes about a second), so an engine that
    never sees a constraint never pays for it. Used from one thread (the engine's scheduler).
    """

    def __init__(
        self,
        tokenizer: Callable[[], LLTokenizer],
        vocab_size: int,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if cache_size <= 0:
            raise ValueError(f"cache_size must be positive, got {cache_size}")
        self._make_tokenizer = tokenizer
        self._tokenizer: LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self.vocab_size = vocab_size  # the model's; a mask covers the tokenizer's ids (usually the same)
        self.cache_size = cache_size
        self._compiled: OrderedDict[tuple[StructuredKind, str, bool], LLMatcher | str] = OrderedDict()
        self._executor: LLExecutor | None = None
        self.num_compiled = 0  # grammars compiled (cache misses)

    @classmethod
    def for_bytes(cls, vocab_size: int, **options: Any) -> GrammarCompiler:
        """Over the byte tokenizer of random presets and the sim engine."""
        return cls(lambda: byte_tokenizer(vocab_size), vocab_size, **options)

    @classmethod
    def for_model(
        cls, model: str, vocab_size: int, eos_token_ids: Sequence[int], **options: Any
    ) -> GrammarCompiler:
        """Over the tokenizer of a torch engine's model: a checkpoint folder's ``tokenizer.json``,
        else (a preset) the byte tokenizer."""
        if Path(model).is_dir():
            return cls(lambda: checkpoint_tokenizer(model, vocab_size, eos_token_ids), vocab_size, **options)
        return cls.for_bytes(vocab_size, **options)

    @property
    def tokenizer(self) -> LLTokenizer:
        """llguidance's view of the vocabulary, made on first use; :class:`GrammarError` (every
        time) if it cannot be made."""
        if self._tokenizer is None:
            if self._tokenizer_error is not None:
                raise GrammarError(self._tokenizer_error)
            try:
                self._tokenizer = self._make_tokenizer()
            except (OSError, ValueError, RuntimeError, TypeError) as exc:
                self._tokenizer_error = (
                    f"structured outputs are unavailable: the vocabulary does not load ({exc})"
                )
                raise GrammarError(self._tokenizer_error) from None
        return self._tokenizer

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token)

    def _compile(self, structured: StructuredOutput) -> LLMatcher:
        key = (structured.kind, structured.spec, structured.any_whitespace)
        cached = self._compiled.get(key)
        if cached is None:
            self.num_compiled += 1
            try:
                definition = grammar_definition(structured)
            except GrammarError as exc:
                cached = str(exc)
            else:
                matcher = LLMatcher(self.tokenizer, definition, log_level=0)
                cached = _problem(structured, matcher.get_error()) if matcher.is_error() else matcher
            self._compiled[key] = cached
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        if isinstance(cached, str):
            raise GrammarError(cached)
        return cached

    def check(self, structured: StructuredOutput) -> None:
        """Raise :class:`GrammarError` unless ``structured`` compiles over this vocabulary."""
        self._compile(structured)

    def build(self, structured: StructuredOutput, generated: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher at the position after ``generated`` (the request's tokens so far, fed in order).

        Raises :class:`GrammarError` if the constraint does not compile or a generated token is one
        its grammar refuses."""
        matcher = self._compile(structured).deep_copy()
        if generated:
            tokens = list(generated)
            accepted = matcher.try_consume_tokens(tokens)
            if accepted < len(tokens):
                raise GrammarError(
                    f"generated token {accepted} (id {tokens[accepted]}) does not follow the "
                    f"{structured.kind.value} constraint"
                )
        return GrammarMatcher(matcher, structured.kind, self.tokenizer.vocab_size)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher]) -> NDArray[np.int32]:
        """The next position's masks of ``matchers``, one row each (in parallel threads from
        :data:`PARALLEL_MASKS_FROM` of them)."""
        width = bitmask_width(self.tokenizer.vocab_size)
        out = np.zeros((len(matchers), width), dtype=np.int32)
        if len(matchers) < PARALLEL_MASKS_FROM:
            for row, matcher in zip(out, matchers, strict=True):
                matcher.fill_bitmask(row)
        else:
            if self._executor is None:
                self._executor = LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(m._matcher, i) for i, m in enumerate(matchers)], out.ctypes.data, width * 4, len(matchers)
            )
        return out

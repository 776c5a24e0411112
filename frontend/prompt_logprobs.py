"""Echo and prompt logprobs on ``/v1/completions`` and ``/v1/chat/completions``, shaped as vLLM answers. Pure.

What lm-evaluation-harness's ``local-completions`` sends to score a continuation is a
completions request with ``echo: true`` and ``logprobs: k`` (``max_tokens`` 0 or 1,
temperature 0, prompts as token ids): the answer's text is the prompt followed by the
completion, and its ``logprobs`` cover the prompt's tokens then the completion's, the first
prompt token with a null logprob and null ``top_logprobs`` (nothing comes before it), every
other position with the token's logprob and ``top_logprobs`` holding the ``k`` most likely
tokens and the token itself (of tokens that read the same, such as bytes of an unfinished
character, the likeliest). ``text_offset`` counts characters of the token strings from the
start of the prompt, and the completion's tokens continue from the end of the echoed prompt text.

The echoed text of a string prompt is the string as sent; of a token-id prompt, the tokenizer's
decoding of those ids (special tokens included), as vLLM's. ``max_tokens`` 0 (only with echo)
returns the prompt alone, finish reason ``length``, no completion tokens.

vLLM's extension field ``prompt_logprobs: k`` adds ``prompt_logprobs`` to each completions choice
(to the chat response itself): per prompt position null (the first) or a map from token id (a
string) to ``{"logprob", "rank", "decoded_token"}`` holding the prompt token and the ``k`` most
likely tokens. ``rank`` is the token's place among the most likely (1 = most likely); a prompt
token outside the ``k`` alternatives has a null rank (the engines do not report it). As in vLLM,
``prompt_logprobs`` above 0 cannot stream (400), and a logprob of minus infinity reads -9999.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agents.engines.tokenizer import TextTokenizer
from frontend.errors import APIError
from frontend.openai_models import ChatCompletionRequest, CompletionRequest
from frontend.responses import Json
from frontend.turns import Turn
from schemas import Alternatives

__all__ = ["PromptEcho", "join_logprobs"]

#: what vLLM (and OpenAI) send for a logprob of minus infinity, which JSON cannot carry
_FLOOR = -9999.0


def _clamp(value: float) -> float:
    return max(value, _FLOOR)


@dataclass(frozen=True)
class PromptEcho:
    """What one request asks about its prompts: see the module docstring. Build with :meth:`of`."""

    #: per prompt, the text echoed before each of its choices' completions; None: no echo
    texts: tuple[str, ...] | None
    #: echo with logprobs: the alternatives per position in the answer's ``logprobs``; None: no logprobs
    logprobs: int | None
    #: vLLM's ``prompt_logprobs`` field: alternatives per position; None: no field
    field: int | None
    #: choices per prompt
    n: int

    @classmethod
    def of(
        cls,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: Sequence[Sequence[int]],
        tokenizer: TextTokenizer,
    ) -> PromptEcho | None:
        """What ``body`` asks of its ``prompts`` (token ids); None when it asks nothing."""
        echo = isinstance(body, CompletionRequest) and bool(body.echo)
        if not echo and body.prompt_logprobs is None:
            return None
        texts = None
        if isinstance(body, CompletionRequest) and echo:
            texts = tuple(_prompt_texts(body.prompt, prompts, tokenizer))
        return cls(
            texts=texts,
            logprobs=body.logprobs if isinstance(body, CompletionRequest) and echo else None,
            field=body.prompt_logprobs,
            n=body.n or 1,
        )

    def text(self, choice: int) -> str:
        """The prompt text echoed before choice ``choice``'s completion ("" without echo)."""
        return "" if self.texts is None else self.texts[choice // self.n]

    def completion_text(self, choice: int, text: str) -> str:
        """Choice ``choice``'s whole text: the echoed prompt, then its completion."""
        return self.text(choice) + text

    def completion_logprobs(
        self, turn: Turn, decode_one: Callable[[int], str], output: Json | None
    ) -> Json | None:
        """The echoed choice's ``logprobs`` (None without ``logprobs``): the prompt's positions (offsets
        from 0), then ``output`` (the completion's, built with offsets from the end of the prompt text)."""
        if self.logprobs is None:
            return output
        prompt = _echo_logprobs(turn, self.logprobs, decode_one)
        return prompt if output is None else join_logprobs(prompt, output)

    def field_value(self, turn: Turn, decode_one: Callable[[int], str]) -> list[Json | None] | None:
        """vLLM's ``prompt_logprobs`` for ``turn``'s prompt (None when not asked)."""
        if self.field is None:
            return None
        values, top = _scores(turn)
        out: list[Json | None] = [None]
        for token_id, value, alternatives in zip(
            turn.stream.job.prompt_ids[1:], values[1:], top[1:], strict=True
        ):
            assert value is not None
            ranks = {t: rank for rank, (t, _) in enumerate(alternatives, start=1)}
            entry = {str(token_id): _logprob(_clamp(value), ranks.get(token_id), decode_one(token_id))}
            for rank, (alternative, logprob) in enumerate(alternatives[: self.field], start=1):
                entry.setdefault(str(alternative), _logprob(_clamp(logprob), rank, decode_one(alternative)))
            out.append(entry)
        return out


def join_logprobs(first: Json, second: Json) -> Json:
    """Two completions ``logprobs`` objects of consecutive tokens as one."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [*first[key], *second[key]] for key in keys}


def _logprob(value: float, rank: int | None, token: str) -> Json:
    return {"logprob": value, "rank": rank, "decoded_token": token}


def _scores(turn: Turn) -> tuple[tuple[float | None, ...], tuple[Alternatives, ...]]:
    """The prompt logprobs the engine delivered for ``turn``; 500 if it gave none (an engine that cannot
    compute them refuses the request instead)."""
    assembler = turn.stream.assembler
    values, top = assembler.prompt_logprobs, assembler.prompt_top_logprobs
    num_prompt = len(turn.stream.job.prompt_ids)
    if (
        values is None
        or top is None
        or len(values) != num_prompt
        or len(top) != num_prompt
        or any(value is None for value in values[1:])
    ):
        raise APIError(500, "the engine returned no prompt logprobs for this request")
    return values, top


def _echo_logprobs(turn: Turn, k: int, decode_one: Callable[[int], str]) -> Json:
    """The prompt's part of an echoed completion's ``logprobs``."""
    values, top = _scores(turn)
    token_ids = turn.stream.job.prompt_ids
    tokens = [decode_one(t) for t in token_ids]
    offsets: list[int] = []
    at = 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    token_logprobs: list[float | None] = [None]
    top_logprobs: list[dict[str, float] | None] = [None]
    for token, value, alternatives in zip(tokens[1:], values[1:], top[1:], strict=True):
        assert value is not None
        token_logprobs.append(_clamp(value))
        alternative: dict[str, float] = {}
        for t, v in alternatives[:k]:
            alternative.setdefault(decode_one(t), _clamp(v))  # tokens that read the same: the likelier
        top_logprobs.append({**alternative, token: _clamp(value)})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _prompt_texts(prompt: object, prompts: Sequence[Sequence[int]], tokenizer: TextTokenizer) -> list[str]:
    """Each prompt's echoed text: a string prompt as sent, token ids decoded (special tokens kept)."""
    given = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
    return [
        text if isinstance(text, str) else tokenizer.decode(list(ids), skip_special_tokens=False)
        for text, ids in zip(given, prompts, strict=True)
    ]

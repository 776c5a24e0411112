"""A turn's pieces: every chunk of tokens reaches the client as it comes, even when its text is held back.

A client (and ``vllm bench serve``, which times the first token by the first chunk
with a choice) must see a token when it is generated, not when its text is complete:
the bytes of a multi-byte character and special tokens carry no text of their own.
"""

from __future__ import annotations

from typing import Any

from agents.engines.tokenizer import ByteTokenizer
from frontend.detokenize import IncrementalDetokenizer, StopStringMatcher
from frontend.streams import Accepted
from frontend.turns import Piece, Turn, pieces
from schemas import FinishReason


class _Stream:
    """The gateway stream's side a turn reads: chunks in order, then None."""

    def __init__(self, chunks: list[Accepted]) -> None:
        self._chunks = list(chunks)
        self.finish_reason: FinishReason | None = None
        self.request_id = "r"

    async def next_chunk(self) -> Accepted | None:
        if not self._chunks:
            return None
        chunk = self._chunks.pop(0)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        return chunk


async def _pieces(chunks: list[Accepted], stops: tuple[str, ...] = ()) -> list[Piece]:
    stream: Any = _Stream(chunks)
    turn = Turn(stream=stream, endpoint="completions", detokenizer=IncrementalDetokenizer(ByteTokenizer(512)),
                stops=StopStringMatcher(stops), want_logprobs=False, num_prompt_tokens=1)
    return [piece async for piece in pieces(turn)]


async def test_bytes_of_one_character_each_make_a_chunk_and_the_text_comes_whole() -> None:
    euro = "€".encode()  # three bytes, three tokens
    got = await _pieces([Accepted((b,)) for b in euro] + [Accepted((ord("a"),), None, FinishReason.LENGTH)])
    assert [(p.text, p.token_ids) for p in got] == [
        ("", (euro[0],)), ("", (euro[1],)), ("€", (euro[2],)), ("a", (ord("a"),)),
    ]
    assert got[-1].finish_reason is FinishReason.LENGTH


async def test_special_tokens_without_text_still_make_chunks() -> None:
    reserved = 300  # a reserved special id: skipped in the text
    got = await _pieces([Accepted((reserved,)), Accepted((reserved,)), Accepted((ord("b"),), None,
                                                                               FinishReason.LENGTH)])
    assert [(p.text, p.token_ids) for p in got] == [("", (reserved,)), ("", (reserved,)), ("b", (ord("b"),))]


async def test_text_held_for_a_stop_string_still_makes_chunks_and_the_stop_cuts_it() -> None:
    got = await _pieces([Accepted((ord(c),)) for c in "xyEND"], stops=("END",))
    assert "".join(p.text for p in got) == "xy"
    assert got[-1].finish_reason is FinishReason.STOP
    assert [p.token_ids for p in got] == [(ord(c),) for c in "xyEND"]

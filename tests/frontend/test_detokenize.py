"""Incremental detokenization never shows half a character, and stop strings cut the text right."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.engines.tokenizer import ByteTokenizer
from frontend.detokenize import IncrementalDetokenizer, StopStringMatcher, TokenTexts

TOKENIZER = ByteTokenizer(320)


def _stream(token_ids: list[int], splits: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(TOKENIZER)
    pieces: list[str] = []
    at = 0
    for size in splits:
        if at >= len(token_ids):
            break
        pieces.append(detok.push(token_ids[at : at + size]))
        at += size
    pieces.append(detok.push(token_ids[at:]))
    pieces.append(detok.flush())
    return pieces


def test_multibyte_character_split_across_tokens_is_held_until_complete() -> None:
    detok = IncrementalDetokenizer(TOKENIZER)
    euro = list("€".encode())  # three bytes
    assert detok.push([ord("a")]) == "a"
    assert detok.push(euro[:1]) == ""
    assert detok.push(euro[1:2]) == ""
    assert detok.push(euro[2:]) == "€"
    assert detok.flush() == ""
    assert detok.text == "a€"


@settings(max_examples=150, deadline=None)
@given(
    # U+FFFD itself is excluded: a piece may carry it only when the text does.
    text=st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), min_size=0, max_size=40),
    splits=st.lists(st.integers(min_value=1, max_value=5), max_size=40),
)
def test_streamed_text_equals_full_decode_and_no_piece_is_half_a_character(
    text: str, splits: list[int]
) -> None:
    ids = TOKENIZER.encode(text)
    pieces = _stream(ids, splits)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=20),
       specials=st.lists(st.tuples(st.integers(0, 80), st.integers(256, 258)), max_size=10),
       splits=st.lists(st.integers(min_value=1, max_value=4), max_size=30))
def test_valid_text_with_special_tokens_streams_to_exactly_the_full_decode(
    text: str, specials: list[tuple[int, int]], splits: list[int]
) -> None:
    """Any UTF-8 text, split anywhere and with special tokens between its bytes, streams exactly."""
    ids = list(text.encode())
    for position, special in sorted(specials, reverse=True):
        ids.insert(min(position, len(ids)), special)
    assert "".join(_stream(ids, splits)) == TOKENIZER.decode(ids)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=319), max_size=60),
       splits=st.lists(st.integers(min_value=1, max_value=4), max_size=30))
def test_random_bytes_and_specials_lose_no_character(ids: list[int], splits: list[int]) -> None:
    """A random model's output (invalid UTF-8, special ids) streams every character one decode gives.

    Invalid bytes held past the limit are shown as U+FFFD when released, so the
    *number* of replacement characters may differ from a single decode's; every
    real character arrives, in order, exactly once.
    """
    streamed = "".join(_stream(ids, splits))
    assert streamed.replace("\ufffd", "") == TOKENIZER.decode(ids).replace("\ufffd", "")


SHARED_TEXTS = {skip: TokenTexts(TOKENIZER, skip_special_tokens=skip, max_size=64) for skip in (True, False)}


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=319), max_size=60),
       splits=st.lists(st.integers(min_value=1, max_value=4), max_size=30),
       skip=st.booleans(), hidden=st.sets(st.integers(256, 258), max_size=2))
def test_shared_token_texts_give_every_piece_the_uncached_text(
    ids: list[int], splits: list[int], skip: bool, hidden: set[int]
) -> None:
    """Texts of single tokens remembered across requests (some past the memo's size) change no piece."""
    def pieces(texts: TokenTexts | None) -> list[str]:
        detok = IncrementalDetokenizer(TOKENIZER, [104, 105], skip_special_tokens=skip, hidden_ids=hidden,
                                       token_texts=texts)
        out, at = [], 0
        for size in splits:
            out.append(detok.push(ids[at : at + size]))
            at += size
        return [*out, detok.push(ids[at:]), detok.flush()]

    assert pieces(SHARED_TEXTS[skip]) == pieces(None)


def test_shared_token_texts_must_match_the_detokenizer() -> None:
    with pytest.raises(ValueError, match="same tokenizer"):
        IncrementalDetokenizer(TOKENIZER, skip_special_tokens=False, token_texts=SHARED_TEXTS[True])
    with pytest.raises(ValueError, match="same tokenizer"):
        IncrementalDetokenizer(ByteTokenizer(320), token_texts=SHARED_TEXTS[True])


def test_stop_string_cuts_before_the_match_even_across_pieces() -> None:
    matcher = StopStringMatcher(["STOP", "\n\n"])
    out = []
    for piece in ["hello S", "TO", "P world"]:
        safe, stopped = matcher.push(piece)
        out.append(safe)
        if stopped:
            break
    assert "".join(out) == "hello "
    assert matcher.stopped and matcher.matched == "STOP"
    assert matcher.push("more") == ("", True)


def test_text_without_stop_is_released_in_full_at_flush() -> None:
    matcher = StopStringMatcher(["xyz"])
    safe, stopped = matcher.push("abcxy")
    assert not stopped
    assert safe + matcher.flush() == "abcxy"


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), stop=st.text(alphabet="abc", min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=1, max_value=4), max_size=12))
def test_stop_matcher_agrees_with_str_find(text: str, stop: str, cuts: list[int]) -> None:
    matcher = StopStringMatcher([stop])
    out, at = [], 0
    for size in [*cuts, len(text)]:
        safe, stopped = matcher.push(text[at : at + size])
        out.append(safe)
        at += size
        if stopped:
            break
    if not matcher.stopped:
        out.append(matcher.flush())
    found = text.find(stop)
    assert "".join(out) == (text if found < 0 else text[:found])

"""Delta reassembly: order by index, drop duplicates and stale owner epochs, report gaps."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.streams import DeltaAssembler
from schemas import FinishReason, TokenDelta


def _delta(first: int, tokens: list[int], *, epoch: int = 0, finish: FinishReason | None = None,
           instance: str = "a") -> TokenDelta:
    return TokenDelta(request_id="r", instance_id=instance, owner_epoch=epoch, first_index=first,
                      token_ids=tuple(tokens), finish_reason=finish)


def _feed(assembler: DeltaAssembler, deltas: list[TokenDelta]) -> tuple[list[int], str | None]:
    out: list[int] = []
    finish = None
    for delta in deltas:
        accepted = assembler.accept(delta)
        out.extend(accepted.token_ids)
        finish = finish or accepted.finish_reason
    return out, finish


def test_out_of_order_delta_waits_for_the_gap_and_reports_it() -> None:
    assembler = DeltaAssembler()
    assert assembler.accept(_delta(0, [1, 2])).token_ids == (1, 2)
    assert assembler.accept(_delta(4, [5])).token_ids == ()
    assert assembler.gap_from == 2
    accepted = assembler.accept(_delta(2, [3, 4]))
    assert accepted.token_ids == (3, 4, 5)
    assert assembler.gap_from is None


def test_duplicates_and_overlaps_contribute_only_new_tokens() -> None:
    deltas = [_delta(0, [1, 2]), _delta(0, [1, 2]), _delta(1, [2, 3]), _delta(3, [4])]
    out, _ = _feed(DeltaAssembler(), deltas)
    assert out == [1, 2, 3, 4]


def test_stale_owner_epoch_is_dropped_after_a_migration() -> None:
    assembler = DeltaAssembler()
    out, finish = _feed(assembler, [
        _delta(0, [1]), _delta(1, [2], epoch=1, instance="b"),
        _delta(2, [99], epoch=0, instance="a"),  # the old owner, late
        _delta(2, [3], epoch=1, instance="b", finish=FinishReason.LENGTH),
    ])
    assert out == [1, 2, 3] and finish is FinishReason.LENGTH
    assert assembler.num_stale == 1 and assembler.owner_id == "b"


def test_rescue_epoch_drops_the_dead_owners_late_deltas() -> None:
    assembler = DeltaAssembler()
    assembler.accept(_delta(0, [1, 2]))
    assembler.expect_epoch(1, "b")
    assert assembler.accept(_delta(2, [7], epoch=0)).token_ids == ()
    assert assembler.accept(_delta(2, [3], epoch=1, instance="b")).token_ids == (3,)


def test_a_finish_without_tokens_ends_the_stream() -> None:
    assembler = DeltaAssembler()
    assembler.accept(_delta(0, [1]))
    assert assembler.accept(_delta(1, [], finish=FinishReason.ABORT)).finish_reason is FinishReason.ABORT
    assert assembler.finished


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 300), min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 5), max_size=20), seed=st.integers(0, 2**16),
       duplicate=st.booleans())
def test_any_delivery_order_with_duplicates_yields_the_sequence_once(
    tokens: list[int], cuts: list[int], seed: int, duplicate: bool
) -> None:
    deltas = []
    at = 0
    for size in [*cuts, len(tokens)]:
        if at >= len(tokens):
            break
        chunk = tokens[at : at + size]
        last = at + len(chunk) >= len(tokens)
        deltas.append(_delta(at, chunk, finish=FinishReason.STOP if last else None))
        at += len(chunk)
    shuffled = deltas + (deltas[: len(deltas) // 2] if duplicate else [])
    random.Random(seed).shuffle(shuffled)
    out, finish = _feed(DeltaAssembler(), shuffled)
    assert out == tokens and finish is FinishReason.STOP

"""The expectation table: which offers are admitted, what is refused and counted, and why."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import RejectReason, TransferCancelled, TransferHeader, TransferTimeout, TransportClosed
from transport.receiving import Admission, ExpectationTable


def header(migration_id: str, stage: int, nbytes: int, reservation_id: str = "") -> TransferHeader:
    return TransferHeader(
        migration_id=migration_id, stage=stage, nbytes=nbytes, reservation_id=reservation_id
    )


def land(table: ExpectationTable, offered: TransferHeader, data: bytes) -> RejectReason | None:
    admission = table.admit(offered)
    assert isinstance(admission, Admission), admission
    assert admission.landing.host is not None
    admission.landing.host[:] = data
    return table.land(admission)


async def test_an_expected_buffer_is_admitted_once_and_delivered() -> None:
    table = ExpectationTable()
    pending = table.expect("m", 0, 3)
    assert land(table, header("m", 0, 3), b"abc") is None
    assert bytes(await pending) == b"abc"
    assert table.admit(header("m", 0, 3)) is RejectReason.DUPLICATE
    assert table.stats().rejected == {"duplicate": 1}


async def test_a_second_offer_while_one_is_in_flight_is_a_duplicate() -> None:
    table = ExpectationTable()
    table.expect("m", 0, 3)
    first = table.admit(header("m", 0, 3))
    assert isinstance(first, Admission)
    assert table.admit(header("m", 0, 3)) is RejectReason.DUPLICATE


async def test_a_broken_transfer_releases_the_slot_for_a_retry() -> None:
    table = ExpectationTable()
    pending = table.expect("m", 1, 2)
    admission = table.admit(header("m", 1, 2))
    assert isinstance(admission, Admission)
    table.release(admission)
    assert land(table, header("m", 1, 2), b"ok") is None
    assert bytes(await pending) == b"ok"


async def test_cancel_while_in_flight_refuses_at_landing_and_leaves_the_waiter_cancelled() -> None:
    table = ExpectationTable()
    pending = table.expect("m", 0, 2)
    admission = table.admit(header("m", 0, 2))
    assert isinstance(admission, Admission)
    assert table.cancel("m") == 1
    assert table.land(admission) is RejectReason.CANCELLED
    with pytest.raises(TransferCancelled):
        await pending
    assert table.stats().transfers_received == 0


async def test_expecting_again_after_cancel_rearms_the_migration() -> None:
    table = ExpectationTable()
    table.expect("m", 0, 1)
    table.cancel("m")
    pending = table.expect("m", 0, 1)
    assert land(table, header("m", 0, 1), b"x") is None
    assert bytes(await pending) == b"x"


async def test_expecting_the_same_slot_twice_is_a_caller_error() -> None:
    table = ExpectationTable()
    table.expect("m", 0, 1)
    with pytest.raises(ValueError, match="already expected"):
        table.expect("m", 0, 1)


async def test_into_must_fit_the_transfer_and_be_writable() -> None:
    table = ExpectationTable()
    with pytest.raises(ValueError, match="holds 4 bytes"):
        table.expect("m", 0, 5, into=bytearray(4))
    with pytest.raises(ValueError, match="writable"):
        table.expect("m", 0, 4, into=b"abcd")
    with pytest.raises(ValueError, match="contiguous"):
        table.expect("m", 0, 32, into=torch.zeros(4, 4).t()[:2])
    into = torch.zeros(2, 3, dtype=torch.bfloat16)
    pending = table.expect("t", 0, 12, into=into)
    assert (
        land(
            table,
            header("t", 0, 12),
            torch.ones(2, 3, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes(),
        )
        is None
    )
    assert (await pending) is into and bool((into == 1).all())


async def test_timeout_expires_the_slot() -> None:
    table = ExpectationTable()
    pending = table.expect("m", 0, 1)
    with pytest.raises(TransferTimeout):
        await pending.wait(timeout=0.01)
    assert table.admit(header("m", 0, 1)) is RejectReason.EXPIRED


async def test_close_fails_waiters_and_refuses_offers() -> None:
    table = ExpectationTable()
    pending = table.expect("m", 0, 1)
    table.close()
    with pytest.raises(TransportClosed):
        await pending
    assert table.admit(header("m", 0, 1)) is RejectReason.CLOSED


async def test_tombstones_are_bounded() -> None:
    table = ExpectationTable(tombstone_limit=2)
    for name in ("a", "b", "c"):
        table.cancel(name)
    assert table.admit(header("a", 0, 1)) is RejectReason.UNKNOWN_TRANSFER
    assert table.admit(header("c", 0, 1)) is RejectReason.CANCELLED


offers = st.tuples(
    st.sampled_from(["m1", "m2", "m3"]),
    st.integers(min_value=0, max_value=2),
    st.integers(min_value=1, max_value=4),
    st.sampled_from(["", "r"]),
)


@settings(max_examples=100, deadline=None)
@given(expected=st.lists(offers, max_size=6), offered=st.lists(offers, max_size=12))
def test_only_exact_matches_land_and_every_refusal_is_counted(
    expected: list[tuple[str, int, int, str]], offered: list[tuple[str, int, int, str]]
) -> None:
    async def scenario() -> None:
        table = ExpectationTable()
        slots: dict[tuple[str, int], tuple[int, str]] = {}
        for migration_id, stage, nbytes, reservation in expected:
            if (migration_id, stage) not in slots:
                table.expect(migration_id, stage, nbytes, reservation_id=reservation)
                slots[(migration_id, stage)] = (nbytes, reservation)
        landed: set[tuple[str, int]] = set()
        refused = 0
        for migration_id, stage, nbytes, reservation in offered:
            result = table.admit(header(migration_id, stage, nbytes, reservation))
            key = (migration_id, stage)
            exact = slots.get(key) == (nbytes, reservation) and key not in landed
            assert isinstance(result, Admission) == exact
            if isinstance(result, Admission):
                assert table.land(result) is None
                landed.add(key)
            else:
                refused += 1
        stats = table.stats()
        assert stats.transfers_received == len(landed)
        assert stats.rejected_total == refused

    asyncio.run(scenario())

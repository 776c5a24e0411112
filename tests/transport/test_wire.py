"""The transfer protocol's control messages and the transport addresses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import (
    InvalidAddress,
    ProtocolViolation,
    TransferHeader,
    TransferRejected,
    transport_for_address,
)
from transport.address import format_address, parse_host_port, parse_inproc_name
from transport.wire import (
    CONTROL_SLOT_BYTES,
    Landed,
    Offer,
    Verdict,
    decode_control,
    frame_control,
    raise_if_refused,
    unframe_control,
)

headers = st.builds(
    TransferHeader,
    migration_id=st.text(max_size=40),
    stage=st.integers(min_value=0, max_value=10_000),
    nbytes=st.integers(min_value=0, max_value=1 << 40),
    reservation_id=st.text(max_size=20),
    checksum=st.none() | st.integers(min_value=0, max_value=0xFFFFFFFF),
)


@settings(max_examples=100, deadline=None)
@given(header=headers)
def test_an_offer_survives_framing_inside_a_larger_slot(header: TransferHeader) -> None:
    frame = frame_control(Offer(header=header))
    slot = bytearray(CONTROL_SLOT_BYTES)
    slot[: len(frame)] = frame
    assert unframe_control(slot) == Offer(header=header)


def test_replies_round_trip_and_refusals_raise() -> None:
    for reply in (Verdict(accepted=True), Landed(ok=True)):
        assert unframe_control(frame_control(reply)) == reply
        raise_if_refused(reply)
    with pytest.raises(TransferRejected) as rejected:
        raise_if_refused(Verdict(accepted=False, reason="size_mismatch"))
    assert rejected.value.reason == "size_mismatch"


def test_oversized_ids_are_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="ids too long"):
        frame_control(Offer(header=TransferHeader(migration_id="m" * CONTROL_SLOT_BYTES, stage=0, nbytes=1)))


def test_garbage_is_a_protocol_violation() -> None:
    with pytest.raises(ProtocolViolation):
        decode_control(b"\x93garbage")
    with pytest.raises(ProtocolViolation):
        unframe_control(b"\x00\x00\x10\x00short")
    with pytest.raises(ProtocolViolation):
        unframe_control(b"\x00")


def test_addresses_parse_and_name_their_transport() -> None:
    assert parse_host_port("tcp://10.0.0.5:7000", "tcp") == ("10.0.0.5", 7000)
    assert parse_host_port(format_address("ucx", "::1", 9), "ucx") == ("::1", 9)
    assert parse_inproc_name("inproc://agent-3") == "agent-3"
    assert transport_for_address("ucx://h:1") == "ucx"
    for bad in ("tcp://host", "tcp://:80", "tcp://h:0", "ucx://h:1", "h:1"):
        with pytest.raises(InvalidAddress):
            parse_host_port(bad, "tcp")
    with pytest.raises(InvalidAddress):
        parse_inproc_name("inproc://")

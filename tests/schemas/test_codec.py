"""The codec round-trips every message type and rejects malformed input (unknown reasons and
messages of an older schema that no longer decode included) with typed errors."""

from __future__ import annotations

import enum
import typing
from collections.abc import Mapping

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import schemas as s
from schemas.envelope import Body


def _examples() -> list[Body]:
    model = s.ModelIdentity(model_id="tiny", revision="r1", dtype="float32")
    layout = s.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
    return [
        s.InstanceJoined(
            instance_id="i0", num_blocks=100, block_size=16, model=model, kv_layout=layout,
            transport_address="tcp://127.0.0.1:1",
        ),
        s.InstanceHeartbeat(instance_id="i0", seq=3),
        s.InstanceTerminating(instance_id="i0"),
        s.InstanceLeft(instance_id="i0"),
        s.InstanceFailed(instance_id="i0", reason=s.FailureReason.NO_LOAD_REPORT, detail="silent", epoch=2),
        s.LoadReport(
            instance_id="i0", seq=1, num_total_blocks=100, num_free_blocks=50,
            num_reserved_blocks=0, running=(s.PriorityLoad(priority=0, num_running=2,
            num_blocks=50),), head_of_line_demand=4, num_waiting=1, batch_size=2,
            freeness=23.0, virtual_usage=54.0, num_accepted=3,
        ),
        s.Dispatched(epoch=1, request_id="r", instance_id="i0", policy="freeness",
                     num_prompt_tokens=7, loads=(s.LoadPosition(instance_id="i0",
                     stream_seq=9),)),
        s.Paired(epoch=1, source_id="a", destination_id="b", target_freeness=10.0,
                 source_freeness=1.0, destination_freeness=90.0),
        s.Unpaired(epoch=1, source_id="a", destination_id="b", reason=s.UnpairReason.SOURCE_RECOVERED),
        s.ScaleUp(epoch=1, num_instances=1, average_freeness=5.0),
        s.ScaleDown(epoch=1, instance_id="i0", average_freeness=70.0),
        s.PreAllocate(migration_id="m", request_id="r", source_id="a", destination_id="b",
                      stage=0, num_blocks=3),
        s.Ack(migration_id="m", stage=0, block_ids=(4, 5, 6)),
        s.Abort(migration_id="m", reason=s.MigrationAbortReason.OUT_OF_BLOCKS, detail="6 free"),
        s.StageDone(migration_id="m", stage=0, num_blocks=3, num_bytes=100, duration_s=0.1),
        s.Commit(migration_id="m", request_id="r", source_id="a", destination_id="b",
                 token_ids=(1, 2), num_prompt_tokens=1, owner_epoch=1, suspended_at=2.0),
        s.CommitAck(migration_id="m", request_id="r", destination_id="b", owner_epoch=1,
                    resumed_at=2.1),
        s.RequestArrived(request_id="r", num_prompt_tokens=3, max_tokens=4),
        s.RequestPlaced(request_id="r", instance_id="i0"),
        s.RequestFirstToken(request_id="r", instance_id="i0", ttft_s=0.1),
        s.RequestFinished(request_id="r", finish_reason=s.FinishReason.LENGTH, num_prompt_tokens=3,
                          num_output_tokens=4, e2e_s=1.0),
        s.RequestRescued(request_id="r", failed_instance_id="a", new_instance_id="b",
                         num_tokens_kept=2),
        s.RequestAborted(request_id="r", reason=s.CloseReason.CLIENT),
        s.GenerateRequest(request_id="r", token_ids=(1, 2, 3), sampling=s.SamplingParams(
            max_tokens=4, seed=1)),
        s.GenerateReply(request_id="r", instance_id="i0", accepted=True, num_accepted=1),
        s.GenerateReply(request_id="r", instance_id="i0", accepted=False, num_accepted=1,
                        reason=s.RejectReason.EXCEEDS_MODEL_CONTEXT, detail="300 > 256"),
        s.AbortRequest(request_id="r"),
        s.AbortReply(request_id="r", found=True),
        s.ResendRequest(request_id="r", from_index=3),
        s.DispatchRequest(request_id="r", num_prompt_tokens=3),
        s.DispatchReply(request_id="r", instance_id="i0", epoch=1),
        s.DispatchReply(request_id="r", instance_id=None, epoch=1, reason=s.DispatchFailReason.NO_INSTANCE),
        s.MigrateOut(epoch=1, destination_id="b", target_freeness=10.0),
        s.StopMigration(epoch=1, destination_id="b"),
        s.Drain(epoch=1),
        s.RpcError(code=s.RpcErrorCode.BAD_REQUEST, message="no"),
        s.CommandReply(accepted=False, reason=s.CommandRejectReason.STALE_EPOCH),
        s.TokenDelta(request_id="r", instance_id="i0", owner_epoch=0, first_index=0,
                     token_ids=(5,), finish_reason=s.FinishReason.STOP),
        s.TokenDeltaBatch(instance_id="i0", deltas=(
            s.TokenDelta(request_id="r", instance_id="i0", owner_epoch=0, first_index=0, token_ids=(5,)),
            s.TokenDelta(request_id="q", instance_id="i0", owner_epoch=1, first_index=3, token_ids=(6,),
                         finish_reason=s.FinishReason.LENGTH),
        )),
        s.GenerateRequest(request_id="r", token_ids=(1,), sampling=s.SamplingParams(max_tokens=4),
                          delta_subject="shoal.tokb.f1"),
    ]


@pytest.mark.parametrize("body", _examples(), ids=lambda b: type(b).__name__)
def test_every_message_round_trips_through_the_envelope(body: Body) -> None:
    codec = s.Codec("test")
    data = codec.encode(body, time=12.5, trace="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    envelope = codec.decode(data)
    assert envelope.body == body
    assert envelope.producer == "test"
    assert envelope.time == 12.5
    assert envelope.trace is not None
    assert envelope.v == s.SCHEMA_VERSION


def _raw(body: Mapping[str, object], v: int = s.SCHEMA_VERSION) -> bytes:
    return msgspec.msgpack.encode({"body": body, "v": v})


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b"\xc1\xc1\xc1", s.NotDecodable),
        (b"", s.NotDecodable),
        (_raw({"type": "no_such_message"}), s.UnknownMessageType),
        (_raw({"type": "instance_left"}), s.MissingField),
        (_raw({"type": "instance_left", "instance_id": 7}), s.WrongType),
        (_raw({"type": "mig_abort", "migration_id": "m", "reason": "no such reason"}), s.WrongType),
        (_raw({"type": "mig_abort", "migration_id": "m", "reason": 3}), s.WrongType),
        (msgspec.msgpack.encode([1, 2, 3]), s.WrongType),
        (msgspec.msgpack.encode({"body": {"type": "instance_left", "instance_id": "x"}, "v": 99}),
         s.UnsupportedVersion),
    ],
)
def test_malformed_payloads_raise_typed_errors_and_are_counted(
    payload: bytes, error: type[s.MalformedMessage]
) -> None:
    codec = s.Codec()
    with pytest.raises(error):
        codec.decode(payload)
    assert codec.rejected[error.kind] == 1
    assert codec.decode_or_none(payload) is None
    assert codec.num_rejected == 2


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@given(st.binary(max_size=256))
def test_random_bytes_never_escape_as_untyped_errors(data: bytes) -> None:
    codec = s.Codec()
    try:
        codec.decode(data)
    except s.MalformedMessage:
        assert codec.num_rejected == 1


@given(
    st.sampled_from([type(b) for b in _examples()]),
    st.dictionaries(st.text(max_size=20), _json_values, max_size=6),
)
def test_random_bodies_with_real_tags_are_rejected_or_valid(
    message_type: type[s.Message], fields: dict[str, object]
) -> None:
    tag = message_type.__struct_config__.tag
    codec = s.Codec()
    payload = msgspec.msgpack.encode({"body": {**fields, "type": tag}, "v": s.SCHEMA_VERSION})
    try:
        envelope = codec.decode(payload)
    except s.MalformedMessage:
        assert codec.num_rejected == 1
    else:
        assert isinstance(envelope.body, message_type)


def test_subjects_use_the_prefix_and_reject_bad_tokens() -> None:
    subjects = s.Subjects("prod.eu")
    assert subjects.load("i3") == "prod.eu.load.i3"
    assert subjects.mig("m1") == "prod.eu.ev.mig.m1"
    assert subjects.events_stream == "prod_eu_events"
    assert subjects.tok("r1") == "prod.eu.tok.r1"
    with pytest.raises(ValueError):
        subjects.req("a.b")
    with pytest.raises(ValueError):
        s.Subjects("bad prefix")


# -- reasons -------------------------------------------------------------------------------


def _reason_fields() -> list[tuple[type[s.Message], str, type[enum.StrEnum]]]:
    """Every (message type, field, enum) where a message carries a reason enum."""
    found = []
    for message_type in {type(b) for b in _examples()}:
        hints = typing.get_type_hints(message_type)
        for name in message_type.__struct_fields__:
            for arg in (hints[name], *typing.get_args(hints[name])):
                if isinstance(arg, type) and issubclass(arg, enum.StrEnum):
                    found.append((message_type, name, arg))
    return sorted(found, key=lambda f: (f[0].__name__, f[1]))


def test_every_reason_on_the_wire_is_an_enum_not_free_text() -> None:
    """No message says why in a ``str``: reasons, codes and finish reasons are schemas.reasons enums."""
    reasonish = {"reason", "code", "finish_reason", "error"}
    for message_type in {type(b) for b in _examples()}:
        hints = typing.get_type_hints(message_type)
        for name in set(message_type.__struct_fields__) & reasonish:
            args = (hints[name], *typing.get_args(hints[name]))
            assert any(isinstance(a, type) and issubclass(a, enum.StrEnum) for a in args), (
                f"{message_type.__name__}.{name} is {hints[name]}"
            )
    carried = {(t.__name__, f) for t, f, _ in _reason_fields()}
    assert {("GenerateReply", "reason"), ("Abort", "reason"), ("AbortRequest", "reason"),
            ("RequestAborted", "reason"), ("DispatchReply", "reason"), ("RpcError", "code"),
            ("TokenDelta", "finish_reason"), ("CommandReply", "reason")} <= carried


def test_reason_members_travel_as_their_value_and_come_back_as_members() -> None:
    abort = s.Abort(migration_id="m", reason=s.MigrationAbortReason.OUT_OF_BLOCKS)
    raw = msgspec.msgpack.decode(s.encode_body(abort))
    assert raw["reason"] == "out_of_blocks"  # readable on the wire, in logs and in JSON
    decoded = s.Codec().decode(s.Codec().encode(abort, time=0.0)).body
    assert isinstance(decoded, s.Abort) and decoded.reason is s.MigrationAbortReason.OUT_OF_BLOCKS
    assert msgspec.json.encode(s.RequestAborted(request_id="r", reason=s.CloseReason.DEADLINE)) == (
        b'{"type":"req_aborted","request_id":"r","reason":"deadline"}'
    )


@given(st.data())
def test_unknown_reason_values_are_counted_as_malformed_never_raised_raw(data: st.DataObject) -> None:
    message_type, field, enum_type = data.draw(st.sampled_from(_reason_fields()))
    example = next(b for b in _examples() if type(b) is message_type)
    value = data.draw(
        st.text(max_size=30) | st.integers(-(2**63), 2**63 - 1) | st.none()
        | st.sampled_from([m.value for m in enum_type])
    )
    body = {**msgspec.to_builtins(example), field: value}
    codec = s.Codec()
    try:
        envelope = codec.decode(_raw(body))
    except s.MalformedMessage as error:
        assert isinstance(error, s.WrongType) and f"$.body.{field}" in str(error)
        assert codec.rejected == {"wrong_type": 1}
    else:
        decoded = getattr(envelope.body, field)
        assert decoded is None or decoded in set(enum_type)


def test_an_old_message_that_no_longer_decodes_is_an_unsupported_version_naming_the_field() -> None:
    """A version-1 Abort carried its reason as a sentence; version 2 says which field and why."""
    old = _raw({"type": "mig_abort", "migration_id": "m", "reason": "destination aborted: no space"}, v=1)
    codec = s.Codec()
    with pytest.raises(s.UnsupportedVersion) as caught:
        codec.decode(old)
    error = caught.value
    assert error.version == 1
    assert "schema version 1" in str(error) and "$.body.reason" in str(error)
    assert s.SCHEMA_CHANGES[s.SCHEMA_VERSION] in str(error)  # what changed since
    assert codec.rejected == {"unsupported_version": 1}
    assert codec.decode_or_none(old) is None and codec.num_rejected == 2


def test_an_old_message_that_still_decodes_is_accepted() -> None:
    """Version 1 messages whose fields did not change (a load report, an instance leaving) still decode."""
    old = _raw({"type": "instance_left", "instance_id": "i0"}, v=1)
    envelope = s.Codec().decode(old)
    assert envelope.body == s.InstanceLeft(instance_id="i0") and envelope.v == 1


def test_a_newer_message_that_does_not_decode_is_an_unsupported_version() -> None:
    body = {"type": "mig_abort", "migration_id": "m", "reason": "from_the_future"}
    newer = _raw(body, v=s.SCHEMA_VERSION + 1)
    with pytest.raises(s.UnsupportedVersion, match="newer than supported"):
        s.Codec().decode(newer)


def test_the_schema_changelog_has_a_dated_line_for_every_version() -> None:
    assert sorted(s.SCHEMA_CHANGES) == list(range(1, s.SCHEMA_VERSION + 1))
    for line in s.SCHEMA_CHANGES.values():
        date = line.split(":", 1)[0]
        assert len(date) == 10 and date[4] == date[7] == "-", line

"""A small scripted cluster history appended to a real nats-server, for the log-reading commands.

Two instances join and report load, request ``r1`` arrives, is dispatched to
``i1``, placed, migrates ``i1 → i2`` (``m1``: two stages, commit) and finishes;
request ``r2`` arrives and is dispatched to ``i2``. Entries are appended in
that order, so sequence numbers are known to the tests.
"""

from __future__ import annotations

from bus import JetStreamBus
from schemas import Codec, Subjects
from schemas.decisions import Dispatched
from schemas.envelope import Body
from schemas.instance import InstanceHeartbeat, InstanceJoined, ModelIdentity
from schemas.load import LoadReport
from schemas.migration import Ack, Commit, CommitAck, PreAllocate, StageDone
from schemas.reasons import FinishReason
from schemas.requests import RequestArrived, RequestFinished, RequestFirstToken, RequestPlaced
from tests.scheduler.service_helpers import LAYOUT

__all__ = ["HISTORY_EVENTS", "write_history"]

T0 = 1_800_000_000.0


def _joined(instance_id: str) -> InstanceJoined:
    return InstanceJoined(
        instance_id=instance_id,
        num_blocks=100,
        block_size=16,
        model=ModelIdentity(model_id="m"),
        kv_layout=LAYOUT,
        transport_address="tcp://x",
    )


def _load(instance_id: str, seq: int, free: int) -> LoadReport:
    return LoadReport(
        instance_id=instance_id,
        seq=seq,
        num_total_blocks=100,
        num_free_blocks=free,
        num_reserved_blocks=0,
        running=(),
        head_of_line_demand=0,
        num_waiting=0,
        batch_size=0,
        freeness=float(free),
        virtual_usage=float(100 - free),
        num_accepted=seq,
    )


def history(subjects: Subjects) -> list[tuple[str, Body]]:
    mig = subjects.mig("m1")
    return [
        (subjects.instance("i1"), _joined("i1")),
        (subjects.instance("i2"), _joined("i2")),
        (subjects.load("i1"), _load("i1", 1, 40)),
        (subjects.load("i2"), _load("i2", 1, 90)),
        (subjects.req("r1"), RequestArrived(request_id="r1", num_prompt_tokens=32, max_tokens=64)),
        (
            subjects.sched("dispatch"),
            Dispatched(
                epoch=1,
                request_id="r1",
                instance_id="i2",
                policy="freeness",
                num_prompt_tokens=32,
                events_seq=4,
                loads_seq=2,
            ),
        ),
        (subjects.req("r1"), RequestPlaced(request_id="r1", instance_id="i2")),
        (subjects.instance("i1"), InstanceHeartbeat(instance_id="i1", seq=1)),
        (subjects.req("r1"), RequestFirstToken(request_id="r1", instance_id="i2", ttft_s=0.05)),
        (
            mig,
            PreAllocate(
                migration_id="m1", request_id="r1", source_id="i2", destination_id="i1", stage=0, num_blocks=2
            ),
        ),
        (mig, Ack(migration_id="m1", stage=0, block_ids=(1, 2))),
        (mig, StageDone(migration_id="m1", stage=0, num_blocks=2, num_bytes=100, duration_s=0.01)),
        (
            mig,
            Commit(
                migration_id="m1",
                request_id="r1",
                source_id="i2",
                destination_id="i1",
                token_ids=(1, 2),
                num_prompt_tokens=32,
                owner_epoch=1,
                suspended_at=T0 + 1.0,
            ),
        ),
        (
            f"{mig}.outcome",
            CommitAck(
                migration_id="m1", request_id="r1", destination_id="i1", owner_epoch=2, resumed_at=T0 + 1.004
            ),
        ),
        (subjects.req("r2"), RequestArrived(request_id="r2", num_prompt_tokens=16, max_tokens=8)),
        (
            subjects.sched("dispatch"),
            Dispatched(epoch=1, request_id="r2", instance_id="i2", policy="freeness", num_prompt_tokens=16),
        ),
        (
            subjects.req("r1"),
            RequestFinished(
                request_id="r1",
                finish_reason=FinishReason.LENGTH,
                num_prompt_tokens=32,
                num_output_tokens=64,
                e2e_s=2.0,
            ),
        ),
    ]


HISTORY_EVENTS = 15  # entries of history() on the events stream (the rest are load reports)


async def write_history(bus: JetStreamBus) -> None:
    codec = Codec(producer="test")
    for index, (subject, body) in enumerate(history(bus.config.subjects)):
        await bus.append(subject, codec.encode(body, time=T0 + index * 0.1))

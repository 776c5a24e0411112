"""The retention part of ``shoal bench recovery``: bytes per busy instance-hour, and recovery with it.

It writes ``busy_s`` seconds of a busy cluster (64 instances, each reporting
its load 10 times a second as a busy agent does, values that move every
report; ``rate`` requests a second dispatched with their lifecycle events and
a fold point every half second) into a fresh prefix whose loads stream keeps
the production default of 100 reports per instance, and archives it with the
scheduler's own :class:`~scheduler.history.LoadArchiver` once per second of
log (its production interval), plus a checkpoint of the state. Then it reads
every stream's stored bytes from the server and divides by the instance-hours
written. Last, a scheduler runs over the log (leaving a snapshot), is
crashed, and the time from starting a new one to its first dispatch is
measured (the new one resumes archiving in the background).
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

from bus import BusConfig, JetStreamBus
from bus.protocol import StreamConfig
from scheduler.cluster_state import initial_state
from scheduler.history import LoadArchiver, checkpoint_message
from scheduler.recompute import Cursor
from schemas import Codec, Subjects
from schemas.decisions import Dispatched, LoadPosition, SchedulerTick
from schemas.instance import InstanceJoined, KVLayout, ModelIdentity
from schemas.load import LoadReport, PriorityLoad
from schemas.reasons import FinishReason
from schemas.requests import RequestArrived, RequestFinished, RequestFirstToken, RequestPlaced

__all__ = ["REPORTS_PER_S", "measure_retention"]

NUM_INSTANCES = 64
REPORTS_PER_S = 10
NUM_BLOCKS = 851


class _Instance:
    """A busy instance's load as a random walk: requests come and go, sequences grow."""

    def __init__(self, instance_id: str, rng: random.Random) -> None:
        self.instance_id = instance_id
        self.rng = rng
        self.seq = 0
        self.running: list[int] = [rng.randint(9, 40) for _ in range(rng.randint(4, 12))]
        self.waiting = 0
        self.accepted = 0
        self.preemptions = 0

    def step(self) -> LoadReport:
        rng = self.rng
        self.running = [blocks + (1 if rng.random() < 0.4 else 0) for blocks in self.running]
        if self.running and rng.random() < 0.15:
            self.running.pop(rng.randrange(len(self.running)))
        used = sum(self.running)
        if self.waiting and used + 9 < NUM_BLOCKS:
            self.waiting -= 1
            self.running.append(9)
        if used > NUM_BLOCKS - 20 and self.running:
            self.preemptions += 1
            self.running.pop()
            self.waiting += 1
        used = sum(self.running)
        count = len(self.running)
        self.seq += 1
        return LoadReport(
            instance_id=self.instance_id,
            seq=self.seq,
            num_total_blocks=NUM_BLOCKS,
            num_free_blocks=NUM_BLOCKS - used,
            num_reserved_blocks=0,
            running=(PriorityLoad(priority=0, num_running=count, num_blocks=used),) if count else (),
            head_of_line_demand=9 if self.waiting else 0,
            num_waiting=self.waiting,
            batch_size=count,
            freeness=(NUM_BLOCKS - used - (9 if self.waiting else 0)) / max(count, 1),
            virtual_usage=float(used + (9 if self.waiting else 0)),
            num_accepted=self.accepted,
            waiting_demand=9 * self.waiting,
            num_preemptions=self.preemptions,
        )


def finished_request(request_id: str) -> RequestFinished:
    """A synthetic request's end: 128 prompt tokens, 32 output tokens in a second (the benches' shape)."""
    return RequestFinished(
        request_id=request_id, finish_reason=FinishReason.LENGTH, num_prompt_tokens=128, num_output_tokens=32,
        e2e_s=1.0,
    )


def bus_config(url: str, subjects: Subjects) -> BusConfig:
    """The production retention of the loads stream (100 reports per instance)."""
    return BusConfig(url=url, subjects=subjects, streams=StreamConfig())


async def _stream_bytes(bus: JetStreamBus, stream: str) -> tuple[int, int]:
    info = await bus.client.jsm().stream_info(stream)
    return int(info.state.bytes), int(info.state.messages)


async def write_busy_log(bus: JetStreamBus, busy_s: int, rate: int, *, seed: int = 0) -> dict[str, Any]:
    """Append ``busy_s`` seconds of a busy cluster, archiving each second; returns counts."""
    subjects = bus.config.subjects
    rng = random.Random(seed)
    codec = Codec(producer="bench")
    layout = KVLayout(num_layers=32, num_kv_heads=32, head_dim=128, block_size=16, dtype="float16")
    instances = [_Instance(f"inst-{k:03d}", rng) for k in range(NUM_INSTANCES)]
    archiver = LoadArchiver(bus)
    start = time.time() - busy_s
    events_seq = await bus.last_seq(subjects.events_stream)
    loads_seq = await bus.last_seq(subjects.loads_stream)
    epoch, request = 1, 0
    async with bus.appender(max_in_flight=4096) as pipe:

        async def event(subject: str, body: Any, at: float) -> None:
            nonlocal events_seq
            events_seq += 1
            await pipe.append(subject, codec.encode(body, time=at))

        await event(subjects.sched("tick"), SchedulerTick(epoch=epoch, takeover=True), start)
        for inst in instances:
            joined = InstanceJoined(
                instance_id=inst.instance_id,
                num_blocks=NUM_BLOCKS,
                block_size=16,
                model=ModelIdentity(model_id="m"),
                kv_layout=layout,
                transport_address=f"tcp://{inst.instance_id}",
                engine="sim",
            )
            await event(subjects.instance(inst.instance_id), joined, start)
        await pipe.flush()
        await archiver.resume()
        for second in range(busy_s):
            for tenth in range(REPORTS_PER_S):
                at = start + second + tenth / REPORTS_PER_S
                for inst in instances:
                    loads_seq += 1
                    await pipe.append(subjects.load(inst.instance_id), codec.encode(inst.step(), time=at))
                for _ in range(rate // REPORTS_PER_S):
                    inst = instances[rng.randrange(NUM_INSTANCES)]
                    request_id = f"req-{request}"
                    request += 1
                    inst.accepted += 1
                    await event(
                        subjects.req(request_id),
                        RequestArrived(request_id=request_id, num_prompt_tokens=128, max_tokens=32),
                        at,
                    )
                    await event(
                        subjects.sched("dispatch"),
                        Dispatched(
                            epoch=epoch,
                            request_id=request_id,
                            instance_id=inst.instance_id,
                            policy="freeness",
                            num_prompt_tokens=128,
                            loads=(LoadPosition(instance_id=inst.instance_id, stream_seq=loads_seq),),
                            events_seq=events_seq,
                            loads_seq=loads_seq,
                        ),
                        at,
                    )
                    await event(
                        subjects.req(request_id),
                        RequestPlaced(request_id=request_id, instance_id=inst.instance_id),
                        at,
                    )
                    await event(
                        subjects.req(request_id),
                        RequestFirstToken(request_id=request_id, instance_id=inst.instance_id, ttft_s=0.05),
                        at,
                    )
                    await event(
                        subjects.req(request_id),
                        finished_request(request_id),
                        at,
                    )
                if tenth % 5 == 4:
                    await event(
                        subjects.sched("tick"),
                        SchedulerTick(epoch=epoch, events_seq=events_seq, loads_seq=loads_seq),
                        at,
                    )
            await pipe.flush()
            await archiver.flush()  # the scheduler archives once a second
        state = initial_state(gapless_streams=(subjects.events_stream,))
        checkpoint = checkpoint_message(
            state, Cursor(events_seq, loads_seq), epoch=epoch, taken_at=time.time(), policy=""
        )
        await bus.append(subjects.history("checkpoint"), codec.encode(checkpoint, time=time.time()))
    return {"requests": request, "reports": archiver.num_archived, "archive_batches": archiver.num_batches}


async def measure_retention(url: str, busy_s: int, rate: int) -> dict[str, Any]:
    """Bytes per instance-hour of every stream after ``busy_s`` busy seconds (see the module doc)."""
    subjects = Subjects(f"bench{uuid.uuid4().hex[:8]}")
    async with JetStreamBus(bus_config(url, subjects)) as bus:
        written = time.perf_counter()
        counts = await write_busy_log(bus, busy_s, rate)
        written = time.perf_counter() - written
        instance_hours = NUM_INSTANCES * busy_s / 3600.0
        streams: dict[str, Any] = {}
        for name, stream in (
            ("events", subjects.events_stream),
            ("loads", subjects.loads_stream),
            ("history", subjects.history_stream),
        ):
            size, messages = await _stream_bytes(bus, stream)
            streams[name] = {
                "bytes": size,
                "messages": messages,
                "mb_per_instance_hour": round(size / instance_hours / 1e6, 3),
            }
    # the loads stream keeps 100 reports per instance: a constant, not a cost per hour
    streams["loads"]["mb_per_instance_hour"] = None
    streams["loads"]["bounded_mb_per_instance"] = round(streams["loads"]["bytes"] / NUM_INSTANCES / 1e6, 3)
    return {
        "subjects": subjects,
        "busy_s": busy_s,
        "rate": rate,
        "instances": NUM_INSTANCES,
        "reports_per_instance_s": REPORTS_PER_S,
        "write_s": round(written, 1),
        "streams": streams,
        **counts,
    }

"""Snapshots of the folded cluster state in the NATS KV bucket.

A :class:`SnapshotRecord` holds the state at one of the active scheduler's
fold points (:func:`scheduler.cluster_state.encode_snapshot`), the fold point
itself (events and loads sequences it includes), the control epoch and the
prefix index (:mod:`scheduler.prefix_index`, at its own kv-stream sequence).
Recovery loads the latest one and replays the log's tail from its fold point.
The encoded record is split into chunks under ``scheduler.snapshot.<n>`` when
it exceeds one NATS message; the head key ``scheduler.snapshot`` is written
last, so a reader never sees a half-written snapshot.
"""

from __future__ import annotations

import msgspec

from bus.protocol import Bus
from scheduler.cluster_state import ClusterState, decode_snapshot, encode_snapshot
from scheduler.recompute import Cursor

__all__ = ["SNAPSHOT_KEY", "SnapshotRecord", "SnapshotStore"]

SNAPSHOT_KEY = "scheduler.snapshot"
_CHUNK = 512 * 1024


class SnapshotRecord(msgspec.Struct, frozen=True, kw_only=True):
    state: bytes
    events_seq: int
    loads_seq: int
    control_epoch: int
    taken_at: float
    holder: str = ""
    #: The control epoch's policy as its takeover tick recorded it (that tick may precede the snapshot).
    policy: str = ""
    #: The prefix index (:func:`scheduler.prefix_index.encode_index`, with the last kv-stream
    #: sequence it folded); b"": none (a snapshot from before it, or no cache events yet).
    prefix_index: bytes = b""

    @property
    def cursor(self) -> Cursor:
        return Cursor(self.events_seq, self.loads_seq)

    def decode_state(self) -> ClusterState:
        return decode_snapshot(self.state)


class _Head(msgspec.Struct, frozen=True):
    num_chunks: int
    generation: int


_encoder = msgspec.msgpack.Encoder()
_record = msgspec.msgpack.Decoder(SnapshotRecord)
_head = msgspec.msgpack.Decoder(_Head)


class SnapshotStore:
    """Saves and loads the latest snapshot in the bus's KV bucket."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._generation = 0
        self.num_saved = 0
        self.last_size = 0

    async def save(
        self,
        state: ClusterState,
        cursor: Cursor,
        *,
        control_epoch: int,
        taken_at: float,
        holder: str = "",
        policy: str = "",
        prefix_index: bytes = b"",
    ) -> int:
        """Store a snapshot; returns its size in bytes."""
        data = _encoder.encode(
            SnapshotRecord(
                state=encode_snapshot(state),
                events_seq=cursor.events_seq,
                loads_seq=cursor.loads_seq,
                control_epoch=control_epoch,
                taken_at=taken_at,
                holder=holder,
                policy=policy,
                prefix_index=prefix_index,
            )
        )
        self._generation = (self._generation + 1) % 2
        chunks = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
        for index, chunk in enumerate(chunks):
            await self.bus.kv_put(f"{SNAPSHOT_KEY}.g{self._generation}.{index}", chunk)
        await self.bus.kv_put(SNAPSHOT_KEY, _encoder.encode(_Head(len(chunks), self._generation)))
        self.num_saved += 1
        self.last_size = len(data)
        return len(data)

    async def load(self) -> SnapshotRecord | None:
        head_entry = await self.bus.kv_get(SNAPSHOT_KEY)
        if head_entry is None or not head_entry.value:
            return None
        try:
            head = _head.decode(head_entry.value)
            parts = []
            for index in range(head.num_chunks):
                entry = await self.bus.kv_get(f"{SNAPSHOT_KEY}.g{head.generation}.{index}")
                if entry is None:
                    return None
                parts.append(entry.value)
            record = _record.decode(b"".join(parts))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        self._generation = head.generation
        return record

    async def clear(self) -> None:
        if await self.bus.kv_get(SNAPSHOT_KEY) is not None:
            await self.bus.kv_delete(SNAPSHOT_KEY)

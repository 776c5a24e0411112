"""The history stream: load reports archived for long retention, and checkpoints of the state.

The loads stream keeps a few seconds of reports per instance (it is what a
recovering scheduler reads, so it must stay short). The active scheduler
copies every report it reads into ``<prefix>.hist.loads`` in compressed
batches (:class:`ArchivedLoads`: the stored entries byte for byte, with their
loads-stream sequences, so a replay folds exactly what the scheduler folded),
and appends a :class:`Checkpoint` of its folded state every few minutes to
``<prefix>.hist.checkpoint``, so a replay of any instant of the history
stream's window starts from the checkpoint before it even after the events
stream dropped the instances' ``InstanceJoined``. No I/O lives here.
"""

from __future__ import annotations

from schemas.base import Message

__all__ = ["ArchivedLoads", "Checkpoint", "HistoryMessage"]


class ArchivedLoads(Message, frozen=True, kw_only=True, tag="archived_loads"):
    """Consecutive loads-stream entries ``first_seq..last_seq`` (those still stored when read).

    ``data`` is ``zlib(msgpack([[seq, time, subject, payload, msg_id], ...]))``.
    """

    first_seq: int
    last_seq: int
    num_entries: int
    data: bytes
    encoding: str = "zlib+msgpack"


class Checkpoint(Message, frozen=True, kw_only=True, tag="checkpoint"):
    """The active scheduler's folded state at one of its fold points.

    ``state`` is ``zlib(scheduler.cluster_state.encode_snapshot(state))``;
    ``policy`` the control epoch's recorded policy (JSON, "" if unknown).
    """

    epoch: int
    events_seq: int
    loads_seq: int
    taken_at: float
    state: bytes
    policy: str = ""
    encoding: str = "zlib+msgpack"


HistoryMessage = ArchivedLoads | Checkpoint

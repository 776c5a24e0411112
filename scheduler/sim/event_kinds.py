"""The simulator's event kinds: what each heap entry of the virtual clock stands for.

Heap entries are ``(time, insertion counter, kind, payload)``; equal times run
in insertion order, so a run is deterministic.
"""

from __future__ import annotations

import enum

__all__ = ["EventKind"]


class EventKind(enum.IntEnum):
    ARRIVAL = 0  # payload: position of the request among those whose arrival is set in advance
    STEP_END = 1  # payload: the SimInstance whose step ends
    REPORT = 2  # payload: tick number
    PAIR = 3  # payload: tick number
    SCALE = 4  # payload: tick number
    SAMPLE = 5  # payload: tick number
    MIGRATION = 6  # payload: a migration_shell.Delivery (a message, copy, tick or answer reaching one side)
    READY = 7  # payload: id of a launched instance that joins now
    TURN = 8  # payload: index in the workload of a session's next turn, sent now

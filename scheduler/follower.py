"""Following the log at fold points: the buffered fold and the shadow of the active scheduler.

:class:`LogFollower` holds the folded state at the last fold point and the
events and load reports received since, and folds a segment (buffered events
up to a sequence, then buffered reports up to a sequence) on demand, either
as a preview (the state is returned, nothing changes) or committed.

:class:`Shadow` drives a follower from the log's own records of fold points
(see :mod:`scheduler.recompute`): it reads the scheduler events in order,
keeps the control epoch (an event of an older epoch than one already seen is
stale and ignored), folds each recorded fold point once its load reports have
arrived, and can recompute each dispatch and pairing decision over the view
it was made from and compare, with the policy configuration the epoch's
takeover tick recorded. A standby scheduler, a restarted one catching
up, and ``shoal replay`` all run this same code, so they agree with the
active scheduler on every fold.

No I/O and no clock: the service feeds messages in and reads results out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import msgspec

from scheduler.cluster_state import ClusterState
from scheduler.config import PolicyConfig, decode_policy
from scheduler.fold import replay
from scheduler.recompute import (
    Cursor,
    apply_overlay,
    fold_point_of,
    overlay_of,
    recomputable,
    recompute,
    scheduler_epoch,
)
from schemas.decisions import SchedulerTick
from schemas.envelope import Body
from schemas.load import LoadReport
from schemas.position import Position

__all__ = ["BufferedEvent", "LogFollower", "Mismatch", "Shadow", "ShadowStats"]


class BufferedEvent(msgspec.Struct, frozen=True, gc=False):
    """An event received and not folded yet; ``msg_id`` is its de-duplication id ("" if none)."""

    seq: int
    body: Body
    msg_id: str = ""


class LogFollower:
    """The state at the last fold point plus what arrived since, per stream."""

    def __init__(
        self, state: ClusterState, *, events_stream: str, loads_stream: str, cursor: Cursor | None = None
    ) -> None:
        """``cursor``: the fold point ``state`` is at (default: its positions; a snapshot names its own)."""
        self.state = state
        self.events_stream = events_stream
        self.loads_stream = loads_stream
        self.events: deque[BufferedEvent] = deque()
        self.loads: deque[tuple[int, LoadReport]] = deque()
        if cursor is None:
            cursor = Cursor(state.positions.get(events_stream, 0), state.positions.get(loads_stream, 0))
        self.last_event_seq, self.last_load_seq = cursor
        self._cursor = cursor
        #: Events the stream no longer had when this follower started from an older position.
        self.num_skipped_events = 0

    @property
    def cursor(self) -> Cursor:
        """The fold point the state is at (a loads sequence may name a report retention dropped)."""
        return self._cursor

    @property
    def received(self) -> Cursor:
        """The last sequence received per stream (folded or buffered)."""
        return Cursor(self.last_event_seq, self.last_load_seq)

    @property
    def num_buffered(self) -> int:
        return len(self.events) + len(self.loads)

    def add_event(self, seq: int, body: Body, msg_id: str = "") -> None:
        if seq <= self.last_event_seq:
            return  # a repeat delivery
        at_start = not self.events and self.last_event_seq == self._cursor.events_seq
        if seq > self.last_event_seq + 1 and at_start:
            # the stream's retention dropped events this state never folded (a log older than its
            # history, or a snapshot older than it): go on from what exists rather than never recover
            positions = {**self.state.positions, self.events_stream: seq - 1}
            self.state = msgspec.structs.replace(self.state, positions=positions)
            self._cursor = Cursor(seq - 1, self._cursor.loads_seq)
            self.num_skipped_events += seq - 1 - self.last_event_seq
        self.last_event_seq = seq
        self.events.append(BufferedEvent(seq, body, msg_id))

    def add_load(self, seq: int, body: LoadReport) -> None:
        if seq <= self.last_load_seq:
            return
        self.last_load_seq = seq
        self.loads.append((seq, body))

    def _segment(self, cursor: Cursor) -> Iterator[tuple[Position, Body]]:
        for event in self.events:
            if event.seq > cursor.events_seq:
                break
            yield Position(self.events_stream, event.seq), event.body
        for seq, report in self.loads:
            if seq > cursor.loads_seq:
                break
            yield Position(self.loads_stream, seq), report

    def preview(self, cursor: Cursor | None = None) -> tuple[ClusterState, Cursor]:
        """The state after folding the segment up to ``cursor`` (default: all received); no change."""
        target = self.received if cursor is None else cursor
        if not self.events and not self.loads:
            return self.state, self.cursor
        state = replay(self._segment(target), self.state)
        return state, Cursor(
            max(self.cursor.events_seq, min(target.events_seq, self.last_event_seq)),
            max(self.cursor.loads_seq, min(target.loads_seq, self.last_load_seq)),
        )

    def commit(self, state: ClusterState, cursor: Cursor) -> list[BufferedEvent]:
        """Adopt ``state`` (from :meth:`preview` at ``cursor``); returns the events it folded."""
        folded: list[BufferedEvent] = []
        while self.events and self.events[0].seq <= cursor.events_seq:
            folded.append(self.events.popleft())
        while self.loads and self.loads[0][0] <= cursor.loads_seq:
            self.loads.popleft()
        self.state = state
        self._cursor = cursor
        return folded

    def fold_through(self, cursors: list[Cursor]) -> None:
        """Fold segment after segment up to each of ``cursors`` (non-decreasing) in one pass."""
        if not cursors:
            return

        def segments() -> Iterator[tuple[Position, Body]]:
            for cursor in cursors:
                while self.events and self.events[0].seq <= cursor.events_seq:
                    event = self.events.popleft()
                    yield Position(self.events_stream, event.seq), event.body
                while self.loads and self.loads[0][0] <= cursor.loads_seq:
                    seq, report = self.loads.popleft()
                    yield Position(self.loads_stream, seq), report

        self.state = replay(segments(), self.state)
        self._cursor = cursors[-1]

    def fold_to(self, cursor: Cursor) -> list[BufferedEvent]:
        state, reached = self.preview(cursor)
        return self.commit(state, reached)

    def buffered_events(self) -> list[tuple[int, Body]]:
        return [(event.seq, event.body) for event in self.events]


class Mismatch(msgspec.Struct, frozen=True):
    """A recorded decision that recomputation did not reproduce."""

    seq: int
    recorded: Body
    recomputed: Body | None


class ShadowStats(msgspec.Struct):
    fold_points: int = 0
    verified: int = 0
    stale: int = 0
    not_recomputable: int = 0
    unverified: int = 0
    regressions: int = 0
    unknown_policies: int = 0


class Shadow:
    """Applies the fold points the log records, in order, and recomputes decisions if asked."""

    def __init__(
        self,
        follower: LogFollower,
        *,
        control_epoch: int = 0,
        policy: PolicyConfig | None = None,
        verify: bool = False,
    ) -> None:
        """``policy``: the rules to recompute decisions with until a takeover tick records its own."""
        self.follower = follower
        self.control_epoch = control_epoch
        self.policy = PolicyConfig() if policy is None else policy
        #: The policy each epoch's takeover tick recorded (its decisions are recomputed with it).
        self.policies: dict[int, PolicyConfig] = {}
        self.verify = verify
        #: Called with ``(seq, decision, view)`` for each decision whose view is known here.
        self.observer: Callable[[int, Body, ClusterState], None] | None = None
        self.stats = ShadowStats()
        self.mismatches: list[Mismatch] = []
        self._pending: deque[tuple[int, Body]] = deque()
        #: Decisions are recomputable once a fold point was applied here (not inherited from a snapshot).
        self._anchored = False

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    def on_event(self, seq: int, body: Body, msg_id: str = "") -> None:
        self.follower.add_event(seq, body, msg_id)
        if scheduler_epoch(body) is not None:
            self._pending.append((seq, body))

    def on_load(self, seq: int, body: LoadReport) -> None:
        self.follower.add_load(seq, body)

    def advance(self) -> int:
        """Process scheduler events whose load reports have arrived; returns how many.

        Consecutive fold points are folded in one pass unless a decision between
        them must be checked (``verify`` or an observer).
        """
        done = 0
        batch: list[Cursor] = []
        cursor = self.follower.cursor
        checking = self.verify or self.observer is not None
        while self._pending:
            seq, body = self._pending[0]
            epoch = scheduler_epoch(body)
            assert epoch is not None
            if epoch < self.control_epoch:
                self.stats.stale += 1
                self._pending.popleft()
                done += 1
                continue
            point = fold_point_of(body)
            if point is not None and point != cursor:
                if self.follower.last_load_seq < point.loads_seq:
                    break  # wait for the reports this fold point folded
                if cursor.covers(point):
                    self._pending.popleft()  # made before the state we started from
                    self.control_epoch = max(self.control_epoch, epoch)
                    self.stats.unverified += 1
                    done += 1
                    continue
                if not point.covers(cursor):
                    self.stats.regressions += 1
                    point = Cursor(
                        max(point.events_seq, cursor.events_seq), max(point.loads_seq, cursor.loads_seq)
                    )
                batch.append(point)
                cursor = point
                self.stats.fold_points += 1
                self._anchored = True
            self.control_epoch = max(self.control_epoch, epoch)
            self._pending.popleft()
            done += 1
            if isinstance(body, SchedulerTick) and body.policy:
                self.adopt_policy(epoch, body.policy)
            if checking:
                self.follower.fold_through(batch)
                batch = []
                self._check(seq, body, epoch)
        self.follower.fold_through(batch)
        return done

    def adopt_policy(self, epoch: int, text: str) -> None:
        """Recompute ``epoch``'s decisions (and later ones) with the policy ``text`` records."""
        try:
            self.policy = self.policies[epoch] = decode_policy(text)
        except ValueError:
            self.stats.unknown_policies += 1  # a newer writer's format: keep the rules we have

    def view_before(self, seq: int, epoch: int) -> ClusterState:
        """The view a decision of ``epoch`` at ``seq`` was made from (state at its fold point + overlay)."""
        overlay = overlay_of(self.follower.buffered_events(), epoch=epoch, before_seq=seq)
        return apply_overlay(self.follower.state, overlay)

    def _check(self, seq: int, body: Body, epoch: int) -> None:
        if not self._anchored:
            self.stats.unverified += 1
            return
        view = self.view_before(seq, epoch)
        if self.observer is not None:
            self.observer(seq, body, view)
        if not self.verify:
            return
        if not recomputable(body):
            if not isinstance(body, SchedulerTick):
                self.stats.not_recomputable += 1
            return
        recomputed = recompute(view, body, policy=self.policy)
        if recomputed == body:
            self.stats.verified += 1
        else:
            self.mismatches.append(Mismatch(seq, body, recomputed))

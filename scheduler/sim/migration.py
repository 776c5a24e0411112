"""Live migration in the simulator: which requests move, and what the migrations added up to.

For each pair in force the source picks requests with
:func:`~scheduler.policy.select_requests_to_migrate` toward the pair's target
freeness (at most ``MigrationConfig.max_concurrent_per_instance`` migrations
per instance as source and as destination), and each request moves by the
agents' own protocol: :class:`~scheduler.sim.migration_shell.SimMigration`
runs the two state machines of :mod:`agents.migration.fsm` on the virtual
clock against the sim engines. Nothing here decides a stage, a suspend or an
abort; the machines do.

:class:`MigrationDriver` starts migrations, routes the simulator's events to
them (heap deliveries, step ends, requests that finished or were preempted,
instances that left), keeps the in-memory outcome log (first claim wins, as in
:mod:`agents.migration.log`), frees the slots, and counts: migrations started,
committed and aborted, abort reasons (the source machine's reason), downtime
(suspend to admission at the destination) and bytes copied. With
``SimConfig.record_migrations`` it keeps every finished migration, with both
machines' records, for tests.
"""

from __future__ import annotations

from collections import Counter

from agents.migration.fsm.actions import RequestGone
from scheduler.policy import Pairing, select_requests_to_migrate
from scheduler.sim.config import MigrationModel
from scheduler.sim.migration_ports import MigrationHost, MigrationInstance
from scheduler.sim.migration_shell import Delivery, Side, SimMigration
from schemas.migration import Abort, Commit, CommitAck
from schemas.reasons import MigrationAbortReason

__all__ = ["MigrationDriver"]


class MigrationDriver:
    """Starts the simulator's migrations, feeds them its events, and counts their outcomes."""

    def __init__(self, host: MigrationHost, model: MigrationModel, *, record: bool = False) -> None:
        self._host = host
        self._model = model
        self.record = record
        self.active: dict[str, SimMigration] = {}  # request id -> its migration, until the source is done
        self.live: dict[str, SimMigration] = {}  # migration id -> migrations not settled on both sides
        self.finished: list[SimMigration] = []  # settled ones, when recording
        self._outcomes: dict[str, bool] = {}  # migration id -> committed, the first claim logged
        self._epochs: dict[str, int] = {}  # request id -> owner epoch after its last migration
        self._awaiting: dict[str, list[SimMigration]] = {}  # instance id -> suspends waiting for its step
        self._paced: dict[str, list[SimMigration]] = {}  # instance id -> its paced copies out
        self.num_started = 0
        self.num_committed = 0
        self.num_aborted = 0
        self.downtime_total_s = 0.0
        self.bytes_total = 0
        self.bytes_saved = 0  # blocks of committed migrations the destination held cached, in bytes
        self.num_paced = 0  # stage copies paced
        self.num_hurried = 0  # paced copies that went on at full speed (one at most per migration)
        self.abort_reasons: Counter[MigrationAbortReason] = Counter()
        self._sent: dict[tuple[str, str, int], int] = {}  # pair -> blocks sent under it (room check)
        self._aborted_at: dict[str, float] = {}  # request id -> virtual time of its last abort
        self.moves: Counter[str] = Counter()  # request id -> committed migrations

    @property
    def host(self) -> MigrationHost:
        return self._host

    @property
    def model(self) -> MigrationModel:
        return self._model

    # ------------------------------------------------------------ starting

    def start_all(self) -> None:
        """Let every source of a pair in force start what it may."""
        for pairing in self._host.pairings():
            self.start_from(pairing)

    def start_from(self, pairing: Pairing) -> None:
        host = self._host
        source = host.instance(pairing.source_id)
        destination = host.instance(pairing.destination_id)
        if source is None or destination is None or destination.terminating:
            return
        limit = self._model.config.max_concurrent_per_instance
        slots = min(limit - source.num_migrating_out, limit - destination.num_migrating_in)
        if slots <= 0:
            self._hurry_paced(source, destination)  # the slot is wanted: a paced copy gives way
            return
        running, exclude = source.migration_candidates(self.active.keys())
        if len(exclude) >= len(running):
            return
        rules = host.policy.pairing
        if rules.retry_after_abort_s > 0 or rules.max_moves_per_request > 0:
            now = host.now
            exclude = exclude + [
                r.request_id for r in running
                if now - self._aborted_at.get(r.request_id, -1e18) < rules.retry_after_abort_s
                or 0 < rules.max_moves_per_request <= self.moves[r.request_id]
            ]
        key = (pairing.source_id, pairing.destination_id, pairing.epoch)
        room = pairing.room_blocks
        if room >= 0:
            room = max(room - self._sent.get(key, 0), 0)
        chosen = select_requests_to_migrate(
            running,
            num_total_blocks=source.num_total_blocks,
            head_of_line_demand=source.current_head_of_line_demand(),
            target_freeness=pairing.target_freeness,
            config=host.policy,
            terminating=source.terminating,
            num_reserved_blocks=source.num_reserved_blocks,
            exclude=exclude,
            max_requests=slots,
            room_blocks=room,
            margin_blocks=self._model.config.last_stage_max_blocks,
        )
        for candidate in chosen:
            if room >= 0:
                self._sent[key] = (
                    self._sent.get(key, 0) + candidate.num_blocks + self._model.config.last_stage_max_blocks
                )
            self.num_started += 1
            config = self._model.config
            if config.copy_step_share > 0:  # as the agents: paced unless the source is short of memory
                config = config.for_source(short_of_memory=source.short_of_memory())
            migration = SimMigration(
                self, f"m{self.num_started}", candidate.request_id, source, destination, config
            )
            self.active[migration.request_id] = migration
            self.live[migration.migration_id] = migration
            source.num_migrating_out += 1
            destination.num_migrating_in += 1
            migration.begin()

    # ------------------------------------------------------------ the simulator's events

    def on_delivery(self, delivery: Delivery) -> None:
        delivery.migration.deliver(delivery.side, delivery.item)

    def step_done(self, instance_id: str) -> None:
        """An instance's step ended: suspends waiting for it report now."""
        waiting = self._awaiting.pop(instance_id, None)
        for migration in waiting or ():
            migration.step_done()
        paced = self._paced.get(instance_id)
        if paced:
            paced[:] = [m for m in paced if m.recheck_pacing()]

    def request_gone(self, instance_id: str, request_id: str, reason: MigrationAbortReason) -> None:
        """A request finished or was preempted on ``instance_id``: tell its source machine."""
        migration = self.active.get(request_id)
        if migration is not None and migration.source.instance_id == instance_id:
            migration.feed(Side.SOURCE, RequestGone(reason=reason))

    def instance_left(self, instance_id: str) -> None:
        """An instance left the cluster: the peers of its migrations see ``PeerFailed``."""
        for migration in list(self.live.values()):
            if migration.source.instance_id == instance_id:
                migration.peer_left(Side.SOURCE)
            if migration.destination.instance_id == instance_id:
                migration.peer_left(Side.DESTINATION)

    # ------------------------------------------------------------ what a migration asks of its owner

    def claim(self, outcome: CommitAck | Abort) -> bool:
        committed = self._outcomes.setdefault(outcome.migration_id, isinstance(outcome, CommitAck))
        return committed

    def owner_epoch(self, request_id: str) -> int:
        return self._epochs.get(request_id, 0)

    def admitted(self, migration: SimMigration, commit: Commit) -> None:
        self._epochs[commit.request_id] = commit.owner_epoch + 1
        self.moves[commit.request_id] += 1
        self._host.count_migration(commit.request_id)

    def await_step_end(self, migration: SimMigration) -> None:
        self._awaiting.setdefault(migration.source.instance_id, []).append(migration)

    def _hurry_paced(self, source: MigrationInstance, destination: MigrationInstance) -> None:
        """Another migration wants a slot of ``source`` or ``destination``: the paced copies out of
        the one and into the other go at full speed from now on (as an agent's do when it refuses
        a migration for want of a slot)."""
        for migration in self._paced.get(source.instance_id, ()):
            migration.hurry()
        for paced in self._paced.values():
            for migration in paced:
                if migration.destination is destination:
                    migration.hurry()

    def pacing(self, migration: SimMigration) -> None:
        self.num_paced += 1
        paced = self._paced.setdefault(migration.source.instance_id, [])
        if migration not in paced:
            paced.append(migration)

    def source_finished(self, migration: SimMigration) -> None:
        """The source machine ended: count it, free its slot, and let the source go on."""
        if migration.source_done:
            return
        migration.source_done = True
        if migration.migrated:
            self.num_committed += 1
            self.bytes_saved += migration.num_cached_blocks * migration.source.bytes_per_block
            downtime = migration.downtime_s
            self.downtime_total_s += 0.0 if downtime is None else downtime
        else:
            self.num_aborted += 1
            self.abort_reasons[migration.reason or MigrationAbortReason.CANCELLED] += 1
            self._aborted_at[migration.request_id] = self._host.now
        self.bytes_total += migration.num_bytes
        if self.active.get(migration.request_id) is migration:
            del self.active[migration.request_id]
        source = migration.source
        source.num_migrating_out -= 1
        source.dirty = True
        host = self._host
        host.wake(source.instance_id)
        if migration.destination_settled:
            self.destination_finished(migration)
        host.leave_if_drained(source.instance_id)
        self._settle(migration)
        if migration.migrated and host.instance(source.instance_id) is not None:
            pairing = next((p for p in host.pairings() if p.source_id == source.instance_id), None)
            if pairing is not None:
                self.start_from(pairing)

    def destination_finished(self, migration: SimMigration) -> None:
        """The destination holds nothing more for the migration: free its slot."""
        if migration.destination_done:
            return
        migration.destination_done = True
        destination = migration.destination
        destination.num_migrating_in -= 1
        destination.dirty = True
        self._host.wake(destination.instance_id)
        self._host.leave_if_drained(destination.instance_id)
        self._settle(migration)

    def _settle(self, migration: SimMigration) -> None:
        if not (migration.source_done and migration.destination_done):
            return
        if self.live.pop(migration.migration_id, None) is not None:
            self._outcomes.pop(migration.migration_id, None)
            self.num_hurried += migration.hurried
            if self.record:
                self.finished.append(migration)

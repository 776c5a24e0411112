"""Live migration in the simulator: stages, copy times, downtime, through the engines' own calls.

For each pair in force the source picks requests with
:func:`~scheduler.policy.select_requests_to_migrate` toward the pair's target
freeness (at most ``MigrationConfig.max_concurrent_per_instance`` migrations
per instance as source and as destination), and each request moves in stages:

1. **stage 0** reserves the request's full blocks on the destination
   (``reserve``), exports them (``export_blocks``) and copies them in
   ``handshake + bytes / bandwidth`` while the request keeps decoding;
2. **stage k** copies the full blocks produced meanwhile;
3. once a stage leaves at most ``last_stage_max_blocks`` new blocks (or after
   ``max_stages``), the request is **suspended** at its source's next step
   boundary, the rest of its blocks (the partial last one included) is
   reserved and copied, and after ``copy + commit latency`` (the downtime)
   the destination admits it (``import_blocks`` + ``admit_migrated``) and the
   source releases it (``release_request``).

A stage that finds the request finished, preempted (its preemption count
moved) or gone, a destination out of blocks, or a destination that started
terminating aborts the migration: the destination's reservations are released
and a suspended request resumes on its source. The sim engine checks that
every block holding computed KV arrived (its fingerprints), so an accounting
slip here fails loudly.
"""

from __future__ import annotations

from typing import Protocol

from agents.engines.block_manager import OutOfBlocks, Reservation
from agents.engines.local_scheduler import Request
from agents.engines.protocol import KVBuffer, RequestStatus
from scheduler.policy import Pairing, select_requests_to_migrate
from scheduler.sim.config import SimConfig
from scheduler.sim.event_kinds import EventKind
from scheduler.sim.instance import SimInstance
from scheduler.sim.metrics import RequestRecord
from scheduler.sim.policy_layer import PolicyLayer
from schemas.reasons import MigrationAbortReason

__all__ = ["Migration", "MigrationDriver", "MigrationHost"]


class MigrationHost(Protocol):
    """What the driver needs from the simulator."""

    now: float
    config: SimConfig
    instances: dict[str, SimInstance]
    records: dict[str, RequestRecord]
    layer: PolicyLayer

    def push(self, at: float, kind: int, payload: object = None) -> None: ...

    def kick(self, instance: SimInstance) -> None: ...

    def leave_if_drained(self, instance: SimInstance) -> None: ...


class Migration:
    """One request on its way from ``source`` to ``destination``."""

    __slots__ = (
        "buffer",
        "destination",
        "finished",
        "migration_id",
        "num_copied",
        "num_in_flight",
        "num_preemptions",
        "request_id",
        "reservations",
        "source",
        "stage",
        "started_s",
        "suspended_s",
    )

    def __init__(
        self, migration_id: str, request: Request, source: SimInstance, destination: SimInstance, now: float
    ) -> None:
        self.migration_id = migration_id
        self.request_id = request.request_id
        self.source = source
        self.destination = destination
        self.num_preemptions = request.num_preemptions
        self.stage = 0
        self.num_copied = 0
        self.num_in_flight = 0
        self.reservations: list[Reservation] = []
        self.buffer: KVBuffer | None = None
        self.started_s = now
        self.suspended_s = -1.0
        self.finished = False


class MigrationDriver:
    """Starts, advances, commits and aborts the simulator's migrations."""

    def __init__(self, host: MigrationHost) -> None:
        self.host = host
        self.model = host.config.migration
        self.active: dict[str, Migration] = {}  # request id -> its migration
        self.num_started = 0
        self.num_committed = 0
        self.num_aborted = 0
        self.downtime_total_s = 0.0
        self.abort_reasons: dict[MigrationAbortReason, int] = {}

    # ------------------------------------------------------------ starting

    def start_all(self) -> None:
        """Let every source of a pair in force start what it may."""
        pairings = self.host.layer.state.pairings
        for pairing in sorted(pairings.values(), key=lambda p: p.source_id):
            self.start_from(pairing)

    def start_from(self, pairing: Pairing) -> None:
        host = self.host
        source = host.instances.get(pairing.source_id)
        destination = host.instances.get(pairing.destination_id)
        if source is None or destination is None or destination.terminating:
            return
        limit = self.model.config.max_concurrent_per_instance
        slots = min(limit - source.num_migrating_out, limit - destination.num_migrating_in)
        if slots <= 0:
            return
        running, exclude = source.migration_candidates(self.active.keys())
        if len(exclude) >= len(running):
            return
        chosen = select_requests_to_migrate(
            running,
            num_total_blocks=source.num_total_blocks,
            head_of_line_demand=source.head_of_line_demand(source.snapshot()),
            target_freeness=pairing.target_freeness,
            config=host.layer.config,
            terminating=source.terminating,
            num_reserved_blocks=source.num_reserved_blocks,
            exclude=exclude,
            max_requests=slots,
        )
        for candidate in chosen:
            request = source.engine.scheduler.request(candidate.request_id)
            self.num_started += 1
            migration = Migration(f"m{self.num_started}", request, source, destination, host.now)
            self.active[request.request_id] = migration
            source.num_migrating_out += 1
            destination.num_migrating_in += 1
            source.dirty = destination.dirty = True
            self._begin_stage(migration, request)

    # ------------------------------------------------------------ stages

    def _live_request(self, migration: Migration) -> Request | None:
        """The request if the migration may go on, else None (after aborting it)."""
        request = migration.source.engine.scheduler.get(migration.request_id)
        reason = None
        if request is None or request.status.is_finished:
            reason = MigrationAbortReason.REQUEST_FINISHED
        elif request.num_preemptions != migration.num_preemptions or not request.status.holds_blocks:
            reason = MigrationAbortReason.REQUEST_PREEMPTED
        elif (
            migration.destination.terminating
            or migration.destination.instance_id not in self.host.instances
        ):
            reason = MigrationAbortReason.DESTINATION_TERMINATING
        if reason is not None:
            self._abort(migration, reason)
            return None
        return request

    def _reserve(self, migration: Migration, num_blocks: int) -> bool:
        try:
            migration.reservations.append(migration.destination.engine.reserve(num_blocks))
        except OutOfBlocks:
            self._abort(migration, MigrationAbortReason.OUT_OF_BLOCKS)
            return False
        migration.destination.dirty = True
        return True

    def _export(self, migration: Migration, num_blocks: int) -> None:
        first = migration.num_copied
        migration.buffer = migration.source.engine.export_blocks(
            migration.request_id, range(first, first + num_blocks)
        )
        migration.num_in_flight = num_blocks

    def _copy_s(self, migration: Migration, num_blocks: int) -> float:
        return self.model.copy_s(num_blocks, migration.source.bytes_per_block)

    def _begin_stage(self, migration: Migration, request: Request) -> None:
        num_new = request.num_computed_tokens // migration.source.block_size - migration.num_copied
        if num_new <= 0 or (migration.stage > 0 and num_new <= self.model.config.last_stage_max_blocks):
            self._ask_suspend(migration)
            return
        if not self._reserve(migration, num_new):
            return
        self._export(migration, num_new)
        at = self.host.now + self.model.handshake_latency_s + self._copy_s(migration, num_new)
        self.host.push(at, EventKind.STAGE_END, migration)

    def _land_copy(self, migration: Migration) -> None:
        """The copy in flight arrives: write it into the last reservation."""
        if migration.num_in_flight and migration.buffer is not None:
            reservation = migration.reservations[-1]
            migration.destination.engine.import_blocks(reservation.block_ids, migration.buffer)
            migration.num_copied += migration.num_in_flight
        migration.num_in_flight = 0
        migration.buffer = None

    def on_stage_end(self, migration: Migration) -> None:
        if migration.finished:
            return
        request = self._live_request(migration)
        if request is None:
            return
        self._land_copy(migration)
        migration.stage += 1
        num_new = request.num_computed_tokens // migration.source.block_size - migration.num_copied
        config = self.model.config
        if num_new <= config.last_stage_max_blocks or migration.stage >= config.max_stages - 1:
            self._ask_suspend(migration)
        else:
            self._begin_stage(migration, request)

    def _ask_suspend(self, migration: Migration) -> None:
        """Suspend at the source's next step boundary (now, if it is idle)."""
        source = migration.source
        if source.plan is not None:
            source.pending_suspends.append(migration)
        else:
            self._last_stage(migration)

    def on_step_boundary(self, instance: SimInstance) -> None:
        waiting = instance.pending_suspends
        instance.pending_suspends = []
        for migration in waiting:
            if not migration.finished:
                self._last_stage(migration)

    def _last_stage(self, migration: Migration) -> None:
        request = self._live_request(migration)
        if request is None:
            return
        source = migration.source
        source.engine.suspend(migration.request_id)
        source.dirty = True
        migration.suspended_s = self.host.now
        total = -(-request.num_computed_tokens // source.block_size)
        remaining = total - migration.num_copied
        copy_s = 0.0
        if remaining > 0:
            if not self._reserve(migration, remaining):
                return
            self._export(migration, remaining)
            copy_s = self._copy_s(migration, remaining)
        self.host.push(self.host.now + copy_s + self.model.commit_latency_s, EventKind.COMMIT, migration)

    # ------------------------------------------------------------ outcome

    def on_commit(self, migration: Migration) -> None:
        if migration.finished:
            return
        host = self.host
        source, destination = migration.source, migration.destination
        request = source.engine.scheduler.get(migration.request_id)
        if request is None or request.status is not RequestStatus.SUSPENDED:
            self._abort(migration, MigrationAbortReason.REQUEST_FINISHED if request is None
                        else MigrationAbortReason.REQUEST_PREEMPTED)
            return
        if destination.instance_id not in host.instances:
            self._abort(migration, MigrationAbortReason.PEER_FAILED)
            return
        self._land_copy(migration)
        destination.engine.admit_migrated(
            request.request_id,
            request.prompt_token_ids,
            request.output_token_ids,
            request.sampling,
            request.priority,
            migration.reservations,
        )
        source.engine.release_request(request.request_id)
        del source.request_ids[request.request_id]
        destination.request_ids[request.request_id] = None
        host.records[request.request_id].num_migrations += 1
        self.num_committed += 1
        self.downtime_total_s += host.now - migration.suspended_s
        self._finish(migration, committed=True)

    def _abort(self, migration: Migration, reason: MigrationAbortReason) -> None:
        self.abort_reasons[reason] = self.abort_reasons.get(reason, 0) + 1
        self.num_aborted += 1
        destination = migration.destination
        for reservation in migration.reservations:
            destination.engine.release_reservation(reservation)
        migration.reservations = []
        request = migration.source.engine.scheduler.get(migration.request_id)
        if request is not None and request.status is RequestStatus.SUSPENDED:
            migration.source.engine.resume(migration.request_id)
        if migration in migration.source.pending_suspends:
            migration.source.pending_suspends.remove(migration)
        self._finish(migration, committed=False)

    def _finish(self, migration: Migration, *, committed: bool) -> None:
        """Free the migration's slots; after a commit the source goes on toward its target."""
        migration.finished = True
        self.active.pop(migration.request_id, None)
        source, destination = migration.source, migration.destination
        source.num_migrating_out -= 1
        destination.num_migrating_in -= 1
        source.dirty = destination.dirty = True
        host = self.host
        for instance in (destination, source):
            if instance.instance_id in host.instances:
                host.kick(instance)
        host.leave_if_drained(source)
        host.leave_if_drained(destination)
        pairing = host.layer.state.pairings.get(source.instance_id)
        if committed and pairing is not None and source.instance_id in host.instances:
            self.start_from(pairing)

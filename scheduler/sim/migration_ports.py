"""The narrow protocols the simulator's migration code depends on, instead of concrete classes.

* :class:`MigrationEngine` — the engine calls a migration makes (the sim
  engine's part of :class:`agents.engines.protocol.Engine`);
* :class:`MigrationInstance` — what migration uses of one simulated instance:
  its engine, block geometry, whether a step is in flight, the slots it counts,
  and the requests that live on it;
* :class:`MigrationHost` — what migration uses of the simulator: the virtual
  clock and its event heap, instances by id, waking an instance, a draining
  instance leaving, the pairs in force and the per-request records.

:class:`~scheduler.sim.instance.SimInstance` and
:class:`~scheduler.sim.simulator.Simulator` implement them; nothing here
imports either, so :mod:`scheduler.sim.migration` and
:mod:`scheduler.sim.migration_shell` need neither.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

from agents.engines.block_manager import Reservation
from agents.engines.protocol import KVBuffer, RequestStats
from scheduler.config import PolicyConfig
from scheduler.policy import Pairing, RunningRequest
from schemas import SamplingParams

__all__ = ["Continuation", "MigrationEngine", "MigrationHost", "MigrationInstance"]


class Continuation(NamedTuple):
    """How to continue a request elsewhere (what a ``Commit`` carries)."""

    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int


class MigrationEngine(Protocol):
    """The engine calls of live migration (see :class:`agents.engines.protocol.Engine`)."""

    def request_stats(self, request_id: str) -> RequestStats | None: ...

    def export_blocks(self, request_id: str, block_indices: Sequence[int]) -> KVBuffer: ...

    def reserve(self, num_blocks: int) -> Reservation: ...

    def import_blocks(self, block_ids: Sequence[int], buffer: KVBuffer) -> None: ...

    def admit_migrated(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int,
        reservations: Sequence[Reservation],
        *,
        num_computed_tokens: int | None = None,
        cached_block_ids: Sequence[int] = (),
    ) -> None: ...

    def hold_cached_blocks(self, block_hashes: Sequence[int]) -> tuple[int, ...]: ...

    def drop_held_blocks(self, block_ids: Sequence[int]) -> None: ...

    def release_request(self, request_id: str) -> int: ...

    def release_reservation(self, reservation: Reservation) -> int: ...

    def suspend(self, request_id: str) -> None: ...

    def resume(self, request_id: str) -> None: ...


class MigrationInstance(Protocol):
    """One simulated instance as migration sees it. Counters are mutated by migration only."""

    num_migrating_out: int
    num_migrating_in: int
    dirty: bool

    @property
    def instance_id(self) -> str: ...

    @property
    def engine(self) -> MigrationEngine: ...

    @property
    def block_size(self) -> int: ...

    @property
    def bytes_per_block(self) -> int: ...

    @property
    def terminating(self) -> bool: ...

    @property
    def busy(self) -> bool:
        """A step is in flight (a suspend reports once it ends)."""
        ...

    @property
    def num_total_blocks(self) -> int: ...

    @property
    def num_reserved_blocks(self) -> int: ...

    def current_head_of_line_demand(self) -> int:
        """Blocks the head of this instance's queue needs now (0 if nothing waits)."""
        ...

    def short_of_memory(self) -> bool:
        """:func:`agents.migration.fsm.config.short_of_memory` of this instance now."""
        ...

    def migration_candidates(self, migrating: Collection[str]) -> tuple[list[RunningRequest], list[str]]:
        """Running requests as request selection sees them, and those that may not move now."""
        ...

    def continuation(self, request_id: str) -> Continuation | None:
        """How to continue ``request_id`` elsewhere; None if it is not here."""
        ...

    def chain(self, request_id: str, num_full_blocks: int) -> tuple[int, ...]:
        """The block hashes of the request's first ``num_full_blocks`` blocks (what the source offers)."""
        ...

    def adopt(self, request_id: str) -> None:
        """``request_id`` now lives here (it migrated in)."""
        ...

    def forget(self, request_id: str) -> None:
        """``request_id`` left (it migrated out)."""
        ...


class MigrationHost(Protocol):
    """The simulator as migration sees it."""

    @property
    def now(self) -> float:
        """Virtual time, seconds."""
        ...

    @property
    def policy(self) -> PolicyConfig: ...

    def push(self, at: float, kind: int, payload: object = None) -> None:
        """Schedule an event on the virtual clock."""
        ...

    def instance(self, instance_id: str) -> MigrationInstance | None:
        """The live instance with this id, or None once it left."""
        ...

    def pairings(self) -> Sequence[Pairing]:
        """The pairs in force, in source-id order."""
        ...

    def wake(self, instance_id: str) -> None:
        """Start the instance's next step if it is idle and has work."""
        ...

    def leave_if_drained(self, instance_id: str) -> None:
        """A terminating instance with nothing left on it leaves the cluster."""
        ...

    def count_migration(self, request_id: str) -> None:
        """``request_id`` moved once more (its per-request record)."""
        ...

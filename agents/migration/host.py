"""The narrow protocols the migration shells depend on, instead of concrete classes.

* :class:`MigrationHost` — what the manager and the drivers use of their agent:
  its identity, engine, bus, transport, configuration, task spawning, and the
  few request-bookkeeping calls a migration makes (the record of a request it
  sends, forgetting a request that left, adopting one that arrived).
  :class:`agents.service.Agent` implements it; a test can pass anything that does.
* :class:`DriverContext` — what a driver of one machine
  (:mod:`agents.migration.source`, :mod:`agents.migration.destination`) uses of
  the :class:`~agents.migration.manager.MigrationManager` that owns it.
* :class:`CachedBlockHolder` — what a destination uses of an engine whose prefix cache
  spares a migration the copy of blocks it already holds (shoal's own engines); with any
  other engine every block is copied.

Only type-level imports of lower layers here; nothing imports the manager or
the agent, so neither a driver nor the manager needs the class that hosts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol, runtime_checkable

from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer

from agents.config import AgentConfig
from agents.deltas import RequestTokens
from agents.engines.block_manager import Reservation
from agents.engines.protocol import Engine
from agents.migration.fsm.config import MigrationConfig
from agents.migration.log import MigrationLog
from agents.migration.pacing import StepClock
from bus import Bus
from schemas import Codec, Subjects
from schemas.load import LoadReport
from schemas.migration import Commit, MigrationMessage
from schemas.rpc import SamplingParams
from transport import KVTransport

__all__ = ["CachedBlockHolder", "DriverContext", "MigrationHost"]


@runtime_checkable
class CachedBlockHolder(Protocol):
    """An engine that lends an incoming migration the blocks its prefix cache already holds."""

    def hold_cached_blocks(self, block_hashes: Sequence[int]) -> tuple[int, ...]:
        """One reference to each cached block of the longest leading run of ``block_hashes``
        (a chain, :mod:`schemas.block_hash`); held until :meth:`drop_held_blocks` or an admission
        takes them over. ``()`` when nothing (or no cache) matches."""
        ...

    def drop_held_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop the references :meth:`hold_cached_blocks` took (the migration was given up)."""
        ...

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
    ) -> None:
        """:meth:`Engine.admit_migrated`, the block table starting with the held ``cached_block_ids``
        (their references become the request's), then the reservations' blocks."""
        ...


class MigrationHost(Protocol):
    """What migration needs of the agent it runs in."""

    @property
    def instance_id(self) -> str: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def bus(self) -> Bus: ...

    @property
    def codec(self) -> Codec: ...

    @property
    def subjects(self) -> Subjects: ...

    @property
    def config(self) -> AgentConfig: ...

    @property
    def transport(self) -> KVTransport: ...

    @property
    def terminating(self) -> bool:
        """The instance is draining: it takes no migration in and moves every request out."""
        ...

    @property
    def is_stepping(self) -> bool:
        """An engine step is in flight (a suspend then takes effect after it)."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as one of the agent's tasks (cancelled when the agent stops)."""
        ...

    def wake(self) -> None:
        """Tell the step loop there is work (a request resumed, arrived or left)."""
        ...

    def load_report(self) -> LoadReport:
        """The instance's load now (its freeness is logged when a migration starts)."""
        ...

    def request_record(self, request_id: str) -> RequestTokens | None:
        """How to continue ``request_id`` elsewhere (prompt, sampling, priority, owner epoch, tokens)."""
        ...

    def forget_request(self, request_id: str) -> None:
        """``request_id`` moved away: stop publishing for it."""
        ...

    def adopt_migrated(
        self, commit: Commit, *, trace_context: Context | None = None, queued: bool = False
    ) -> None:
        """``commit``'s request now runs here: publish its tokens with the next owner epoch.

        ``queued``: it moved without KV and waits in this engine's queue.

        ``trace_context`` (the destination's migration span) parents the request's span here.
        """
        ...

    def trace_context(self, request_id: str) -> Context | None:
        """The trace context of ``request_id``'s span here (a migration's parent), None if untraced."""
        ...

    async def publish_failure(self, commit: Commit, detail: str) -> None:
        """A request the log gave to this agent could not be admitted: end its stream with an error."""
        ...


class DriverContext(Protocol):
    """What a machine's driver uses of the manager that owns it."""

    @property
    def agent(self) -> MigrationHost: ...

    @property
    def config(self) -> MigrationConfig: ...

    @property
    def tracer(self) -> Tracer: ...

    @property
    def log(self) -> MigrationLog: ...

    @property
    def num_incoming(self) -> int: ...

    @property
    def step_clock(self) -> StepClock:
        """The engine's steps, which paced stage copies follow."""
        ...

    async def send(self, peer_id: str, message: MigrationMessage, span: Span | None) -> None:
        """Send a handshake message to ``peer_id`` and append it to the migration's log."""
        ...

    def short_of_memory(self) -> bool:
        """:func:`agents.migration.fsm.config.short_of_memory` of this agent now."""
        ...

    def slot_wanted(self, *, incoming: bool) -> None:
        """Another migration waits for a slot (into this agent, or out of it): the paced
        migrations holding those slots hurry."""
        ...

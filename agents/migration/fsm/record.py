"""What a shell saw its migration machine do: how the machine started and every transition since.

Both shells that drive the machines of :mod:`agents.migration.fsm` keep one
:class:`MachineRecord` per machine: the agents'
:class:`~agents.migration.driver.MachineDriver` and the simulator's
:mod:`scheduler.sim.migration_shell`. :func:`replay` feeds a record's inputs,
at their recorded times, to a fresh machine and returns the transitions it
makes; a shell that drives the shared machines gets back exactly what it
recorded, so a test can prove both run the one protocol.

A transition is kept only if the input changed the state or asked for an
action: a ``Tick`` before the deadline, a message for a finished machine or
any other ignored input leaves nothing to replay. Plain data; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agents.migration.fsm import Input, step
from agents.migration.fsm.actions import Action
from agents.migration.fsm.config import MigrationConfig
from agents.migration.fsm.destination import DestinationState, start_destination
from agents.migration.fsm.source import SourceState, start_source
from schemas.migration import MigrationMessage

__all__ = ["DestinationStart", "MachineRecord", "SourceStart", "Transition", "replay"]


@dataclass(frozen=True, slots=True)
class SourceStart:
    """The arguments a source machine was started with (:func:`~agents.migration.fsm.source.start_source`)."""

    migration_id: str
    request_id: str
    source_id: str
    destination_id: str
    num_full_blocks: int
    at: float
    #: the chain hashes offered for deduplication (empty: none)
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class DestinationStart:
    """The first message of a migration and the agent it reached (:func:`start_destination`)."""

    message: MigrationMessage
    destination_id: str
    at: float


@dataclass(frozen=True, slots=True)
class Transition:
    """One step of a machine: the input (None for the start), the phases around it, the actions."""

    at: float
    input: Input | None
    before: str
    after: str
    actions: tuple[Action, ...]

    @property
    def signature(self) -> tuple[str, str, str, tuple[str, ...]]:
        """``(input type, phase before, phase after, action types)``, for comparing runs."""
        kind = "start" if self.input is None else type(self.input).__name__
        return kind, self.before, self.after, tuple(type(a).__name__ for a in self.actions)


@dataclass(slots=True)
class MachineRecord:
    """One machine's start, the configuration it ran with, and its transitions in order."""

    start: SourceStart | DestinationStart
    config: MigrationConfig
    transitions: list[Transition] = field(default_factory=list)

    def started(self, state: SourceState | DestinationState, actions: tuple[Action, ...]) -> None:
        self.transitions.append(Transition(self.start.at, None, "", str(state.phase), actions))

    def stepped(
        self,
        at: float,
        event: Input,
        before: SourceState | DestinationState,
        after: SourceState | DestinationState,
        actions: tuple[Action, ...],
    ) -> None:
        """Keep the transition unless the machine ignored the input."""
        if after is before and not actions:
            return
        self.transitions.append(Transition(at, event, str(before.phase), str(after.phase), actions))

    @property
    def phases(self) -> list[str]:
        """The phases the machine passed through, the first one included."""
        return [t.after for t in self.transitions if t.after != t.before]


def _start(record: MachineRecord) -> tuple[SourceState | DestinationState, tuple[Action, ...]]:
    start, config = record.start, record.config
    if isinstance(start, SourceStart):
        return start_source(
            migration_id=start.migration_id, request_id=start.request_id, source_id=start.source_id,
            destination_id=start.destination_id, num_full_blocks=start.num_full_blocks, now=start.at,
            config=config, block_hashes=start.block_hashes,
        )
    return start_destination(start.message, destination_id=start.destination_id, now=start.at, config=config)


def replay(record: MachineRecord) -> list[Transition]:
    """Start a fresh machine as ``record`` says and feed it the recorded inputs; its transitions."""
    state, actions = _start(record)
    fresh = MachineRecord(record.start, record.config)
    fresh.started(state, actions)
    for transition in record.transitions:
        if transition.input is None:
            continue
        before = state
        state, actions = step(state, transition.input, now=transition.at, config=record.config)
        fresh.stepped(transition.at, transition.input, before, state, actions)
    return fresh.transitions

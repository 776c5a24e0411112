"""The live-migration protocol: two state machines, one per side, sharing the messages.

The source and destination exchange the wire messages of
:mod:`schemas.migration` (``PreAllocate``, ``Ack``, ``Abort``, ``StageDone``,
``Commit``, ``CommitAck``); each side also takes local events from its shell
(clock ticks, the engine, the transport, the block manager, failure detection,
the event log). Each machine is an enum of phases, a transition table and a
pure :func:`step` returning ``(state, actions)``; actions are plain data a
shell executes (see :mod:`agents.migration.fsm.actions`). Rollback lives in
one function per side. Two shells drive these machines and nothing else
implements the protocol: the agents' (:mod:`agents.migration.driver`) and the
simulator's (:mod:`scheduler.sim.migration_shell`); both keep a
:class:`~agents.migration.fsm.record.MachineRecord` that
:func:`~agents.migration.fsm.record.replay` re-feeds to prove it.

Modules: ``actions`` (local inputs and actions), ``source``, ``destination``
(the two machines: ``start_source`` / ``start_destination`` and their steps),
``config`` (:class:`~agents.migration.fsm.config.MigrationConfig`), ``record``.

Ownership rule: the source frees its blocks only after a ``CommitAck``; a
destination sends one only after the log accepted its committed event as the
migration's first outcome. If the ack is lost, the source claims "aborted" in
the log after ``commit_timeout_s``; whichever outcome the log holds first
decides who owns the request, so exactly one side runs it.

Usage by a shell::

    state, actions = start_source(migration_id=..., request_id=..., source_id=..., destination_id=...,
                                  num_full_blocks=..., now=clock(), config=config)
    execute(actions)
    ...
    state, actions = step(state, message_or_event, now=clock(), config=config)
"""

from __future__ import annotations

from typing import overload

from agents.migration.fsm.actions import Action, LocalEvent
from agents.migration.fsm.config import MigrationConfig
from agents.migration.fsm.destination import DestinationState, destination_step
from agents.migration.fsm.source import SourceState, source_step
from schemas.migration import MigrationMessage

__all__ = ["Input", "is_final", "step"]

#: Everything a machine takes: a wire message from its peer or a local event from its shell.
Input = MigrationMessage | LocalEvent


@overload
def step(
    state: SourceState, event: MigrationMessage | LocalEvent, *, now: float, config: MigrationConfig
) -> tuple[SourceState, tuple[Action, ...]]: ...


@overload
def step(
    state: DestinationState, event: MigrationMessage | LocalEvent, *, now: float, config: MigrationConfig
) -> tuple[DestinationState, tuple[Action, ...]]: ...


def step(
    state: SourceState | DestinationState,
    event: MigrationMessage | LocalEvent,
    *,
    now: float,
    config: MigrationConfig,
) -> tuple[SourceState | DestinationState, tuple[Action, ...]]:
    """Advance either machine by one message or local event."""
    if isinstance(state, SourceState):
        return source_step(state, event, now=now, config=config)
    return destination_step(state, event, now=now, config=config)


def is_final(state: SourceState | DestinationState) -> bool:
    """Whether the machine has finished (nothing it holds remains to undo)."""
    return state.phase.is_final

"""Running one migration state machine: a queue of inputs, actions executed in order.

:class:`MachineDriver` owns the pure state of one side of one migration
(:mod:`agents.migration.fsm`) and feeds it inputs one at a time from a
queue. Each input's actions are executed in order by the subclass
(:mod:`agents.migration.source`, :mod:`agents.migration.destination`); an action that
is answered synchronously (``Reserve``, ``WriteBlocks``) returns its answer,
which is applied before the next queued input, as the protocol requires.
Time is the wall clock (``time.time()``), so ``Commit.suspended_at`` and
``CommitAck.resumed_at`` of two agents on one host compare directly. Every
transition goes into the driver's :class:`~agents.migration.fsm.record.MachineRecord`
(for tests and logs: :func:`agents.migration.fsm.record.replay` re-feeds it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from agents.migration.fsm import Input, is_final, step
from agents.migration.fsm.actions import Action, ReportFailed
from agents.migration.fsm.config import MigrationConfig
from agents.migration.fsm.destination import DestinationState
from agents.migration.fsm.record import DestinationStart, MachineRecord, SourceStart
from agents.migration.fsm.source import SourceState
from agents.migration.host import DriverContext
from schemas.migration import Abort
from schemas.reasons import MigrationAbortReason

__all__ = ["Input", "MachineDriver"]

log = logging.getLogger(__name__)


class MachineDriver:
    """Feeds one machine; subclasses implement :meth:`execute`."""

    def __init__(
        self,
        manager: DriverContext,
        state: SourceState | DestinationState,
        start: SourceStart | DestinationStart,
        config: MigrationConfig | None = None,
    ) -> None:
        self.manager = manager
        self.config = manager.config if config is None else config
        self.agent = manager.agent
        self.state: SourceState | DestinationState = state
        self.queue: asyncio.Queue[Input] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.helpers: set[asyncio.Task[Any]] = set()
        self.record = MachineRecord(start, self.config)

    @property
    def migration_id(self) -> str:
        return self.state.migration_id

    def _log_abandoned(self, action: ReportFailed) -> None:
        """A peer that failed cannot record the outcome, and nothing was sent to it: log our Abort.
        The same for a queued request that started running before its move reached the peer.

        Every migration then has an outcome in the log (drills check it), even when its peer died.
        """
        if action.reason in (MigrationAbortReason.PEER_FAILED, MigrationAbortReason.REQUEST_STARTED):
            self.manager.log.record(Abort(
                migration_id=self.migration_id, reason=action.reason,
                sender_id=self.manager.agent.instance_id, detail=action.detail or "peer failed",
            ))

    @property
    def is_final(self) -> bool:
        return is_final(self.state)

    @property
    def history(self) -> list[str]:
        """The phases passed through, the first one included."""
        return self.record.phases

    def start(self, actions: tuple[Action, ...]) -> None:
        self.record.started(self.state, actions)
        self.task = self.agent.spawn(self._run(actions))

    def feed(self, event: Input) -> None:
        """Queue an input; after the machine finished, late messages are still answered."""
        if self.task is not None and not self.task.done():
            self.queue.put_nowait(event)
        elif self.is_final:
            self.agent.spawn(self.apply(event))

    def helper(self, coro: Any) -> asyncio.Task[Any]:
        """A task working for this machine (a copy, a claim, a transfer waiter)."""
        task = self.agent.spawn(coro)
        self.helpers.add(task)
        task.add_done_callback(self.helpers.discard)
        return task

    async def _run(self, actions: tuple[Action, ...]) -> None:
        try:
            await self.execute_all(actions)
            while not self.is_final:
                event = await self.queue.get()
                await self.before_input(event)
                await self.apply(event)
        finally:
            self.finished()

    async def before_input(self, event: Input) -> None:
        """Hook run before each queued input (the destination flushes landed transfers here)."""

    async def apply(self, event: Input) -> None:
        before = self.state
        now = time.time()
        state, actions = step(before, event, now=now, config=self.config)
        self.state = state
        self.record.stepped(now, event, before, state, actions)
        if state.phase != before.phase:
            log.debug(
                "%s %s: %s -> %s on %s",
                self.agent.instance_id,
                self.migration_id,
                before.phase,
                state.phase,
                type(event).__name__,
            )
        await self.execute_all(actions)

    async def execute_all(self, actions: tuple[Action, ...]) -> None:
        answers: list[Input] = []
        for action in actions:
            answer = await self.execute(action)
            if answer is not None:
                answers.append(answer)
        for answer in answers:
            await self.apply(answer)

    async def execute(self, action: Action) -> Input | None:
        raise NotImplementedError

    def finished(self) -> None:
        """The machine reached a final phase (or its task ended)."""

    def abandon(self) -> None:
        """Stop everything at once, undoing nothing (the agent is being killed)."""
        for task in list(self.helpers):
            task.cancel()
        if self.task is not None:
            self.task.cancel()

"""What an agent knows of its peers: their ``InstanceJoined`` and whether they failed or left.

:class:`PeerDirectory` folds the instance lifecycle events (``<prefix>.ev.instance.*``)
that a shell feeds it; :meth:`PeerDirectory.wait_for` lets a migration source
wait briefly for a destination it has not heard of yet. Failures and leaves
are passed on to a callback, which turns them into ``PeerFailed`` inputs of the
migration machines. No I/O here beyond waiting on an event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bus.event_loop import wait_event
from schemas import InstanceFailed, InstanceJoined, InstanceLeft

__all__ = ["PeerDirectory"]


class PeerDirectory:
    """Joined instances by id, and the ids that failed or left since they joined."""

    def __init__(self, on_gone: Callable[[str], None]) -> None:
        self._joined: dict[str, InstanceJoined] = {}
        self._gone: set[str] = set()
        self._on_gone = on_gone
        self._changed = asyncio.Event()

    def apply(self, event: object) -> None:
        if isinstance(event, InstanceJoined):
            self._joined[event.instance_id] = event
            self._gone.discard(event.instance_id)
        elif isinstance(event, InstanceFailed | InstanceLeft):
            self._gone.add(event.instance_id)
            self._on_gone(event.instance_id)
        else:
            return
        self._changed.set()
        self._changed = asyncio.Event()

    def get(self, instance_id: str) -> InstanceJoined | None:
        if instance_id in self._gone:
            return None
        return self._joined.get(instance_id)

    def is_gone(self, instance_id: str) -> bool:
        return instance_id in self._gone

    async def wait_for(self, instance_id: str, timeout: float) -> InstanceJoined | None:
        """The peer's announcement, waiting up to ``timeout`` seconds for it; None if absent or gone."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (joined := self.get(instance_id)) is None and not self.is_gone(instance_id):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            if not await wait_event(self._changed, remaining):
                return None
        return joined

"""What a prefix cache gained and lost since it was last asked: a net delta of block hashes.

Both shoal's block manager and the vLLM engine's view of vLLM's cache record each hash stored
or removed here; :meth:`DeltaRecorder.take` returns the net change since the previous take
(a hash stored then removed in between, or removed then stored again, is in neither list),
which is what the agent publishes as a cache-event batch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheDelta", "DeltaRecorder"]


@dataclass(frozen=True, slots=True)
class CacheDelta:
    """What a prefix cache gained (``stored``) and lost (``removed``) since the last delta, as
    block hashes; a hash is in at most one of them. ``cleared``: everything cached before was
    dropped at once (the lists then say what is cached after)."""

    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


class DeltaRecorder:
    """The net change of a set of hashes since the last :meth:`take`."""

    __slots__ = ("_cleared", "_delta")

    def __init__(self) -> None:
        self._delta: dict[int, bool] = {}  # hash -> stored (True) / removed (False) since the take
        self._cleared = False

    def stored(self, block_hash: int) -> None:
        if self._delta.get(block_hash) is False:
            del self._delta[block_hash]  # removed and stored again since the last take: no change
        else:
            self._delta[block_hash] = True

    def removed(self, block_hash: int) -> None:
        if self._delta.get(block_hash) is True:
            del self._delta[block_hash]  # stored and removed since the last take: no change
        else:
            self._delta[block_hash] = False

    def cleared(self) -> None:
        """Everything was dropped at once: what was recorded before no longer matters."""
        self._delta.clear()
        self._cleared = True

    def take(self) -> CacheDelta:
        """The net change since the last call (each hash once), and start again."""
        if not self._delta and not self._cleared:
            return CacheDelta()
        stored = tuple(h for h, present in self._delta.items() if present)
        removed = tuple(h for h, present in self._delta.items() if not present)
        delta = CacheDelta(stored, removed, self._cleared)
        self._delta.clear()
        self._cleared = False
        return delta

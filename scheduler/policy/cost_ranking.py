"""Rankings of instances kept across dispatch decisions, so that a decision costs
O(changed views + instances caching the prompt + a few candidates), not a scan of every instance.

A dispatcher that keeps one is called with the whole list of instance views each time, as every
dispatcher is; it compares the list with the one it saw before (one identity check per view, in C)
and moves only the views that changed in its sorted lists. The instances the prefix index names
(at most ``PREFIX_HITS_KEPT``) are rated exactly; among the others, whose cost does not depend on
the cache, the best is found from the sorted lists, reading only as far as the best could still be
beaten. The answer is exactly the full scan's (:func:`best_ttft_by_scan`, :func:`best_kv_by_scan`),
ties going to the smaller instance id, so a decision still recomputes from its inputs alone.

Pure: no I/O, no clock. The formulas are :mod:`scheduler.policy.cache_cost`.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Sequence

from scheduler.config import PolicyConfig
from scheduler.policy.cache_cost import TtftTerms, kv_base_cost, kv_cost, predicted_ttft_key, ttft_terms
from scheduler.policy.load import InstanceLoad

__all__ = [
    "Candidate",
    "KvRanking",
    "TtftRanking",
    "best_kv_by_scan",
    "best_ttft_by_scan",
]

#: ``(instance id, key)``: the best instance and what it maximised
Candidate = tuple[str, tuple[float, float]]
#: Whether an instance may take the request (eligibility and exclusions), by view.
Eligible = Callable[[InstanceLoad], bool]

#: Priorities whose lists are kept at once (each further one replaces the least recently used).
_PRIORITIES_KEPT = 4


def _better(key: tuple[float, float], instance_id: str, best: Candidate | None) -> bool:
    return best is None or key > best[1] or (key == best[1] and instance_id < best[0])


def best_ttft_by_scan(
    loads: Sequence[InstanceLoad],
    demand: Callable[[InstanceLoad], int],
    cached_blocks: dict[str, int],
    eligible: Eligible,
    config: PolicyConfig,
    priority: int,
) -> Candidate | None:
    """The instance with the best :func:`~scheduler.policy.cache_cost.predicted_ttft_key`, every one rated."""
    best: Candidate | None = None
    for load in loads:
        if not eligible(load):
            continue
        own = max(demand(load) - cached_blocks.get(load.instance_id, 0), 0)
        key = predicted_ttft_key(ttft_terms(load, config, priority), own)
        if _better(key, load.instance_id, best):
            best = (load.instance_id, key)
    return best


def best_kv_by_scan(
    loads: Sequence[InstanceLoad],
    num_prompt_tokens: int,
    cached_tokens: dict[str, int],
    eligible: Eligible,
    config: PolicyConfig,
) -> Candidate | None:
    """The instance with the least :func:`~scheduler.policy.cache_cost.kv_cost`, every one rated."""
    best: Candidate | None = None
    for load in loads:
        if not eligible(load):
            continue
        cost = kv_cost(load, num_prompt_tokens, cached_tokens.get(load.instance_id, 0), config.cache)
        key = (-cost, 0.0)
        if _better(key, load.instance_id, best):
            best = (load.instance_id, key)
    return best


class _Views:
    """The views seen last, by position and id, and which changed since (one identity check each)."""

    def __init__(self) -> None:
        self.loads: list[InstanceLoad] = []
        self.by_id: dict[str, InstanceLoad] = {}
        #: block size -> instances of it
        self.block_sizes: dict[int, int] = {}

    def _rebuild(self, fresh: list[InstanceLoad]) -> None:
        self.by_id = {load.instance_id: load for load in fresh}
        self.block_sizes = {}
        for load in fresh:
            self.block_sizes[load.block_size] = self.block_sizes.get(load.block_size, 0) + 1

    def update(self, loads: Sequence[InstanceLoad]) -> list[int] | None:
        """Positions of the views that changed, or None when everything must be rebuilt (instances
        came, went or moved, or most views changed)."""
        old = self.loads
        fresh = list(loads)
        self.loads = fresh
        if len(old) != len(fresh):
            self._rebuild(fresh)
            return None
        changed = list(itertools.compress(range(len(fresh)), map(operator.is_not, fresh, old)))
        if len(changed) > max(len(fresh) // 4, 8):
            self._rebuild(fresh)
            return None
        for i in changed:
            if fresh[i].instance_id != old[i].instance_id:
                self._rebuild(fresh)
                return None
        for i in changed:
            self.by_id[fresh[i].instance_id] = fresh[i]
            if fresh[i].block_size != old[i].block_size:
                self.block_sizes[old[i].block_size] -= 1
                if not self.block_sizes[old[i].block_size]:
                    del self.block_sizes[old[i].block_size]
                self.block_sizes[fresh[i].block_size] = self.block_sizes.get(fresh[i].block_size, 0) + 1
        return changed

    @property
    def block_size(self) -> int | None:
        """The block size of every instance, or None when they differ (or there are none)."""
        if len(self.block_sizes) != 1:
            return None
        return next(iter(self.block_sizes))


class _TtftLists:
    """For one request priority: every live instance's :class:`TtftTerms`, and three sorted lists:
    by work ahead, by room (largest first) and, of those with no work at all, by room per slot."""

    def __init__(self, loads: Sequence[InstanceLoad], config: PolicyConfig, priority: int) -> None:
        self.config, self.priority = config, priority
        self.terms: dict[str, TtftTerms] = {}
        self.by_work: list[tuple[int, str]] = []
        self.by_room: list[tuple[float, str]] = []
        self.idle: list[tuple[float, str]] = []
        for load in loads:
            self._add(load, bulk=True)
        self.by_work.sort()
        self.by_room.sort()
        self.idle.sort()

    def _entries(
        self, instance_id: str, terms: TtftTerms
    ) -> tuple[tuple[int, str], tuple[float, str], tuple[float, str] | None]:
        idle = (-terms.room / terms.slots, instance_id) if terms.work == 0 and terms.in_flight == 0 else None
        return (terms.work, instance_id), (-terms.room, instance_id), idle

    def _add(self, load: InstanceLoad, *, bulk: bool = False) -> None:
        if load.terminating:
            return
        terms = ttft_terms(load, self.config, self.priority)
        self.terms[load.instance_id] = terms
        work, room, idle = self._entries(load.instance_id, terms)
        if bulk:
            self.by_work.append(work)
            self.by_room.append(room)
            if idle is not None:
                self.idle.append(idle)
        else:
            bisect.insort(self.by_work, work)
            bisect.insort(self.by_room, room)
            if idle is not None:
                bisect.insort(self.idle, idle)

    def replace(self, load: InstanceLoad) -> None:
        old = self.terms.pop(load.instance_id, None)
        if old is not None:
            work, room, idle = self._entries(load.instance_id, old)
            del self.by_work[bisect.bisect_left(self.by_work, work)]
            del self.by_room[bisect.bisect_left(self.by_room, room)]
            if idle is not None:
                del self.idle[bisect.bisect_left(self.idle, idle)]
        self._add(load)

    def best(self, demand: int, skip: Callable[[str], bool]) -> Candidate | None:
        """The best instance for a request of ``demand`` blocks cached nowhere, among those ``skip``
        does not rule out (ineligible, excluded, or rated apart because they cache the prompt)."""
        # an instance where it starts at once beats every other: among those, the most room per slot
        best: Candidate | None = None
        for bound, instance_id in self.idle:
            if best is not None and -bound <= best[1][1]:
                break  # its room per slot after admission is below -bound, so below the best
            terms = self.terms[instance_id]
            if terms.room < demand or skip(instance_id):
                continue
            key = predicted_ttft_key(terms, demand)
            if _better(key, instance_id, best):
                best = (instance_id, key)
        if best is not None:
            return best
        # else the least wait: max(work (+ in flight), demand - room) >= max(work, demand - room), so an
        # instance not yet read in either list waits at least max(work read, demand - room read)
        seen: set[str] = set()
        for (work, by_work), (neg_room, by_room) in zip(self.by_work, self.by_room, strict=True):
            for instance_id in (by_work, by_room):
                if instance_id in seen:
                    continue
                seen.add(instance_id)
                if skip(instance_id):
                    continue
                key = predicted_ttft_key(self.terms[instance_id], demand)
                if _better(key, instance_id, best):
                    best = (instance_id, key)
            bound = -float(max(work, demand + neg_room) + demand)
            if best is not None and bound < best[1][0]:
                break
        return best


class TtftRanking:
    """The ``predicted_ttft`` choice kept across decisions (see the module's docstring)."""

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._views = _Views()
        self._lists: dict[int, _TtftLists] = {}

    def update(self, loads: Sequence[InstanceLoad]) -> int | None:
        """Take in the current views; their common block size (None: they differ, rank by a scan)."""
        changed = self._views.update(loads)
        if changed is None:
            self._lists.clear()
        else:
            for lists in self._lists.values():
                for i in changed:
                    lists.replace(self._views.loads[i])
        return self._views.block_size

    def best(
        self,
        demand: int,
        cached_blocks: dict[str, int],
        eligible: Eligible,
        priority: int,
    ) -> Candidate | None:
        """The best eligible instance of the views last taken in (:meth:`update`, one block size) for a
        request of ``demand`` blocks, ``cached_blocks`` saying how many of them each instance caches."""
        lists = self._lists.pop(priority, None)
        if lists is None:
            lists = _TtftLists(self._views.loads, self._config, priority)
        self._lists[priority] = lists  # most recently used last
        while len(self._lists) > _PRIORITIES_KEPT:
            del self._lists[next(iter(self._lists))]
        by_id = self._views.by_id
        best: Candidate | None = None
        for instance_id, num_cached in cached_blocks.items():
            load = by_id.get(instance_id)
            if load is None or not eligible(load) or instance_id not in lists.terms:
                continue
            key = predicted_ttft_key(lists.terms[instance_id], max(demand - num_cached, 0))
            if _better(key, instance_id, best):
                best = (instance_id, key)
        other = lists.best(demand, lambda i: i in cached_blocks or not eligible(by_id[i]))
        if other is not None and _better(other[1], other[0], best):
            best = other
        return best


class KvRanking:
    """The ``kv`` choice at temperature 0 kept across decisions: instances by the part of their cost
    the request does not change; those caching the prompt rated exactly."""

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._views = _Views()
        self._cost: dict[str, float] = {}
        self._order: list[tuple[float, str]] = []

    def _add(self, load: InstanceLoad) -> None:
        if load.terminating:
            return
        cost = kv_base_cost(load, self._config.cache.kv_overlap_weight)
        self._cost[load.instance_id] = cost
        bisect.insort(self._order, (cost, load.instance_id))

    def update(self, loads: Sequence[InstanceLoad]) -> int | None:
        """Take in the current views; their common block size (None: they differ, rank by a scan)."""
        changed = self._views.update(loads)
        if changed is None:
            self._cost.clear()
            self._order = []
            for load in self._views.loads:
                self._add(load)
        else:
            for i in changed:
                load = self._views.loads[i]
                old = self._cost.pop(load.instance_id, None)
                if old is not None:
                    del self._order[bisect.bisect_left(self._order, (old, load.instance_id))]
                self._add(load)
        return self._views.block_size

    def best(
        self,
        num_prompt_tokens: int,
        cached_tokens: dict[str, int],
        eligible: Eligible,
    ) -> Candidate | None:
        """The eligible instance of least cost among the views last taken in (:meth:`update`)."""
        by_id = self._views.by_id
        cache = self._config.cache
        best: Candidate | None = None
        for instance_id, tokens in cached_tokens.items():
            load = by_id.get(instance_id)
            if load is None or load.terminating or not eligible(load):
                continue
            key = (-kv_cost(load, num_prompt_tokens, tokens, cache), 0.0)
            if _better(key, instance_id, best):
                best = (instance_id, key)
        for _, instance_id in self._order:  # the first eligible one not caching the prompt
            if instance_id in cached_tokens or not eligible(by_id[instance_id]):
                continue
            load = by_id[instance_id]
            key = (-kv_cost(load, num_prompt_tokens, 0, cache), 0.0)
            if _better(key, instance_id, best):
                best = (instance_id, key)
            break
        return best

"""Rankings of instances kept across dispatch decisions, so that a decision costs
O(changed views + instances caching the prompt + a few candidates), not a scan of every instance.

A dispatcher that keeps one is called with the whole list of instance views each time, as every
dispatcher is; it compares the list with the one it saw before (in slices compared in C, an
identical view at once; an equal view counts as unchanged) and moves only the views that changed
in its sorted lists. The instances the prefix index names
(at most ``PREFIX_HITS_KEPT``) are rated exactly; among the others, whose cost does not depend on
the cache, the best is found from the sorted lists, reading only as far as the best could still be
beaten. The answer is exactly the full scan's (:func:`best_ttft_by_scan`, :func:`best_kv_by_scan`),
ties going to the smaller instance id, so a decision still recomputes from its inputs alone.

Pure: no I/O, no clock. The formulas are :mod:`scheduler.policy.cache_cost`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from scheduler.config import PolicyConfig
from scheduler.policy.cache_cost import TtftTerms, kv_base_cost, kv_cost, predicted_ttft_key, ttft_terms
from scheduler.policy.load import InstanceLoad, load_batch_size

__all__ = [
    "Candidate",
    "KvRanking",
    "TtftRanking",
    "best_kv_by_scan",
    "best_ttft_by_scan",
    "herd_limit",
]

#: ``(instance id, key)``: the best instance and what it maximised
Candidate = tuple[str, tuple[float, float]]
#: Whether an instance may take the request (eligibility and exclusions), by view.
Eligible = Callable[[InstanceLoad], bool]

#: Views compared at once when looking for those that changed.
_CHUNK = 64

#: Priorities whose lists are kept at once (each further one replaces the least recently used).
_PRIORITIES_KEPT = 4


def _better(key: tuple[float, float], instance_id: str, best: Candidate | None) -> bool:
    return best is None or key > best[1] or (key == best[1] and instance_id < best[0])


def herd_limit(total_batch: int, num_instances: int, factor: float, min_batch: int = 0) -> float:
    """The largest batch (running and pending requests) at which an instance's cached blocks of a
    request still count for ``predicted_ttft``: above it the request would make the batch more than
    ``factor`` times the mean batch, ``(total_batch + 1) / num_instances``, and the batch is at least
    ``min_batch`` (``inf`` with ``factor`` 0)."""
    if factor <= 0 or num_instances <= 0:
        return math.inf
    return max(factor * (total_batch + 1) / num_instances, min_batch) - 1


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
    live = [load for load in loads if not load.terminating]
    cache = config.cache
    limit = herd_limit(
        sum(load_batch_size(load) for load in live), len(live), cache.herd_factor, cache.herd_min_batch
    )
    for load in loads:
        if not eligible(load):
            continue
        cached = cached_blocks.get(load.instance_id, 0) if load_batch_size(load) <= limit else 0
        own = max(demand(load) - cached, 0)
        key = predicted_ttft_key(ttft_terms(load, config, priority), own, config.cache.added_prefill_weight)
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
    """The views seen last, by position and id, and which changed since (an equal view counts as
    unchanged: it rates the same)."""

    def __init__(self) -> None:
        self.loads: list[InstanceLoad] = []
        self.chunks: list[list[InstanceLoad]] = []  # ``loads`` in slices of ``_CHUNK``
        self.by_id: dict[str, InstanceLoad] = {}
        #: block size -> instances of it
        self.block_sizes: dict[int, int] = {}
        #: running and pending requests over the instances not terminating, and those instances
        self.total_batch = self.num_live = 0

    def _rebuild(self, fresh: list[InstanceLoad]) -> None:
        self.loads = fresh
        self.chunks = [fresh[start : start + _CHUNK] for start in range(0, len(fresh), _CHUNK)]
        self.by_id = {load.instance_id: load for load in fresh}
        self.block_sizes = {}
        self.total_batch = self.num_live = 0
        for load in fresh:
            self.block_sizes[load.block_size] = self.block_sizes.get(load.block_size, 0) + 1
            self._count(load, 1)

    def update(self, loads: Sequence[InstanceLoad]) -> list[int] | None:
        """Positions of the views that changed, or None when everything must be rebuilt (instances
        came, went or moved, or most views changed)."""
        if not isinstance(loads, list):  # compared in slices with the lists kept
            loads = list(loads)
        old = self.loads
        if len(old) != len(loads):
            self._rebuild(list(loads))
            return None
        # compare chunk by chunk in C (a list compares identical items at once), then within a chunk
        # that differs view by view
        changed: list[int] = []
        chunks = self.chunks
        for n, chunk in enumerate(chunks):
            start = n * _CHUNK
            fresh = loads[start : start + _CHUNK]
            if fresh != chunk:
                changed.extend(i for i, view in enumerate(fresh, start) if view != old[i])
                chunks[n] = list(fresh)
        if len(changed) > max(len(old) // 4, 8):
            self._rebuild(list(loads))
            return None
        for i in changed:
            if loads[i].instance_id != old[i].instance_id:
                self._rebuild(list(loads))
                return None
        for i in changed:
            view, before = loads[i], old[i]
            self._count(before, -1)
            self._count(view, 1)
            old[i] = view
            self.by_id[view.instance_id] = view
            if view.block_size != before.block_size:
                self.block_sizes[before.block_size] -= 1
                if not self.block_sizes[before.block_size]:
                    del self.block_sizes[before.block_size]
                self.block_sizes[view.block_size] = self.block_sizes.get(view.block_size, 0) + 1
        return changed

    def _count(self, load: InstanceLoad, sign: int) -> None:
        if not load.terminating:
            self.total_batch += sign * load_batch_size(load)
            self.num_live += sign

    @property
    def block_size(self) -> int | None:
        """The block size of every instance, or None when they differ (or there are none)."""
        if len(self.block_sizes) != 1:
            return None
        return next(iter(self.block_sizes))


class _TtftLists:
    """For one request priority: every live instance's :class:`TtftTerms`, and four sorted lists:
    by all the prefill work ahead (queued, pending and in flight), by room (largest first) and, of
    those with no work at all, by room per slot (largest first) and by slots (most first)."""

    def __init__(self, loads: Sequence[InstanceLoad], config: PolicyConfig, priority: int) -> None:
        self.config, self.priority = config, priority
        self.added_weight = config.cache.added_prefill_weight
        self.terms: dict[str, TtftTerms] = {}
        self.by_work: list[tuple[int, str]] = []  # (work ahead, id)
        self.by_room: list[tuple[float, str]] = []  # (-room, id)
        self.idle: list[tuple[float, str]] = []  # (-room per slot, id) of instances with no work ahead
        self.idle_slots: list[tuple[int, str]] = []  # (-slots, id) of the same
        for load in loads:
            self._add(load, bulk=True)
        for entries in (self.by_work, self.by_room, self.idle, self.idle_slots):
            entries.sort()

    def _lists(self, instance_id: str, terms: TtftTerms) -> list[tuple[list[Any], tuple[float, str]]]:
        """Each list ``instance_id`` belongs in, with its entry there."""
        work = terms.work + terms.in_flight
        entries: list[tuple[list[Any], tuple[float, str]]] = [
            (self.by_work, (work, instance_id)),
            (self.by_room, (-terms.room, instance_id)),
        ]
        if work == 0:
            entries.append((self.idle, (-terms.room / terms.slots, instance_id)))
            entries.append((self.idle_slots, (-terms.slots, instance_id)))
        return entries

    def _add(self, load: InstanceLoad, *, bulk: bool = False) -> None:
        if load.terminating:
            return
        terms = ttft_terms(load, self.config, self.priority)
        self.terms[load.instance_id] = terms
        for entries, entry in self._lists(load.instance_id, terms):
            if bulk:
                entries.append(entry)
            else:
                bisect.insort(entries, entry)

    def replace(self, load: InstanceLoad) -> None:
        old = self.terms.pop(load.instance_id, None)
        if old is not None:
            for entries, entry in self._lists(load.instance_id, old):
                del entries[bisect.bisect_left(entries, entry)]
        self._add(load)

    def best(self, demand: int, skip: Callable[[str], bool]) -> Candidate | None:
        """The best instance for a request of ``demand`` blocks cached nowhere, among those ``skip``
        does not rule out (ineligible, excluded, or rated apart because they cache the prompt)."""
        terms_of = self.terms
        # 1. an instance where it starts at once beats every other; among those the most room per slot
        # after admission, room / slots - demand / slots: one not yet read in either list has at most the
        # room per slot read last in the first and at least the demand / slots read last in the second
        best: Candidate | None = None
        seen: set[str] = set()
        for (neg_room_per_slot, by_room), (neg_slots, by_slots) in zip(
            self.idle, self.idle_slots, strict=True
        ):
            for instance_id in (by_room, by_slots):
                if instance_id in seen:
                    continue
                seen.add(instance_id)
                terms = terms_of[instance_id]
                if terms.room < demand or skip(instance_id):
                    continue
                key = predicted_ttft_key(terms, demand, self.added_weight)
                if _better(key, instance_id, best):
                    best = (instance_id, key)
            if best is not None and -neg_room_per_slot + demand / neg_slots < best[1][1]:
                break
        if best is not None:
            return best
        # 2. where its blocks fit, it waits for all the work ahead: the first such instance by work (the
        # smaller id among equals) is the best of them
        for _, instance_id in self.by_work:
            if terms_of[instance_id].room >= demand and not skip(instance_id):
                best = (instance_id, predicted_ttft_key(terms_of[instance_id], demand, self.added_weight))
                break
        # 3. where they do not, it waits at least for the memory deficit, demand - room: read by room,
        # largest first, as long as the deficit alone does not exceed the best wait
        start = bisect.bisect_left(self.by_room, (-demand, chr(0x10FFFF)))
        added = (1.0 + self.added_weight) * demand
        for neg_room, instance_id in itertools.islice(self.by_room, start, None):
            if best is not None and -(demand + neg_room + added) < best[1][0]:
                break
            if skip(instance_id):
                continue
            key = predicted_ttft_key(terms_of[instance_id], demand, self.added_weight)
            if _better(key, instance_id, best):
                best = (instance_id, key)
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

    @property
    def views(self) -> Mapping[str, InstanceLoad]:
        """The views last taken in, by instance id."""
        return self._views.by_id

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
        terms_of = lists.terms
        cache = self._config.cache
        views = self._views
        limit = herd_limit(views.total_batch, views.num_live, cache.herd_factor, cache.herd_min_batch)
        best: Candidate | None = None
        for instance_id, num_cached in cached_blocks.items():
            terms = terms_of.get(instance_id)  # None: gone or terminating
            if terms is None:
                continue
            if load_batch_size(by_id[instance_id]) > limit:  # herding: its cache does not count
                num_cached = 0
            key = predicted_ttft_key(terms, max(demand - num_cached, 0), lists.added_weight)
            if _better(key, instance_id, best) and eligible(by_id[instance_id]):
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

    @property
    def views(self) -> Mapping[str, InstanceLoad]:
        """The views last taken in, by instance id."""
        return self._views.by_id

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
        costs = self._cost  # no entry for a terminating instance
        for instance_id, tokens in cached_tokens.items():
            base = costs.get(instance_id)
            if base is None:
                continue
            load = by_id[instance_id]
            key = (-kv_cost(load, num_prompt_tokens, tokens, cache, base), 0.0)
            if _better(key, instance_id, best) and eligible(load):
                best = (instance_id, key)
        for base, instance_id in self._order:  # the first eligible one not caching the prompt
            if instance_id in cached_tokens or not eligible(by_id[instance_id]):
                continue
            load = by_id[instance_id]
            key = (-kv_cost(load, num_prompt_tokens, 0, cache, base), 0.0)
            if _better(key, instance_id, best):
                best = (instance_id, key)
            break
        return best

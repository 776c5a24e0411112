"""Dispatch policies: which instance a new request goes to.

The policies, chosen by :class:`~scheduler.config.DispatchPolicy` through
:func:`make_dispatcher`. The four a user picks (``--policy``):

* ``prefill_ahead`` (shoal's default): the instance where the request would wait
  least, in blocks ahead of it: the queued and pending prompts' demand, the prompts
  admitted but not yet prefilled (``prefill_blocks`` of the report: the step in flight)
  where memory does not bind, or else the memory deficit; among those where it starts
  at once, the freeness after admission counting every queued request's demand and
  batch slot (see :func:`~scheduler.policy.load.queue_aware_score`);
* ``freeness`` (the paper): the highest freeness ``F``;
* ``infaas++``: the least memory load, counting used blocks and the demand of
  every queued request (the paper's INFaaS++ baseline; run without migration);
* ``round_robin``: eligible instances in id order, the ``n``-th dispatch to the
  ``n mod k``-th (``n`` comes from the cluster state, so replays agree).

Superseded rules, kept so that logs recorded with them recompute:

* ``freeness_after_admit``: the highest ``F`` the instance would have after
  admitting this request;
* ``blocks_ahead``: ``prefill_ahead`` without the prompts in flight counted as work ahead;
* ``blocks_ahead_growth``: ``blocks_ahead`` with the running requests' expected decode
  growth (``expected_growth_blocks`` of the report) taken off each instance's room;
* ``prefill_ahead_saturated``: ``prefill_ahead``, but a request that would wait for memory on
  every instance goes to the least memory load (INFaaS++'s choice);
* ``queue_aware``: the freeness after admission wherever the instance has room, else its
  memory deficit.

Every policy skips terminating instances, excluded ones and instances whose
model length or whole capacity cannot hold the prompt. Dispatches not yet
reflected in an instance's reports count against it (see
:class:`~scheduler.policy.load.InstanceLoad`). Ties break on the smaller
instance id, so a decision is a function of its inputs. Pending requests are
served in :func:`pending_order_key` order: scheduling priority (lower value
first, as in vLLM), then arrival, then request id.

Decisions are plain data; the scheduler service wraps one into a
:class:`~schemas.Dispatched` with :meth:`DispatchDecision.to_event`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import msgspec

from scheduler.config import DispatchPolicy, PolicyConfig
from scheduler.policy.cache_cost import kv_cost, prefix_scores, ttft_terms
from scheduler.policy.cost_ranking import KvRanking, TtftRanking, best_kv_by_scan, best_ttft_by_scan
from scheduler.policy.load import (
    InstanceLoad,
    freeness_after_admit,
    infaas_load,
    load_freeness,
    queue_aware_score,
    starts_at_once,
    waits_for_memory,
)
from schemas.decisions import Dispatched, LoadPosition

__all__ = [
    "DispatchDecision",
    "DispatchRound",
    "Dispatcher",
    "PendingRequest",
    "dispatch_pending",
    "make_dispatcher",
    "order_pending",
    "pending_order_key",
    "requeue_choice",
    "requeue_request",
    "source_cost_blocks",
]


class PendingRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A request waiting for a placement. ``arrival`` is in seconds (any origin)."""

    request_id: str
    num_prompt_tokens: int
    priority: int = 0
    arrival: float = 0.0
    exclude: tuple[str, ...] = ()
    #: ``(instance id, prompt tokens it holds in its prefix cache)`` for the instances whose cache
    #: holds the start of the prompt (the scheduler's prefix index; empty when not looked up)
    cached_tokens: tuple[tuple[str, int], ...] = ()


class DispatchDecision(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Where a request goes, why, and which load reports the choice was made from.

    ``score`` is what the policy maximised (freeness, freeness after admission,
    minus the INFaaS++ load, or the round-robin slot). ``considered`` lists
    ``(instance_id, stream_seq)`` of every eligible instance's report.
    """

    request_id: str
    instance_id: str
    policy: DispatchPolicy
    score: float
    demand_blocks: int
    num_prompt_tokens: int
    priority: int = 0
    considered: tuple[tuple[str, int], ...] = ()

    def to_event(self, epoch: int, *, cite_all: bool = False) -> Dispatched:
        """The decision as a log event; cites the chosen instance's report (all with ``cite_all``)."""
        cited = self.considered if cite_all else tuple(
            entry for entry in self.considered if entry[0] == self.instance_id
        )
        return Dispatched(
            epoch=epoch,
            request_id=self.request_id,
            instance_id=self.instance_id,
            policy=self.policy.value,
            num_prompt_tokens=self.num_prompt_tokens,
            priority=self.priority,
            loads=tuple(LoadPosition(instance_id=i, stream_seq=seq) for i, seq in cited),
        )


class Dispatcher(Protocol):
    """A dispatch policy: pure, deterministic, no state of its own."""

    @property
    def policy(self) -> DispatchPolicy: ...

    def choose(
        self, request: PendingRequest, loads: Sequence[InstanceLoad], *, num_dispatched: int = 0
    ) -> DispatchDecision | None:
        """The placement of ``request`` over ``loads``, or None if no instance is eligible.

        ``num_dispatched`` is how many dispatches the cluster made before this one
        (only round-robin reads it).
        """
        ...


def _eligible(load: InstanceLoad, request: PendingRequest) -> bool:
    return (
        not load.terminating
        and request.num_prompt_tokens <= load.max_model_len
        and -(-request.num_prompt_tokens // load.block_size) <= load.num_total_blocks
        and load.instance_id not in request.exclude
    )


#: Ratings kept per instance view (distinct demands, priorities, exclusions); more start over.
_MEMO_KEYS_PER_VIEW = 64
#: ``(demand blocks, fits the model length, priority, exclude)``
_RequestKey = tuple[int, bool, int, tuple[str, ...]]
#: ``(eligible, demand blocks, score)``
_Rating = tuple[bool, int, float]


class _ScoringDispatcher:
    """Maximise a score over eligible instances; ties go to the smaller instance id.

    Ratings (eligibility, demand, score) are memoised per instance for the view they were
    computed from: a view is an immutable :class:`InstanceLoad` that a new report or dispatch
    replaces, so while an instance's view is the same object its rating for the same demand in
    blocks, fit in the model length, priority and exclusions is the same (the key must name
    everything of the request that :func:`_eligible` and ``_score`` read). A dispatcher kept
    across decisions (the scheduler's) rates again only the instances whose view changed.
    """

    def __init__(self, policy: DispatchPolicy, config: PolicyConfig) -> None:
        self._policy = policy
        self._config = config
        #: instance id -> (the view rated, {request key: rating})
        self._memo: dict[str, tuple[InstanceLoad, dict[_RequestKey, _Rating]]] = {}

    def _rate(self, load: InstanceLoad, request: PendingRequest) -> _Rating:
        """``(eligible, demand blocks, score)`` of ``request`` on ``load``: what :meth:`choose` ranks."""
        demand = -(-request.num_prompt_tokens // load.block_size)
        if not _eligible(load, request):
            return False, demand, -math.inf
        return True, demand, self._score(load, demand, request.priority)

    @property
    def policy(self) -> DispatchPolicy:
        return self._policy

    def _score(self, load: InstanceLoad, demand_blocks: int, priority: int) -> float:
        raise NotImplementedError  # every concrete policy below overrides it

    def choose(
        self, request: PendingRequest, loads: Sequence[InstanceLoad], *, num_dispatched: int = 0
    ) -> DispatchDecision | None:
        best: InstanceLoad | None = None
        best_score = -math.inf
        best_demand = 0
        considered: list[tuple[str, int]] = []
        memo = self._memo
        tokens, priority, exclude = request.num_prompt_tokens, request.priority, request.exclude
        # the key for the last (block size, model length) seen: instances mostly share both
        key_block_size = key_max_len = -1
        key: _RequestKey = (0, False, priority, exclude)
        for load in loads:
            instance_id = load.instance_id
            entry = memo.get(instance_id)
            if entry is None or entry[0] is not load:
                entry = memo[instance_id] = (load, {})
            # what the rating reads of the request: its demand here, whether it fits the model length,
            # its priority and the exclusions (prompts of other lengths often share a rating)
            if load.block_size != key_block_size or load.max_model_len != key_max_len:
                key_block_size, key_max_len = load.block_size, load.max_model_len
                key = (-(-tokens // key_block_size), tokens <= key_max_len, priority, exclude)
            ratings = entry[1]
            rating = ratings.get(key)
            if rating is None:
                if len(ratings) >= _MEMO_KEYS_PER_VIEW:
                    ratings.clear()
                rating = ratings[key] = self._rate(load, request)
            if not rating[0]:
                continue
            considered.append((instance_id, load.stream_seq))
            score = rating[2]
            if best is None or score > best_score or (score == best_score and instance_id < best.instance_id):
                best, best_score, best_demand = load, score, rating[1]
        if len(self._memo) > 2 * len(loads) + 16:  # instances gone: keep only the current ones
            self._memo = {
                load.instance_id: self._memo[load.instance_id]
                for load in loads
                if load.instance_id in self._memo
            }
        if best is None:
            return None
        return DispatchDecision(
            request_id=request.request_id,
            instance_id=best.instance_id,
            policy=self._policy,
            score=best_score,
            demand_blocks=best_demand,
            num_prompt_tokens=request.num_prompt_tokens,
            priority=request.priority,
            considered=tuple(considered),
        )


class _FreenessDispatcher(_ScoringDispatcher):
    def _score(self, load: InstanceLoad, demand_blocks: int, priority: int) -> float:
        return load_freeness(load, self._config)


class _FreenessAfterAdmitDispatcher(_ScoringDispatcher):
    def _score(self, load: InstanceLoad, demand_blocks: int, priority: int) -> float:
        return freeness_after_admit(load, demand_blocks, self._config)


class _InfaasDispatcher(_ScoringDispatcher):
    def _score(self, load: InstanceLoad, demand_blocks: int, priority: int) -> float:
        return -infaas_load(load)


class _QueueAwareDispatcher(_ScoringDispatcher):
    def _score(self, load: InstanceLoad, demand_blocks: int, priority: int) -> float:
        return queue_aware_score(
            load, demand_blocks, self._config, priority=priority,
            blocks_ahead=self.policy is not DispatchPolicy.QUEUE_AWARE,
            count_growth=self.policy is DispatchPolicy.BLOCKS_AHEAD_GROWTH,
            count_prefill=self.policy.counts_prefill,
        )


class _SaturationAwareDispatcher(_QueueAwareDispatcher):
    """``prefill_ahead``; a request that would wait for memory on every eligible instance goes where
    INFaaS++ puts it (the least memory load, used + reserved + every queued and pending demand)."""

    def __init__(self, policy: DispatchPolicy, config: PolicyConfig) -> None:
        super().__init__(policy, config)
        self._memory = _InfaasDispatcher(DispatchPolicy.INFAAS, config)

    def choose(
        self, request: PendingRequest, loads: Sequence[InstanceLoad], *, num_dispatched: int = 0
    ) -> DispatchDecision | None:
        decision = super().choose(request, loads, num_dispatched=num_dispatched)
        if decision is None or decision.score >= 0:
            return decision  # it starts at once somewhere
        eligible = [load for load in loads if _eligible(load, request)]
        if not all(
            waits_for_memory(load, load.demand_blocks(request.num_prompt_tokens), self._config,
                             priority=request.priority)
            for load in eligible
        ):
            return decision
        fallback = self._memory.choose(request, eligible, num_dispatched=num_dispatched)
        return decision if fallback is None else msgspec.structs.replace(fallback, policy=self.policy)


class _RoundRobinDispatcher:
    def __init__(self, config: PolicyConfig) -> None:
        self._config = config

    @property
    def policy(self) -> DispatchPolicy:
        return DispatchPolicy.ROUND_ROBIN

    def choose(
        self, request: PendingRequest, loads: Sequence[InstanceLoad], *, num_dispatched: int = 0
    ) -> DispatchDecision | None:
        eligible = sorted((ld for ld in loads if _eligible(ld, request)), key=lambda ld: ld.instance_id)
        if not eligible:
            return None
        slot = num_dispatched % len(eligible)
        chosen = eligible[slot]
        return DispatchDecision(
            request_id=request.request_id,
            instance_id=chosen.instance_id,
            policy=DispatchPolicy.ROUND_ROBIN,
            score=float(slot),
            demand_blocks=chosen.demand_blocks(request.num_prompt_tokens),
            num_prompt_tokens=request.num_prompt_tokens,
            priority=request.priority,
            considered=tuple((ld.instance_id, ld.stream_seq) for ld in eligible),
        )


def _cached(request: PendingRequest) -> dict[str, int]:
    """``request.cached_tokens`` as a dict: instance id -> prompt tokens cached there."""
    return dict(request.cached_tokens)


def _decision(
    request: PendingRequest, policy: DispatchPolicy, chosen: InstanceLoad, score: float,
    considered: Iterable[InstanceLoad],
) -> DispatchDecision:
    return DispatchDecision(
        request_id=request.request_id,
        instance_id=chosen.instance_id,
        policy=policy,
        score=score,
        demand_blocks=chosen.demand_blocks(request.num_prompt_tokens),
        num_prompt_tokens=request.num_prompt_tokens,
        priority=request.priority,
        considered=tuple((load.instance_id, load.stream_seq) for load in considered),
    )


def _rated_apart(
    chosen: InstanceLoad, views: Mapping[str, InstanceLoad], cached: dict[str, int]
) -> list[InstanceLoad]:
    """What a ranked decision cites as considered: the chosen instance, then those caching the
    prompt (``views``: the current view of each instance by id)."""
    rated = [chosen]
    for instance_id in cached:
        view = views.get(instance_id)
        if view is not None and view is not chosen:
            rated.append(view)
    return rated


class _PredictedTtftDispatcher:
    """``predicted_ttft``: the least predicted TTFT (:func:`~scheduler.policy.cache_cost.predicted_ttft_key`).

    Kept across decisions it ranks instances incrementally (:class:`~scheduler.policy.cost_ranking.
    TtftRanking`): the instances the prefix index names are rated exactly, the rest read from sorted
    lists. ``score`` is minus the predicted TTFT in blocks of prefill; ``considered`` cites the
    chosen instance and those caching the prompt.
    """

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._ranking = TtftRanking(config)

    @property
    def policy(self) -> DispatchPolicy:
        return DispatchPolicy.PREDICTED_TTFT

    def choose(
        self, request: PendingRequest, loads: Sequence[InstanceLoad], *, num_dispatched: int = 0
    ) -> DispatchDecision | None:
        cached = _cached(request)
        block_size = self._ranking.update(loads)

        def eligible(load: InstanceLoad) -> bool:
            return _eligible(load, request)

        if block_size is None:  # instances of different block sizes: rate every one
            cached_blocks = {
                load.instance_id: cached[load.instance_id] // load.block_size
                for load in loads if load.instance_id in cached
            }
            best = best_ttft_by_scan(
                loads, lambda load: load.demand_blocks(request.num_prompt_tokens), cached_blocks, eligible,
                self._config, request.priority,
            )
        else:
            demand = -(-request.num_prompt_tokens // block_size)
            cached_blocks = {key: tokens // block_size for key, tokens in cached.items()}
            best = self._ranking.best(demand, cached_blocks, eligible, request.priority)
        if best is None:
            return None
        views = self._ranking.views
        chosen = views[best[0]]
        return _decision(request, self.policy, chosen, best[1][0], _rated_apart(chosen, views, cached))


def _softmax_pick(costs: list[tuple[str, float]], temperature: float, request_id: str) -> str:
    """A draw from the softmax of minus the costs (scaled to [0, 1] by their range) over ``temperature``,
    seeded by the request id: the same inputs draw the same instance, in a replay too."""
    low = min(cost for _, cost in costs)
    spread = max(cost for _, cost in costs) - low
    weights = [math.exp(-((cost - low) / spread if spread else 0.0) / temperature) for _, cost in costs]
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    point = int.from_bytes(digest, "big") / 2**64 * sum(weights)
    for (instance_id, _), weight in zip(costs, weights, strict=True):
        point -= weight
        if point < 0:
            return instance_id
    return costs[-1][0]


class _KvDispatcher:
    """``kv``: NVIDIA Dynamo's KV router, the least ``w * prefill blocks + decode blocks``
    (:func:`~scheduler.policy.cache_cost.kv_cost`); at a temperature above 0 a softmax draw over the
    eligible instances in id order. ``score`` is minus the cost."""

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._ranking = KvRanking(config)

    @property
    def policy(self) -> DispatchPolicy:
        return DispatchPolicy.KV

    def choose(
        self, request: PendingRequest, loads: Sequence[InstanceLoad], *, num_dispatched: int = 0
    ) -> DispatchDecision | None:
        cached = _cached(request)
        tokens = request.num_prompt_tokens

        def eligible(load: InstanceLoad) -> bool:
            return _eligible(load, request)

        temperature = self._config.cache.kv_temperature
        if temperature > 0:
            costs = sorted(
                (load.instance_id, kv_cost(load, tokens, cached.get(load.instance_id, 0), self._config.cache))
                for load in loads if eligible(load)
            )
            if not costs:
                return None
            picked = _softmax_pick(costs, temperature, request.request_id)
            chosen = next(load for load in loads if load.instance_id == picked)
            return _decision(request, self.policy, chosen, -dict(costs)[picked],
                             [load for load in loads if eligible(load)])
        if self._ranking.update(loads) is None:
            best = best_kv_by_scan(loads, tokens, cached, eligible, self._config)
        else:
            best = self._ranking.best(tokens, cached, eligible)
        if best is None:
            return None
        views = self._ranking.views
        chosen = views[best[0]]
        return _decision(request, self.policy, chosen, best[1][0], _rated_apart(chosen, views, cached))


class _PrefixDispatcher:
    """``prefix``: llm-d's default scheduling profile, the highest weighted sum of its prefix-cache,
    queue and KV-utilisation scorers (:func:`~scheduler.policy.cache_cost.prefix_scores`; the queue
    scorer is normalised over the candidates, so every eligible instance is rated). ``score`` is
    the sum."""

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config

    @property
    def policy(self) -> DispatchPolicy:
        return DispatchPolicy.PREFIX

    def choose(
        self, request: PendingRequest, loads: Sequence[InstanceLoad], *, num_dispatched: int = 0
    ) -> DispatchDecision | None:
        eligible = [load for load in loads if _eligible(load, request)]
        if not eligible:
            return None
        scores = prefix_scores(eligible, request.num_prompt_tokens, _cached(request), self._config.cache)
        best, best_score = eligible[0], scores[0]
        for load, score in zip(eligible, scores, strict=True):
            if score > best_score or (score == best_score and load.instance_id < best.instance_id):
                best, best_score = load, score
        return _decision(request, self.policy, best, best_score, eligible)


def make_dispatcher(policy: DispatchPolicy | str, config: PolicyConfig | None = None) -> Dispatcher:
    """The dispatcher for ``policy`` (an enum member or its value, e.g. ``"infaas++"``)."""
    config = PolicyConfig() if config is None else config
    kind = DispatchPolicy(policy)
    if kind is DispatchPolicy.FREENESS:
        return _FreenessDispatcher(kind, config)
    if kind is DispatchPolicy.FREENESS_AFTER_ADMIT:
        return _FreenessAfterAdmitDispatcher(kind, config)
    if kind is DispatchPolicy.INFAAS:
        return _InfaasDispatcher(kind, config)
    if kind is DispatchPolicy.PREFILL_AHEAD_SATURATED:
        return _SaturationAwareDispatcher(kind, config)
    if kind is DispatchPolicy.PREDICTED_TTFT:
        return _PredictedTtftDispatcher(config)
    if kind is DispatchPolicy.KV:
        return _KvDispatcher(config)
    if kind is DispatchPolicy.PREFIX:
        return _PrefixDispatcher(config)
    if kind.is_shoal:
        return _QueueAwareDispatcher(kind, config)
    return _RoundRobinDispatcher(config)


def pending_order_key(request: PendingRequest) -> tuple[int, float, str]:
    """Serve order: scheduling priority (lower first), then arrival, then request id."""
    return (request.priority, request.arrival, request.request_id)


def order_pending(requests: Iterable[PendingRequest]) -> list[PendingRequest]:
    return sorted(requests, key=pending_order_key)


class DispatchRound(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of :func:`dispatch_pending`: decisions in order, what found no place, new views."""

    decisions: tuple[DispatchDecision, ...]
    unplaced: tuple[PendingRequest, ...]
    loads: tuple[InstanceLoad, ...]


def dispatch_pending(
    requests: Iterable[PendingRequest],
    loads: Sequence[InstanceLoad],
    dispatcher: Dispatcher,
    *,
    num_dispatched: int = 0,
) -> DispatchRound:
    """Dispatch waiting requests in serve order, each seeing the dispatches before it.

    Every decision is applied to the chosen view as a pending dispatch before the
    next request is placed; ``loads`` in the result are the updated views.
    """
    views = list(loads)
    index = {load.instance_id: i for i, load in enumerate(views)}
    decisions: list[DispatchDecision] = []
    unplaced: list[PendingRequest] = []
    for request in order_pending(requests):
        decision = dispatcher.choose(request, views, num_dispatched=num_dispatched + len(decisions))
        if decision is None:
            unplaced.append(request)
            continue
        decisions.append(decision)
        i = index[decision.instance_id]
        views[i] = views[i].with_dispatch(decision.demand_blocks)
    return DispatchRound(decisions=tuple(decisions), unplaced=tuple(unplaced), loads=tuple(views))


def requeue_choice(
    dispatcher: Dispatcher,
    request: PendingRequest,
    source: str,
    loads: Sequence[InstanceLoad],
    *,
    config: PolicyConfig,
    num_dispatched: int = 0,
) -> DispatchDecision | None:
    """Where a request still queued on ``source`` (no KV yet) should go, or None to leave it.

    shoal's rule for a stalled queue: move the request, not KV, and only to an instance where
    it would start at once and stay (:func:`~scheduler.policy.load.starts_at_once`: nothing queued
    ahead of it or pending, room for its prompt after the blocks the running requests are still
    expected to grow by), never back to ``source``; among those, the dispatcher's choice. A
    request moved where it only fits for now takes room the running requests need a little later,
    and they get preempted. Only the scores of the blocks-ahead rules (``blocks_ahead``,
    ``blocks_ahead_growth``, ``prefill_ahead``) say "starts at once", so any other policy leaves
    the request (``prefill_ahead`` scores an instance where it starts at once behind a prefill in
    flight below zero: there :func:`requeue_request` rules out the rest and the sign is not read).
    :func:`requeue_request` is the request the dispatcher is asked to place (the instances ruled
    out in its ``exclude``): dispatching it gives the same decision.

    Under ``predicted_ttft`` the request's blocks an instance caches (``request.cached_tokens``) need
    no room there, and a request some instance caches moves only if its cost there (minus the
    dispatcher's score) is below its cost on ``source``, where it is the newest of the queue
    (:func:`source_cost_blocks`): staying near its cache may pay. One cached nowhere moves as under
    ``prefill_ahead``: the stalled queue says more about its wait than the blocks ahead of it.

    Reports without ``expected_growth_blocks`` (logs whose agents did not report it, or an instance
    that finished nothing yet) rule nothing out beyond the score, so such logs recompute as they did.
    """
    if not dispatcher.policy.moves_queued:
        return None
    moved = requeue_request(request, source, loads, config)
    decision = dispatcher.choose(moved, loads, num_dispatched=num_dispatched)
    if decision is None or (decision.score < 0 and not dispatcher.policy.counts_prefill):
        return None
    if dispatcher.policy is DispatchPolicy.PREDICTED_TTFT and request.cached_tokens:
        origin = next((load for load in loads if load.instance_id == source), None)
        if origin is not None and -decision.score >= source_cost_blocks(origin, request, config):
            return None
    return decision


def source_cost_blocks(source: InstanceLoad, request: PendingRequest, config: PolicyConfig) -> float:
    """``predicted_ttft``'s cost, in blocks of prefill, of ``request`` staying the newest of ``source``'s
    queue: its predicted TTFT (the uncached blocks of the whole queue, its own included, pending
    dispatches and prompts in flight, or the queue's memory deficit if that is larger) plus the
    decode cost of its own uncached blocks there."""
    terms = ttft_terms(source, config, request.priority)
    cached = dict(request.cached_tokens).get(source.instance_id, 0) // source.block_size
    own = max(source.demand_blocks(request.num_prompt_tokens) - cached, 0)
    return float(max(terms.work + terms.in_flight, -terms.room)) + config.cache.added_prefill_weight * own


def requeue_request(
    request: PendingRequest,
    source: str,
    loads: Sequence[InstanceLoad],
    config: PolicyConfig,
) -> PendingRequest:
    """``request`` as :func:`requeue_choice` offers it to the dispatcher: ``source`` excluded, and every
    instance that expects growth and where the request would not start at once and stay, in
    ``loads`` order. Under ``prefill_ahead`` (``config.dispatch_policy.counts_prefill``) every
    instance where it would not, growth or not: that rule's score is negative also where the
    request starts at once behind a prefill in flight, so the sign cannot say it. Under
    ``predicted_ttft`` the prompt blocks an instance caches need no room there."""
    every_instance = config.dispatch_policy.counts_prefill
    cached = dict(request.cached_tokens) if config.dispatch_policy is DispatchPolicy.PREDICTED_TTFT else {}
    excluded = [source]
    for load in loads:
        demand = load.demand_blocks(request.num_prompt_tokens)
        if cached:  # the blocks it caches need no room
            demand = max(demand - cached.get(load.instance_id, 0) // load.block_size, 0)
        if (
            (every_instance or load.expected_growth_blocks > 0)
            and load.instance_id != source
            and not starts_at_once(load, demand, config, priority=request.priority)
        ):
            excluded.append(load.instance_id)
    return msgspec.structs.replace(request, exclude=(*request.exclude, *excluded))

"""Frozen configuration of the policy core.

Everything the pure policies need to know that is not an observation lives
here: the priority classes and their headroom, the dispatch policy, the
migration-pairing band, and the auto-scaling band and sustain period (the
migration state machines' stage sizing and timeouts are
:class:`agents.migration.fsm.config.MigrationConfig`). Objects are frozen and
validated on construction; nothing here (or anywhere below the entry points)
reads the environment.

Priorities are integers as in vLLM: a *lower* value runs sooner. A priority is
mapped to a :class:`PriorityClass` by the classes' ``max_priority`` bounds
(the first class, in order, whose bound is >= the priority; priorities above
every bound belong to the last class). Headroom is in KV blocks: the paper's
1,600 tokens at block size 16 is 100 blocks.
"""

from __future__ import annotations

import enum
import itertools
import sys
from dataclasses import dataclass, field, replace

import msgspec

__all__ = [
    "DEFAULT_PRIORITY_CLASSES",
    "DISPATCH_MENU",
    "SHOAL_HIGH_FREENESS",
    "SHOAL_REQUEUE_AFTER_S",
    "SUPERSEDED_DISPATCH",
    "CacheCostConfig",
    "DispatchPolicy",
    "PairingConfig",
    "PolicyConfig",
    "PriorityClass",
    "ScalingConfig",
    "decode_policy",
    "encode_policy",
    "shoal_pairing",
]


class DispatchPolicy(enum.StrEnum):
    """Which rule places a new request (see :mod:`scheduler.policy.dispatch`).

    The rules ``--policy`` offers are :data:`DISPATCH_MENU`. The others are superseded rules,
    kept so that a log recorded with one still decodes and recomputes its decisions exactly
    (``shoal replay``); no command line offers them (:data:`SUPERSEDED_DISPATCH`).
    """

    #: shoal's default: the instance where the request would start soonest, counting the blocks
    #: of the prompts queued or admitted but not yet prefilled ahead of it (``LoadReport.prefill_blocks``),
    #: or the memory it would wait for; among instances where it starts at once, the most room per
    #: request after admitting it.
    PREFILL_AHEAD = "prefill_ahead"
    #: The Llumnix paper's rule: the instance with the highest freeness.
    FREENESS = "freeness"
    #: INFaaS++: the least memory load, counting the demand of every queued request.
    INFAAS = "infaas++"
    #: Instances in id order, one after another.
    ROUND_ROBIN = "round_robin"
    #: shoal's cost model: the least predicted time to first token, in blocks of prefill: the uncached
    #: prompt blocks queued, pending and in flight ahead of the request plus its own uncached blocks
    #: (the prefix index's answer), or the memory it would wait for; ties among instances where it
    #: starts at once go to the most room per request after admitting it.
    PREDICTED_TTFT = "predicted_ttft"
    #: NVIDIA Dynamo's KV router: the least ``w * prefill blocks + decode blocks``.
    KV = "kv"
    #: llm-d's inference scheduler: the highest weighted sum of its prefix-cache, queue and
    #: KV-utilisation scorers.
    PREFIX = "prefix"
    #: Superseded: the highest freeness the instance would have after admitting the request.
    FREENESS_AFTER_ADMIT = "freeness_after_admit"
    #: Superseded: freeness after admission counting every queued request's demand and batch slot;
    #: an instance that cannot hold its queue is ranked by its deficit in blocks.
    QUEUE_AWARE = "queue_aware"
    #: Superseded: ``prefill_ahead`` without the prompts admitted but not yet prefilled counted as
    #: work ahead.
    BLOCKS_AHEAD = "blocks_ahead"
    #: Superseded: ``blocks_ahead`` with the running requests' expected decode growth taken off every
    #: instance's room (``LoadReport.expected_growth_blocks``).
    BLOCKS_AHEAD_GROWTH = "blocks_ahead_growth"
    #: Superseded: ``prefill_ahead``, except that a request which would wait for memory on every
    #: instance goes where INFaaS++ puts it (the least memory load).
    PREFILL_AHEAD_SATURATED = "prefill_ahead_saturated"

    @property
    def migrates(self) -> bool:
        """Whether the paper runs this policy with migration (the baselines do not)."""
        return self in (
            DispatchPolicy.FREENESS, DispatchPolicy.FREENESS_AFTER_ADMIT, *SHOAL_DISPATCH
        )

    @property
    def moves_queued(self) -> bool:
        """Whether its scores say where a request "starts at once", so a stalled queue's request may
        move there (:func:`scheduler.policy.dispatch.requeue_choice`)."""
        return self in (
            DispatchPolicy.BLOCKS_AHEAD, DispatchPolicy.BLOCKS_AHEAD_GROWTH, DispatchPolicy.PREFILL_AHEAD,
            DispatchPolicy.PREFILL_AHEAD_SATURATED, DispatchPolicy.PREDICTED_TTFT,
        )

    @property
    def reads_cache(self) -> bool:
        """Whether its score reads the prefix index's answer (``PendingRequest.cached_tokens``)."""
        return self in (DispatchPolicy.PREDICTED_TTFT, DispatchPolicy.KV, DispatchPolicy.PREFIX)

    @property
    def counts_prefill(self) -> bool:
        """Whether its score counts the prompts admitted but not yet prefilled as work ahead."""
        return self in (
            DispatchPolicy.PREFILL_AHEAD, DispatchPolicy.PREFILL_AHEAD_SATURATED,
            DispatchPolicy.PREDICTED_TTFT,
        )

    @property
    def is_shoal(self) -> bool:
        """One of shoal's own rules (they bring :func:`shoal_pairing` and may move queued requests)."""
        return self in SHOAL_DISPATCH

    @property
    def superseded(self) -> bool:
        """Kept only so that logs recorded with it recompute; not offered by any command line."""
        return self in SUPERSEDED_DISPATCH


#: The dispatch rules a user picks from (``--policy``): shoal's default first, shoal's cache-aware
#: cost model, the paper's Llumnix rule, the comparison baselines, and the KV-aware routers of
#: NVIDIA Dynamo (``kv``) and llm-d (``prefix``).
DISPATCH_MENU: tuple[DispatchPolicy, ...] = (
    DispatchPolicy.PREFILL_AHEAD, DispatchPolicy.PREDICTED_TTFT, DispatchPolicy.FREENESS,
    DispatchPolicy.INFAAS, DispatchPolicy.ROUND_ROBIN, DispatchPolicy.KV, DispatchPolicy.PREFIX,
)

#: Superseded rules: decoded from logs and recomputed by replay, offered by no command line.
SUPERSEDED_DISPATCH: tuple[DispatchPolicy, ...] = tuple(p for p in DispatchPolicy if p not in DISPATCH_MENU)

#: shoal's dispatch rules, the default first.
SHOAL_DISPATCH: tuple[DispatchPolicy, ...] = (
    DispatchPolicy.PREFILL_AHEAD, DispatchPolicy.BLOCKS_AHEAD, DispatchPolicy.QUEUE_AWARE,
    DispatchPolicy.BLOCKS_AHEAD_GROWTH, DispatchPolicy.PREFILL_AHEAD_SATURATED, DispatchPolicy.PREDICTED_TTFT,
)


@dataclass(frozen=True, slots=True)
class PriorityClass:
    """Priorities up to ``max_priority`` (inclusive) and the headroom reserved for them.

    The headroom of a class is split among that class's running requests on an
    instance, so an instance reserves it once however many such requests it runs.
    """

    name: str
    max_priority: int
    headroom_blocks: int = 0

    def __post_init__(self) -> None:
        if self.headroom_blocks < 0:
            raise ValueError(f"headroom_blocks must be >= 0, got {self.headroom_blocks}")


#: Two classes as in the paper: priorities below 0 are "high" (100 blocks = 1,600
#: tokens of headroom at block size 16); 0 and above are "normal" (no headroom).
DEFAULT_PRIORITY_CLASSES: tuple[PriorityClass, ...] = (
    PriorityClass(name="high", max_priority=-1, headroom_blocks=100),
    PriorityClass(name="normal", max_priority=sys.maxsize, headroom_blocks=0),
)


@dataclass(frozen=True, slots=True)
class PairingConfig:
    """Migration pairing band: sources below ``low_freeness``, destinations above ``high_freeness``.

    The paper gives no values; Llumnix's code migrates out below freeness 3.
    ``target_freeness`` is what the pairing command asks the source to reach
    (``None``: the low threshold, i.e. leaving the source band).

    shoal's additions (off by default, the paper's rules; the ``shoal`` policy turns them on):

    * ``room_check``: a destination is paired only if its room (capacity minus used,
      reserved, queued and pending demand and headroom) holds the source's mean request
      and at least ``min_room_blocks`` blocks; that room travels with the pair, and the
      source sends only requests that fit in what is left of it (their blocks plus the
      migration protocol's ``last_stage_max_blocks``, the tokens they may generate while
      moving). Freeness above the high band alone says little about room: one request
      holding 820 of 851 blocks gives freeness 31.
    * ``retry_after_abort_s``: a request whose migration aborted is not chosen again for
      this long (0: at once).
    * ``max_moves_per_request``: a request that migrated this many times stays (0: no limit).
    """

    low_freeness: float = 3.0
    high_freeness: float = 30.0
    target_freeness: float | None = None
    room_check: bool = False
    min_room_blocks: int = 0
    retry_after_abort_s: float = 0.0
    max_moves_per_request: int = 0

    def __post_init__(self) -> None:
        if not self.low_freeness < self.high_freeness:
            raise ValueError(
                f"low_freeness ({self.low_freeness}) must be below high_freeness ({self.high_freeness})"
            )
        if min(self.min_room_blocks, self.max_moves_per_request) < 0:
            raise ValueError("min_room_blocks and max_moves_per_request must be >= 0")
        if self.retry_after_abort_s < 0:
            raise ValueError("retry_after_abort_s must be >= 0")

    @property
    def source_target(self) -> float:
        return self.low_freeness if self.target_freeness is None else self.target_freeness


#: shoal's default destination threshold: only instances with freeness above 60 receive
#: migrations. With the paper's 30, migration spreads load so evenly near the knee that no
#: instance keeps room for a long prompt, which then blocks a queue (docs/policies.md).
SHOAL_HIGH_FREENESS = 60.0

#: shoal's default for moving queued requests (``requeue_after_s``): a queue whose head of line
#: waited this long gives its newest never-run request to an instance where it starts at once
#: (:func:`scheduler.policy.dispatch.requeue_choice`). The simulator's ``shoal`` runs with it.
SHOAL_REQUEUE_AFTER_S = 0.5


def shoal_pairing(
    low_freeness: float = 3.0,
    high_freeness: float = SHOAL_HIGH_FREENESS,
    target_freeness: float | None = None,
) -> PairingConfig:
    """The pairing rules of shoal's default policy: the band (3, 60), plus the room check, no
    retry of an aborted request for 2 s, and at most 3 moves per request."""
    return PairingConfig(
        low_freeness=low_freeness, high_freeness=high_freeness, target_freeness=target_freeness,
        room_check=True, min_room_blocks=1, retry_after_abort_s=2.0,
        max_moves_per_request=3,
    )


@dataclass(frozen=True, slots=True)
class CacheCostConfig:
    """Parameters of the cache-aware dispatch rules, each at its source's default.

    * ``kv_overlap_weight`` (Dynamo's ``--router-kv-overlap-score-weight``, default 1) and
      ``kv_temperature`` (``--router-temperature``, default 0: the lowest cost, deterministic; above
      0 a softmax draw over the costs, seeded by the request id so that a replay draws the same);
    * ``prefix_weight``, ``queue_weight``, ``kv_utilization_weight``: llm-d's default scheduling
      profile (prefix-cache-scorer 3, queue-scorer 2, kv-cache-utilization-scorer 2);
    * ``added_prefill_weight``: shoal's ``predicted_ttft``, the decode cost of what a request adds:
      its uncached prompt blocks count once in its own TTFT and this many times more for the steps
      of the requests decoding beside it that its prefill stretches (1; 0: its TTFT alone);
    * ``herd_factor``: ``predicted_ttft``'s guard against herding: an instance whose batch the
      request would take above this many times the mean batch is rated as if it cached nothing of
      the request, so a hot prefix spreads to instances that then cache it (2; 0: off);
    * ``herd_min_batch``: the guard acts only on an instance running (or about to run) at least
      this many requests: at light load the mean batch is below one and twice it is passed by a
      single request, which would send the request to prefill its prompt again beside an
      instance that could start it at once from its cache (2; 0 or 1: the factor alone).
    """

    kv_overlap_weight: float = 1.0
    kv_temperature: float = 0.0
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_utilization_weight: float = 2.0
    added_prefill_weight: float = 1.0
    herd_factor: float = 2.0
    herd_min_batch: int = 2

    def __post_init__(self) -> None:
        if min(self.kv_overlap_weight, self.kv_temperature, self.prefix_weight, self.queue_weight,
               self.kv_utilization_weight, self.added_prefill_weight, self.herd_factor,
               self.herd_min_batch) < 0:
            raise ValueError("cache cost weights and the temperature must be >= 0")


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    """Keep the average normal-usage freeness inside [min_freeness, max_freeness].

    Defaults follow the paper ([10, 60], at most 16 instances). A side of the band
    must be crossed for ``sustain_s`` seconds before acting. Scale-up waits while
    launched instances have not joined yet (up to ``launch_timeout_s``); at most
    ``max_concurrent_terminations`` instances drain at once. A scheduler that
    becomes active waits up to ``startup_grace_s`` for ``min_instances`` live
    instances before it scales at all: the ones started beside it (``shoal up``,
    an operator's) are still joining, and starting more in their place would
    overshoot.
    """

    min_freeness: float = 10.0
    max_freeness: float = 60.0
    sustain_s: float = 10.0
    min_instances: int = 1
    max_instances: int = 16
    launch_timeout_s: float = 300.0
    max_concurrent_terminations: int = 1
    startup_grace_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.min_freeness < self.max_freeness:
            raise ValueError("min_freeness must be below max_freeness")
        if self.sustain_s < 0 or self.launch_timeout_s < 0 or self.startup_grace_s < 0:
            raise ValueError("sustain_s, launch_timeout_s and startup_grace_s must be >= 0")
        if not 0 <= self.min_instances <= self.max_instances:
            raise ValueError("need 0 <= min_instances <= max_instances")
        if self.max_concurrent_terminations < 1:
            raise ValueError("max_concurrent_terminations must be >= 1")


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Everything the scheduler's policies read. Build one at the entry point and pass it down."""

    priority_classes: tuple[PriorityClass, ...] = DEFAULT_PRIORITY_CLASSES
    dispatch_policy: DispatchPolicy = DispatchPolicy.FREENESS
    pairing: PairingConfig = field(default_factory=PairingConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    cache: CacheCostConfig = field(default_factory=CacheCostConfig)

    def __post_init__(self) -> None:
        if not self.priority_classes:
            raise ValueError("at least one priority class is needed")
        bounds = [c.max_priority for c in self.priority_classes]
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"priority class bounds must strictly increase, got {bounds}")
        names = [c.name for c in self.priority_classes]
        if len(set(names)) != len(names):
            raise ValueError(f"priority class names must be unique, got {names}")

    def priority_class(self, priority: int) -> PriorityClass:
        """The class a priority belongs to (the last class takes everything above the bounds)."""
        for cls in self.priority_classes:
            if priority <= cls.max_priority:
                return cls
        return self.priority_classes[-1]

    def headroom_blocks(self, priority: int) -> int:
        """Headroom reserved, in blocks, by the running requests of this priority's class."""
        return self.priority_class(priority).headroom_blocks


def encode_policy(policy: PolicyConfig) -> str:
    """``policy`` as JSON, for the log (a takeover tick records the rules of its epoch)."""
    return msgspec.json.encode(policy).decode()


def decode_policy(text: str) -> PolicyConfig:
    """The inverse of :func:`encode_policy`; raises ``ValueError`` for anything else.

    A policy recorded before ``CacheCostConfig.herd_min_batch`` existed decodes with 0, the rule
    it ran (the herding factor alone), so that its decisions replay as made."""
    try:
        policy = msgspec.json.decode(text, type=PolicyConfig)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        raise ValueError(f"not a recorded policy: {exc}") from exc
    if '"herd_min_batch"' not in text:
        policy = replace(policy, cache=replace(policy.cache, herd_min_batch=0))
    return policy

"""Scheduler decisions: dispatch, pairing, un-pairing, scaling.

Appended by the active scheduler on ``<prefix>.ev.sched.<kind>``. Every
decision carries the scheduler's lease epoch; decisions of an older epoch are
ignored by everyone. Each records the load-report positions it was made from,
so a replay can recompute it.
"""

from __future__ import annotations

from schemas.base import Message
from schemas.reasons import UnpairReason

__all__ = [
    "DecisionEvent",
    "Dispatched",
    "LoadPosition",
    "Paired",
    "ScaleDown",
    "ScaleUp",
    "ScalingInputs",
    "SchedulerTick",
    "Unpaired",
]


class LoadPosition(Message, frozen=True, kw_only=True, tag="load_position"):
    """The last load report of an instance that a decision used."""

    instance_id: str
    stream_seq: int


class Dispatched(Message, frozen=True, kw_only=True, tag="dispatched"):
    epoch: int
    request_id: str
    instance_id: str
    policy: str
    num_prompt_tokens: int
    priority: int = 0
    loads: tuple[LoadPosition, ...] = ()
    #: The fold point the decision was made at: the last events / loads stream
    #: sequences folded (events first, then loads) before deciding (0: not recorded).
    events_seq: int = 0
    loads_seq: int = 0
    #: Instances the request asked to avoid (a rescue excludes the failed one).
    exclude: tuple[str, ...] = ()
    #: A move of a request still queued on this instance (no KV; the scheduler's
    #: ``requeue_after_s``), decided by ``scheduler.policy.dispatch.requeue_choice``; "": a placement.
    requeued_from: str = ""
    #: The prefix index at the decision (:mod:`scheduler.prefix_index`): the request's chain had
    #: ``num_chain_blocks`` full blocks; ``cached_blocks`` lists ``(instance id, leading blocks of
    #: the chain it held)`` for the instances holding any, by id; ``kv_seq`` is the last
    #: ``<prefix>_kv`` stream sequence the index had folded (all 0 / empty: not looked up).
    num_chain_blocks: int = 0
    cached_blocks: tuple[tuple[str, int], ...] = ()
    kv_seq: int = 0


class Paired(Message, frozen=True, kw_only=True, tag="paired"):
    epoch: int
    source_id: str
    destination_id: str
    target_freeness: float
    source_freeness: float
    destination_freeness: float
    #: Blocks the destination could take when paired (capacity minus used, reserved, queued and
    #: pending demand and headroom); ``-1``: not checked (the paper's rules). The source sends
    #: only requests that fit in what is left of it.
    destination_room_blocks: int = -1


class Unpaired(Message, frozen=True, kw_only=True, tag="unpaired"):
    epoch: int
    source_id: str
    destination_id: str
    reason: UnpairReason


class ScalingInputs(Message, frozen=True, kw_only=True, tag="scaling_inputs"):
    """What a scaling decision read besides the state and the policy: the scheduler's clock
    (monotonic seconds) and its sustain timers before deciding (``scheduler.policy.scaling``)."""

    clock: float
    below_since: float | None = None
    above_since: float | None = None
    launch_started_at: float | None = None


class ScaleUp(Message, frozen=True, kw_only=True, tag="scale_up"):
    epoch: int
    num_instances: int
    average_freeness: float
    #: None in logs of schema version 2 and older (the decision cannot be recomputed).
    inputs: ScalingInputs | None = None


class ScaleDown(Message, frozen=True, kw_only=True, tag="scale_down"):
    epoch: int
    instance_id: str
    average_freeness: float
    inputs: ScalingInputs | None = None


class SchedulerTick(Message, frozen=True, kw_only=True, tag="scheduler_tick"):
    """A fold point of the active scheduler that no dispatch records, or (with
    ``takeover``) the first event of a new lease epoch. Decisions without a
    fold point of their own (pairing, scaling, failures) were made at the last
    one recorded in their epoch."""

    epoch: int
    events_seq: int = 0
    loads_seq: int = 0
    takeover: bool = False
    #: On a takeover: the epoch's policy configuration as JSON (``scheduler.config.encode_policy``),
    #: so replays and standbys recompute its decisions with the thresholds it used. "" if unknown.
    policy: str = ""


DecisionEvent = Dispatched | Paired | Unpaired | ScaleUp | ScaleDown | SchedulerTick

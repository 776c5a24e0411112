"""Migration pairing: which overloaded instance sheds requests to which free one.

Sources are instances with freeness below the low threshold (and something
running to move); destinations are instances above the high threshold that are
not terminating. With ``PairingConfig.room_check`` a destination must also have
room (:func:`~scheduler.policy.load.room_blocks`) for the source's mean request,
and the pair carries that room so the source sends only what fits. The lowest-
freeness source is paired with the highest-freeness destination of the same
migration group (model identity and KV layout must match), then the next,
repeatedly. A pair lasts until one side leaves its band (source back at or above
the low threshold, destination at or below the high one), an instance
disappears, the destination starts terminating, or a terminating source has
drained. The pairing command carries the freeness target the source must reach
(``PairingConfig.source_target``).

A terminating instance has freeness ``-inf`` (its fake request), so it is
always a source until it has drained. Ties break on instance id. Why a pair ends is
the wire's :class:`schemas.reasons.UnpairReason`, re-exported here. Pure code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from scheduler.config import PolicyConfig
from scheduler.policy.load import InstanceLoad, load_freeness, room_blocks
from schemas.decisions import Paired, Unpaired
from schemas.reasons import UnpairReason

__all__ = [
    "PairDecision",
    "Pairing",
    "PairingPlan",
    "UnpairDecision",
    "UnpairReason",
    "pair_instances",
]


class Pairing(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A pair in force: ``source_id`` migrates to ``destination_id`` until it reaches the target."""

    source_id: str
    destination_id: str
    target_freeness: float
    epoch: int = 0
    #: The destination's room when paired (``-1``: not checked); see :class:`~schemas.Paired`.
    room_blocks: int = -1


class PairDecision(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    source_id: str
    destination_id: str
    target_freeness: float
    source_freeness: float
    destination_freeness: float
    destination_room_blocks: int = -1

    def to_event(self, epoch: int) -> Paired:
        return Paired(
            epoch=epoch,
            source_id=self.source_id,
            destination_id=self.destination_id,
            target_freeness=self.target_freeness,
            source_freeness=self.source_freeness,
            destination_freeness=self.destination_freeness,
            destination_room_blocks=self.destination_room_blocks,
        )


class UnpairDecision(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    source_id: str
    destination_id: str
    reason: UnpairReason

    def to_event(self, epoch: int) -> Unpaired:
        return Unpaired(
            epoch=epoch, source_id=self.source_id, destination_id=self.destination_id, reason=self.reason,
        )


class PairingPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Pairs that end (``unpaired``), pairs that go on (``kept``) and new ones (``paired``)."""

    unpaired: tuple[UnpairDecision, ...]
    kept: tuple[Pairing, ...]
    paired: tuple[PairDecision, ...]


def _has_drained(load: InstanceLoad) -> bool:
    return load.num_running == 0 and load.num_waiting == 0 and load.num_pending == 0


def _end_reason(
    pairing: Pairing,
    loads: dict[str, InstanceLoad],
    freeness: dict[str, float],
    config: PolicyConfig,
) -> UnpairReason | None:
    source = loads.get(pairing.source_id)
    destination = loads.get(pairing.destination_id)
    if source is None:
        return UnpairReason.SOURCE_GONE
    if destination is None:
        return UnpairReason.DESTINATION_GONE
    if destination.terminating:
        return UnpairReason.DESTINATION_TERMINATING
    if source.terminating and _has_drained(source):
        return UnpairReason.SOURCE_DRAINED
    if freeness[pairing.source_id] >= config.pairing.low_freeness:
        return UnpairReason.SOURCE_RECOVERED
    if freeness[pairing.destination_id] <= config.pairing.high_freeness:
        return UnpairReason.DESTINATION_FILLED
    return None


def _room_needed(source: InstanceLoad, config: PolicyConfig) -> int:
    """Room a destination needs for a source (room check): its mean request, in blocks, at least
    ``min_room_blocks`` and 1. The source sends its shortest requests first, so a destination
    that holds the mean request holds what the source will send."""
    mean = -(-source.num_used_blocks // max(source.num_running, 1))
    return max(mean, config.pairing.min_room_blocks, 1)


def pair_instances(
    loads: Sequence[InstanceLoad], current: Iterable[Pairing], config: PolicyConfig
) -> PairingPlan:
    """End the pairs that left their band, then pair the remaining sources and destinations.

    ``loads`` are the live instances (failed and departed ones left out);
    ``current`` the pairs in force.
    """
    by_id = {load.instance_id: load for load in loads}
    freeness = {load.instance_id: load_freeness(load, config) for load in loads}
    unpaired: list[UnpairDecision] = []
    kept: list[Pairing] = []
    for pairing in sorted(current, key=lambda p: (p.source_id, p.destination_id)):
        reason = _end_reason(pairing, by_id, freeness, config)
        if reason is None:
            kept.append(pairing)
        else:
            unpaired.append(UnpairDecision(
                source_id=pairing.source_id, destination_id=pairing.destination_id, reason=reason,
            ))
    busy = {p.source_id for p in kept} | {p.destination_id for p in kept}
    low, high = config.pairing.low_freeness, config.pairing.high_freeness
    check = config.pairing.room_check
    room = {ld.instance_id: room_blocks(ld, config) for ld in loads} if check else {}
    sources = sorted(
        (ld for ld in loads
         if ld.instance_id not in busy and freeness[ld.instance_id] < low and ld.num_running > 0),
        key=lambda ld: (freeness[ld.instance_id], ld.instance_id),
    )
    destinations = sorted(
        (ld for ld in loads
         if ld.instance_id not in busy and not ld.terminating and freeness[ld.instance_id] > high
         and (not check or room[ld.instance_id] >= max(config.pairing.min_room_blocks, 1))),
        key=lambda ld: (-freeness[ld.instance_id], ld.instance_id),
    )
    paired: list[PairDecision] = []
    for source in sources:
        need = _room_needed(source, config) if check else 0
        match = next(
            (d for d in destinations
             if d.migration_group == source.migration_group and (not check or room[d.instance_id] >= need)),
            None,
        )
        if match is None:
            continue
        destinations.remove(match)
        paired.append(PairDecision(
            source_id=source.instance_id,
            destination_id=match.instance_id,
            target_freeness=config.pairing.source_target,
            source_freeness=freeness[source.instance_id],
            destination_freeness=freeness[match.instance_id],
            destination_room_blocks=room[match.instance_id] if check else -1,
        ))
    return PairingPlan(unpaired=tuple(unpaired), kept=tuple(kept), paired=tuple(paired))

"""Migration pairing: which overloaded instance sheds requests to which free one.

Sources are instances with freeness below the low threshold (and something
running to move); destinations are instances above the high threshold that
are not terminating. The lowest-freeness source is paired with the
highest-freeness destination of the same migration group (model identity and
KV layout must match), then the next, repeatedly. A pair lasts until one side
leaves its band (source back at or above the low threshold, destination at or
below the high one), an instance disappears, the destination starts
terminating, or a terminating source has drained. The pairing command carries
the freeness target the source must reach (``PairingConfig.source_target``).

A terminating instance has freeness ``-inf`` (its fake request), so it is
always a source until it has drained. Ties break on instance id. Why a pair ends is
the wire's :class:`schemas.reasons.UnpairReason`, re-exported here. Pure code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from scheduler.config import PolicyConfig
from scheduler.policy.load import InstanceLoad, load_freeness
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


class PairDecision(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    source_id: str
    destination_id: str
    target_freeness: float
    source_freeness: float
    destination_freeness: float

    def to_event(self, epoch: int) -> Paired:
        return Paired(
            epoch=epoch,
            source_id=self.source_id,
            destination_id=self.destination_id,
            target_freeness=self.target_freeness,
            source_freeness=self.source_freeness,
            destination_freeness=self.destination_freeness,
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
    sources = sorted(
        (ld for ld in loads
         if ld.instance_id not in busy and freeness[ld.instance_id] < low and ld.num_running > 0),
        key=lambda ld: (freeness[ld.instance_id], ld.instance_id),
    )
    destinations = sorted(
        (ld for ld in loads
         if ld.instance_id not in busy and not ld.terminating and freeness[ld.instance_id] > high),
        key=lambda ld: (-freeness[ld.instance_id], ld.instance_id),
    )
    paired: list[PairDecision] = []
    for source in sources:
        match = next(
            (d for d in destinations if d.migration_group == source.migration_group), None
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
        ))
    return PairingPlan(unpaired=tuple(unpaired), kept=tuple(kept), paired=tuple(paired))

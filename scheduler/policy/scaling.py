"""Auto-scaling: keep the cluster's normal-usage freeness inside [min, max] (default [10, 60]).

The measure is the freeness of *normal* usage (physical blocks of running
requests: no headroom, no queued demand, no fake request) of the measured
instances taken together, ``(sum M - sum used) / sum B``, which is how
Llumnix's code averages (an idle instance does not swamp the mean). Terminating
instances and starting ones (joined, no load report yet) are left out.

* Below ``min_freeness`` for ``sustain_s``: scale up by one instance, unless
  launched instances have not joined yet (for up to ``launch_timeout_s``) or the
  cluster is at ``max_instances``.
* Above ``max_freeness`` for ``sustain_s``: scale down the instance with the
  fewest running requests (ties: fewer pending, then id), unless that would go
  below ``min_instances`` or ``max_concurrent_terminations`` are draining already.
* Fewer live instances than ``min_instances``: scale up at once.

The sustain timers live in :class:`ScalingState`, which the caller keeps and
passes back with the current time; the function reads no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from scheduler.config import ScalingConfig
from scheduler.policy.load import InstanceLoad
from schemas.decisions import ScaleDown, ScaleUp

__all__ = [
    "ScaleDownDecision",
    "ScaleUpDecision",
    "ScalingDecision",
    "ScalingState",
    "average_scaling_freeness",
    "decide_scaling",
]


class ScalingState(msgspec.Struct, frozen=True, kw_only=True):
    """Since when the average has been below / above the band, and the last scale-up."""

    below_since: float | None = None
    above_since: float | None = None
    launch_started_at: float | None = None


class ScaleUpDecision(msgspec.Struct, frozen=True, kw_only=True):
    num_instances: int
    average_freeness: float | None

    def to_event(self, epoch: int) -> ScaleUp:
        average = -1.0 if self.average_freeness is None else self.average_freeness
        return ScaleUp(epoch=epoch, num_instances=self.num_instances, average_freeness=average)


class ScaleDownDecision(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: str
    average_freeness: float

    def to_event(self, epoch: int) -> ScaleDown:
        return ScaleDown(epoch=epoch, instance_id=self.instance_id, average_freeness=self.average_freeness)


ScalingDecision = ScaleUpDecision | ScaleDownDecision


def average_scaling_freeness(loads: Sequence[InstanceLoad]) -> float | None:
    """Normal-usage freeness of the measured instances as one; None if none is measured."""
    total = used = batch = 0
    measured = False
    for load in loads:
        if load.terminating or not load.reported:
            continue
        measured = True
        total += load.num_total_blocks
        used += load.num_used_blocks
        batch += load.num_running
    if not measured:
        return None
    return (total - used) / (batch if batch > 0 else 1)


def decide_scaling(
    loads: Sequence[InstanceLoad],
    *,
    now: float,
    state: ScalingState,
    config: ScalingConfig,
    num_launching: int = 0,
) -> tuple[ScalingState, ScalingDecision | None]:
    """One evaluation of the scaling policy over the live instances (failed ones left out).

    ``num_launching`` counts instances asked for (``ScaleUp``) that have not joined.
    """
    active = [load for load in loads if not load.terminating]
    num_terminating = len(loads) - len(active)
    launch_started_at = state.launch_started_at
    if num_launching <= 0:
        launch_started_at = None
    elif launch_started_at is None:
        launch_started_at = now  # launching instances seen for the first time (e.g. after a restart)
    launching = launch_started_at is not None and now - launch_started_at < config.launch_timeout_s
    expected = len(active) + (num_launching if launching else 0)

    if expected < config.min_instances and not launching:
        decision = ScaleUpDecision(
            num_instances=config.min_instances - expected, average_freeness=average_scaling_freeness(loads)
        )
        return ScalingState(launch_started_at=now), decision

    average = average_scaling_freeness(loads)
    if average is None:
        return ScalingState(launch_started_at=launch_started_at), None

    if average < config.min_freeness:
        below_since = now if state.below_since is None else state.below_since
        if (
            now - below_since >= config.sustain_s
            and not launching
            and expected < config.max_instances
        ):
            return ScalingState(launch_started_at=now), ScaleUpDecision(
                num_instances=1, average_freeness=average
            )
        return ScalingState(below_since=below_since, launch_started_at=launch_started_at), None

    if average > config.max_freeness:
        above_since = now if state.above_since is None else state.above_since
        candidates = [load for load in active if load.reported]
        if (
            now - above_since >= config.sustain_s
            and num_terminating < config.max_concurrent_terminations
            and len(active) - 1 >= config.min_instances
            and candidates
        ):
            victim = min(candidates, key=lambda ld: (ld.num_running, ld.num_pending, ld.instance_id))
            return ScalingState(launch_started_at=launch_started_at), ScaleDownDecision(
                instance_id=victim.instance_id, average_freeness=average
            )
        return ScalingState(above_since=above_since, launch_started_at=launch_started_at), None

    return ScalingState(launch_started_at=launch_started_at), None

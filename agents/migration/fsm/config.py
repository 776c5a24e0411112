"""Frozen configuration of the two migration state machines: stage sizing and timeouts.

Pure data, validated on construction; the agents' shells and the simulator
pass one to every :func:`agents.migration.fsm.step`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["MIN_PACED_BLOCKS", "MigrationConfig", "short_of_memory"]

#: Stages of at most this many blocks are never paced (:meth:`MigrationConfig.paces`).
MIN_PACED_BLOCKS = 4


def short_of_memory(
    *, terminating: bool, num_waiting: int, num_free_blocks: int, expected_growth_blocks: int
) -> bool:
    """Whether an instance wants the memory a migration frees now, not in ten times the copy's
    time: it is leaving, requests wait there to be admitted, or its running requests are expected
    to need more blocks than are free as they decode (``LoadReport.expected_growth_blocks``)."""
    return terminating or num_waiting > 0 or expected_growth_blocks > num_free_blocks


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    """Stage sizing and timeouts of the migration state machines (seconds, block counts).

    A stage that leaves at most ``last_stage_max_blocks`` new full blocks makes
    the next stage the last one (suspend, copy the rest, commit); so does
    reaching ``max_stages``. After a stage of a paced size (:meth:`paces`) the
    last stage waits until a stage left no new full block: the blocks decoded
    during the slow copy go in a small unpaced catch-up stage, not in the
    suspended last one, so pacing does not lengthen the downtime. The
    destination gives up a reservation it has not heard about for
    ``destination_idle_timeout_s``: keep it well above the source's
    ``copy_timeout_s`` so blocks are never released under a running copy.

    ``copy_step_share`` (0 = off) decides nothing else in the machines (the source passes it
    on in ``PreAllocate``, for the destination's writes): the share of an engine step that each
    chunk of a stage copy may cost, the last stage excepted (see :mod:`agents.migration.pacing`);
    the simulator stretches a paced stage's copy time by ``1 / copy_step_share``. Off by
    default: at 0.1 co-located decode steps slow by about a tenth while a stage copies, but the
    copy takes about ten times as long, and the memory a migration frees comes that much later
    (the simulator's comparison: docs/simulation.md). Even when on, a source short of memory
    copies at full speed (:meth:`for_source`).
    """

    last_stage_max_blocks: int = 2
    max_stages: int = 8
    ack_timeout_s: float = 2.0
    copy_timeout_s: float = 30.0
    suspend_timeout_s: float = 2.0
    commit_timeout_s: float = 2.0
    claim_retry_s: float = 1.0
    destination_idle_timeout_s: float = 60.0
    #: Migrations one instance takes part in at once, as source and as destination each.
    max_concurrent_per_instance: int = 1
    #: Pace stage copies to this share of the engine's step time (0: copy at full speed).
    copy_step_share: float = 0.0

    def for_source(self, *, short_of_memory: bool) -> MigrationConfig:
        """This config for one migration out of a source (the agents and the simulator both ask
        at its start, with :func:`short_of_memory`): from a source that is short of memory the
        copies go at full speed (the memory is wanted now, and relief comes ten times sooner);
        otherwise they are paced, so decoding beside the copy hardly slows."""
        if self.copy_step_share > 0 and short_of_memory:
            return replace(self, copy_step_share=0.0)
        return self

    def paces(self, num_blocks: int) -> bool:
        """Whether a stage of ``num_blocks`` blocks is copied paced: pacing is on and the stage is
        bigger than a last stage is (``last_stage_max_blocks`` + the partial block) and than
        ``MIN_PACED_BLOCKS``. Smaller stages are cheap and go at once (so a catch-up stage
        before the suspend is quick, and the last stage stays small); so does the last stage,
        which the source knows. The destination, which does not, goes by this size rule alone
        (only a last stage forced by ``max_stages`` may be written paced), and so does the
        simulator."""
        threshold = max(self.last_stage_max_blocks + 1, MIN_PACED_BLOCKS)
        return self.copy_step_share > 0 and num_blocks > threshold

    def __post_init__(self) -> None:
        if self.last_stage_max_blocks < 0:
            raise ValueError("last_stage_max_blocks must be >= 0")
        if self.max_concurrent_per_instance < 1:
            raise ValueError("max_concurrent_per_instance must be >= 1")
        if not 0 <= self.copy_step_share <= 1:
            raise ValueError("copy_step_share must be in [0, 1]")
        if self.max_stages < 1:
            raise ValueError("max_stages must be >= 1")
        timeouts = (
            self.ack_timeout_s, self.copy_timeout_s, self.suspend_timeout_s,
            self.commit_timeout_s, self.claim_retry_s, self.destination_idle_timeout_s,
        )
        if any(t <= 0 for t in timeouts):
            raise ValueError("every timeout must be > 0")

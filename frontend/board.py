"""The frontend's own view of the cluster, for bypass placement and failure detection. Pure.

:class:`LoadBoard` folds instance lifecycle events and load reports with the
scheduler's own fold (:func:`scheduler.fold.evolve`), so in bypass mode the
frontend places requests with the same freeness code and the same
:func:`scheduler.policy.make_dispatcher` the scheduler uses (no migration).
On top of the fold it keeps what only a frontend knows:

* when it last heard from each instance (its own clock, passed in): an
  instance silent for ``stale_after`` seconds is not placed on, even before
  anyone declares it failed (the scheduler that would may be the one that is down);
* its own bypass placements that no report reflects yet (they count against
  the instance until its accepted-request counter passes them).

:meth:`LoadBoard.readiness` names each instance's state as placement sees it
(:class:`Readiness`): only a *ready* one — joined, reported load, heard from
lately, neither terminating nor failed — is ever placed on, so ``/health`` is
honest by answering from it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from scheduler.cluster_state import ClusterState, InstanceStatus, initial_state
from scheduler.config import PolicyConfig
from scheduler.fold import evolve
from scheduler.policy import DispatchDecision, InstanceLoad, PendingRequest, make_dispatcher
from schemas import InstanceFailed, InstanceJoined, InstanceLeft, InstanceTerminating, LoadReport
from schemas.envelope import Body
from schemas.position import Position

__all__ = ["LoadBoard", "Readiness"]

_FOLDED = (InstanceJoined, InstanceFailed, InstanceLeft, InstanceTerminating, LoadReport)


class Readiness(enum.StrEnum):
    """An instance's state as this frontend's placement sees it."""

    JOINED = "joined"  # announced itself, no load report yet: not placed on
    READY = "ready"  # placed on
    SILENT = "silent"  # reported once, quiet for more than ``stale_after``: likely dead
    TERMINATING = "terminating"  # draining: takes no new requests
    FAILED = "failed"  # declared failed


class LoadBoard:
    """Instances, their loads and liveness as this frontend sees them. See the module docstring."""

    def __init__(
        self, *, policy: str = "freeness", config: PolicyConfig | None = None, stale_after: float = 3.0
    ) -> None:
        self._config = config or PolicyConfig()
        self._dispatcher = make_dispatcher(policy, self._config)
        self.state: ClusterState = initial_state()
        self.stale_after = stale_after
        self._heard: dict[str, float] = {}
        self._accepted_at_placement: dict[str, list[tuple[int, int]]] = {}
        self.num_bypass_placements = 0

    # -- folding -----------------------------------------------------------
    def observe(self, position: Position, body: Body, now: float) -> None:
        """Fold one event or load report read at ``position`` (received at ``now``)."""
        if not isinstance(body, _FOLDED):
            return
        if position.seq <= self.state.positions.get(position.stream, 0):
            return
        self.state = evolve(self.state, position, body)
        instance_id = body.instance_id
        if isinstance(body, LoadReport | InstanceJoined):
            self._heard[instance_id] = now
        if isinstance(body, LoadReport):
            placed = self._accepted_at_placement.get(instance_id)
            if placed:
                self._accepted_at_placement[instance_id] = [
                    (count, blocks) for count, blocks in placed if count > body.num_accepted
                ]
        elif isinstance(body, InstanceFailed | InstanceLeft | InstanceJoined):  # gone, or a new incarnation
            self._accepted_at_placement.pop(instance_id, None)

    # -- queries -----------------------------------------------------------
    def is_failed(self, instance_id: str) -> bool:
        record = self.state.instances.get(instance_id)
        return record is not None and record.status is InstanceStatus.FAILED

    def is_alive(self, instance_id: str, now: float) -> bool:
        """Known, not failed or gone, and heard from within ``stale_after``."""
        record = self.state.instances.get(instance_id)
        if record is None or record.status is InstanceStatus.FAILED:
            return False
        return now - self._heard.get(instance_id, -1e18) <= self.stale_after

    def is_silent(self, instance_id: str, now: float) -> bool:
        """Known and once heard from, but silent for more than ``stale_after`` (likely dead)."""
        heard = self._heard.get(instance_id)
        return heard is not None and instance_id in self.state.instances and now - heard > self.stale_after

    def readiness(self, instance_id: str, now: float) -> Readiness | None:
        """The instance's :class:`Readiness` (None: unknown or gone). READY iff :meth:`choose` may pick it."""
        record = self.state.instances.get(instance_id)
        if record is None:
            return None
        if record.status is InstanceStatus.FAILED:
            return Readiness.FAILED
        if record.status is InstanceStatus.TERMINATING or record.load.terminating:
            return Readiness.TERMINATING
        if not self.is_alive(instance_id, now):
            return Readiness.SILENT
        return Readiness.READY if record.load.reported else Readiness.JOINED

    def readiness_view(self, now: float) -> dict[str, Readiness]:
        """Every known instance's :class:`Readiness`, by instance id."""
        view = {i: self.readiness(i, now) for i in sorted(self.state.instances, key=str)}
        return {i: r for i, r in view.items() if r is not None}

    def ready_instance_ids(self, now: float) -> list[str]:
        """Instances a request would be placed on now (in id order)."""
        return [i for i, r in self.readiness_view(now).items() if r is Readiness.READY]

    def live_instance_ids(self, now: float) -> list[str]:
        return sorted((i for i in self.state.instances if self.is_alive(i, now)), key=str)

    def max_model_len(self, default: int) -> int:
        """The smallest context any live instance announced (``default`` if none did)."""
        lengths = [
            r.joined.max_model_len for r in self.state.instances.values()
            if r.status is not InstanceStatus.FAILED
        ]
        return min(lengths) if lengths else default

    def loads(self, now: float) -> list[InstanceLoad]:
        """Views of live instances that reported load, this frontend's unreflected placements counted.

        An instance that joined but never reported is left out: nothing is placed
        on it (and ``/health`` does not count it) until its engine says it runs.
        """
        views: list[InstanceLoad] = []
        for instance_id in self.live_instance_ids(now):
            view = self.state.instances[instance_id].load
            if not view.reported:
                continue
            for _, blocks in self._accepted_at_placement.get(instance_id, ()):
                view = view.with_dispatch(blocks)
            views.append(view)
        return views

    # -- placement ---------------------------------------------------------
    def choose(
        self,
        request_id: str,
        num_prompt_tokens: int,
        *,
        priority: int = 0,
        exclude: Iterable[str] = (),
        now: float,
    ) -> DispatchDecision | None:
        """Where bypass mode would place a request (None: no live instance can take it)."""
        pending = PendingRequest(
            request_id=request_id, num_prompt_tokens=num_prompt_tokens, priority=priority,
            exclude=tuple(exclude),
        )
        return self._dispatcher.choose(pending, self.loads(now), num_dispatched=self.num_bypass_placements)

    def record_placement(self, instance_id: str, num_blocks: int) -> None:
        """Count a bypass placement against the instance until its reports reflect it."""
        self.num_bypass_placements += 1
        record = self.state.instances.get(instance_id)
        accepted = record.load.num_accepted if record is not None else 0
        self._accepted_at_placement.setdefault(instance_id, []).append((accepted + 1, num_blocks))

"""Request selection on a migration source: which running requests to send, in what order.

The source agent of a pair migrates requests until its own freeness reaches the
pair's target. Candidates go lower priority first (a *larger* priority value,
since lower values run sooner as in vLLM), then shorter sequences (cheaper and
quicker to move), then request id. Each removed request takes its blocks, its
share of its class's headroom (the whole headroom once its class has no running
request left) and one batch slot with it. A terminating instance never reaches
a target (its freeness is ``-inf``), so everything is selected. Pure code.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from scheduler.config import PolicyConfig, PriorityClass
from scheduler.policy.virtual_usage import RunningRequest, freeness

__all__ = ["migration_order_key", "select_requests_to_migrate"]


def migration_order_key(request: RunningRequest) -> tuple[int, int, str]:
    """Lower priority (larger value) first, then shorter sequence, then request id."""
    return (-request.priority, request.num_tokens, request.request_id)


def select_requests_to_migrate(
    running: Sequence[RunningRequest],
    *,
    num_total_blocks: int,
    head_of_line_demand: int,
    target_freeness: float,
    config: PolicyConfig,
    terminating: bool = False,
    num_reserved_blocks: int = 0,
    exclude: Collection[str] = (),
    max_requests: int | None = None,
    room_blocks: int = -1,
    margin_blocks: int = 0,
) -> tuple[RunningRequest, ...]:
    """The requests to migrate, in order, until the source's freeness reaches ``target_freeness``.

    ``running`` is every running request (they all count in the usage);
    ``exclude`` names those that may not be chosen (e.g. already migrating).
    ``room_blocks`` (``-1``: unchecked) is what the destination can still take: a
    request is chosen only if its blocks plus ``margin_blocks`` fit in what is left.
    Returns an empty tuple if the source is already at or above the target.
    """
    physical = sum(r.num_blocks for r in running) + head_of_line_demand + num_reserved_blocks
    class_counts: dict[str, int] = {}
    classes: dict[str, PriorityClass] = {}
    for request in running:
        cls = config.priority_class(request.priority)
        classes[cls.name] = cls
        class_counts[cls.name] = class_counts.get(cls.name, 0) + 1
    headroom = sum(classes[name].headroom_blocks for name in class_counts)
    batch = len(running)

    def current() -> float:
        if terminating:
            return -float("inf")
        return freeness(num_total_blocks, float(physical + headroom), batch)

    chosen: list[RunningRequest] = []
    limit = len(running) if max_requests is None else max_requests
    for request in sorted((r for r in running if r.request_id not in exclude), key=migration_order_key):
        if current() >= target_freeness or len(chosen) >= limit:
            break
        if room_blocks >= 0:
            if request.num_blocks + margin_blocks > room_blocks:
                continue
            room_blocks -= request.num_blocks + margin_blocks
        chosen.append(request)
        physical -= request.num_blocks
        batch -= 1
        cls = config.priority_class(request.priority)
        class_counts[cls.name] -= 1
        if class_counts[cls.name] == 0:
            headroom -= cls.headroom_blocks
    return tuple(chosen)

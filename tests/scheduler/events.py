"""Builders of schema events shared by the scheduler tests."""

from __future__ import annotations

from schemas.instance import InstanceJoined, KVLayout, ModelIdentity
from schemas.load import LoadReport, PriorityLoad

EVENTS = "shoal_events"
LOADS = "shoal_loads"

MODEL = ModelIdentity(model_id="tiny", revision="r1")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")


def joined(instance_id: str, num_blocks: int = 1000, *, model: str = "tiny") -> InstanceJoined:
    return InstanceJoined(
        instance_id=instance_id, num_blocks=num_blocks, block_size=16,
        model=ModelIdentity(model_id=model, revision="r1"), kv_layout=LAYOUT,
        transport_address=f"tcp://127.0.0.1/{instance_id}",
    )


def report(
    instance_id: str,
    seq: int,
    *,
    running: tuple[tuple[int, int, int], ...] = (),
    accepted: int = 0,
    hol: int = 0,
    waiting: int = 0,
    total: int = 1000,
    terminating: bool = False,
) -> LoadReport:
    """A load report; ``running`` holds ``(priority, num_running, num_blocks)``."""
    groups = tuple(PriorityLoad(priority=p, num_running=n, num_blocks=b) for p, n, b in running)
    used = sum(b for _, _, b in running)
    return LoadReport(
        instance_id=instance_id, seq=seq, num_total_blocks=total, num_free_blocks=total - used,
        num_reserved_blocks=0, running=groups, head_of_line_demand=hol, num_waiting=waiting,
        batch_size=sum(n for _, n, _ in running), freeness=0.0, virtual_usage=0.0, num_accepted=accepted,
        terminating=terminating,
    )

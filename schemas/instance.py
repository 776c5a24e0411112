"""Instance lifecycle events: joined, heartbeat, terminating, left, failed.

Appended by agents (and by the scheduler for ``InstanceFailed``) on
``<prefix>.ev.instance.<instance_id>``.
"""

from __future__ import annotations

from schemas.base import Message
from schemas.reasons import FailureReason, TerminateReason

__all__ = [
    "FailureInputs",
    "InstanceEvent",
    "InstanceFailed",
    "InstanceHeartbeat",
    "InstanceJoined",
    "InstanceLeft",
    "InstanceTerminating",
    "KVLayout",
    "ModelIdentity",
]


class ModelIdentity(Message, frozen=True, kw_only=True, tag="model"):
    """What must match for two instances to exchange KV cache."""

    model_id: str
    revision: str = ""
    dtype: str = "float32"
    tensor_parallel: int = 1


class KVLayout(Message, frozen=True, kw_only=True, tag="kv_layout"):
    """Shape of one KV block, so a destination can check a buffer fits."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str


class InstanceJoined(Message, frozen=True, kw_only=True, tag="instance_joined"):
    """An instance is up. ``transport_address`` is where peers send it KV buffers (its advertised
    host); ``transport_kind`` the KV transport it speaks (``tcp``, ``ucx``, ``inproc``; empty from
    agents before it existed: read from the address's scheme)."""

    instance_id: str
    num_blocks: int
    block_size: int
    model: ModelIdentity
    kv_layout: KVLayout
    transport_address: str
    engine: str = "torch"
    max_batch_size: int = 256
    max_model_len: int = 4096
    transport_kind: str = ""


class InstanceHeartbeat(Message, frozen=True, kw_only=True, tag="instance_heartbeat"):
    instance_id: str
    seq: int


class InstanceTerminating(Message, frozen=True, kw_only=True, tag="instance_terminating"):
    instance_id: str
    reason: TerminateReason = TerminateReason.SCALE_DOWN


class InstanceLeft(Message, frozen=True, kw_only=True, tag="instance_left"):
    instance_id: str


class FailureInputs(Message, frozen=True, kw_only=True, tag="failure_inputs"):
    """What the scheduler's failure detection read: its clock (monotonic seconds) now and when
    it last heard from the instance, the timeout, and the loads-stream sequence of the last
    report it had received from it (0: none since it joined)."""

    clock: float
    last_seen: float
    timeout_s: float
    last_report_seq: int = 0


class InstanceFailed(Message, frozen=True, kw_only=True, tag="instance_failed"):
    instance_id: str
    reason: FailureReason
    detail: str = ""
    last_heartbeat: float = 0.0
    epoch: int = 0
    #: Set by the scheduler's detection (None from others, and in logs of schema version 2).
    inputs: FailureInputs | None = None
    #: The incarnation judged failed: the events-stream sequence of its ``InstanceJoined`` (an agent
    #: restarted under the same id is a new incarnation, which this failure does not concern);
    #: 0: whichever incarnation is current (from others, and in older logs).
    incarnation: int = 0


InstanceEvent = (
    InstanceJoined | InstanceHeartbeat | InstanceTerminating | InstanceLeft | InstanceFailed
)

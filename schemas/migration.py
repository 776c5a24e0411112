"""The live-migration handshake between a source and a destination agent.

``PRE-ALLOCATE → ACK | ABORT``, then per stage ``StageDone``, then ``COMMIT →
COMMIT-ACK``. The same messages travel as request/reply on
``<prefix>.rpc.mig.<instance_id>`` and are appended, with agent-side event
times, to ``<prefix>.ev.mig.<migration_id>`` so a migration can be replayed and
timed afterwards. The destination's ``CommitAck`` in the log decides who owns
the request if the reply is lost.
"""

from __future__ import annotations

from schemas.base import Message
from schemas.reasons import MigrationAbortReason
from schemas.rpc import SamplingParams

__all__ = [
    "Abort",
    "Ack",
    "Commit",
    "CommitAck",
    "MigrationEvent",
    "MigrationMessage",
    "PreAllocate",
    "StageDone",
    "StageWritten",
]


class PreAllocate(Message, frozen=True, kw_only=True, tag="mig_pre_allocate"):
    migration_id: str
    request_id: str
    source_id: str
    destination_id: str
    stage: int
    num_blocks: int


class Ack(Message, frozen=True, kw_only=True, tag="mig_ack"):
    migration_id: str
    stage: int
    block_ids: tuple[int, ...]


class Abort(Message, frozen=True, kw_only=True, tag="mig_abort"):
    """Either side gives the migration up; ``detail`` is for people, ``reason`` for decisions."""

    migration_id: str
    reason: MigrationAbortReason
    sender_id: str = ""
    detail: str = ""


class StageDone(Message, frozen=True, kw_only=True, tag="mig_stage_done"):
    migration_id: str
    stage: int
    num_blocks: int
    num_bytes: int
    duration_s: float
    last: bool = False


class StageWritten(Message, frozen=True, kw_only=True, tag="mig_stage_written"):
    """Destination → source: a stage's data is in its reserved blocks (the transport only says it landed).

    The source counts a stage as copied only after this, so the destination's
    write of a big stage overlaps the source's decoding instead of the downtime.
    The state machines never see it; the agents' shells do.
    """

    migration_id: str
    stage: int


class Commit(Message, frozen=True, kw_only=True, tag="mig_commit"):
    """Sent after the last stage. Carries what the destination needs to resume."""

    migration_id: str
    request_id: str
    source_id: str
    destination_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    owner_epoch: int
    suspended_at: float
    #: How the destination continues the request (defaults keep older senders decodable).
    sampling: SamplingParams = SamplingParams()
    priority: int = 0
    stream: bool = True
    #: ``GenerateRequest.delta_subject`` of the request: the destination publishes there too.
    delta_subject: str | None = None


class CommitAck(Message, frozen=True, kw_only=True, tag="mig_commit_ack"):
    migration_id: str
    request_id: str
    destination_id: str
    owner_epoch: int
    resumed_at: float


MigrationMessage = PreAllocate | Ack | Abort | StageDone | StageWritten | Commit | CommitAck
MigrationEvent = MigrationMessage

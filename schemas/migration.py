"""The live-migration handshake between a source and a destination agent.

``PRE-ALLOCATE → ACK | ABORT``, then per stage ``StageDone``, then ``COMMIT →
COMMIT-ACK``. The same messages travel as request/reply on
``<prefix>.rpc.mig.<instance_id>`` and are appended, with agent-side event
times, to ``<prefix>.ev.mig.<migration_id>`` so a migration can be replayed and
timed afterwards. The destination's ``CommitAck`` in the log decides who owns
the request if the reply is lost. Before its first message the source appends
``MigrationStarted`` (log only, not a handshake message): why it started.

Deduplication against the destination's prefix cache is decided at the handshake: the
first ``PreAllocate`` carries the chain hashes of the request's full blocks
(:mod:`schemas.block_hash`), the destination's stage-0 ``Ack`` says how many leading blocks
of that chain it already caches (it holds them from then until commit or abort), and only
the rest is copied. Either field left at its default (an older peer) copies everything.
"""

from __future__ import annotations

from schemas.base import Message
from schemas.reasons import MigrationAbortReason, MigrationCause
from schemas.rpc import SamplingParams

__all__ = [
    "Abort",
    "Ack",
    "Commit",
    "CommitAck",
    "HurryCopy",
    "MigrationEvent",
    "MigrationMessage",
    "MigrationStarted",
    "PreAllocate",
    "StageDone",
    "StageWritten",
]


class PreAllocate(Message, frozen=True, kw_only=True, tag="mig_pre_allocate"):
    """Reserve a stage's blocks. ``copy_step_share`` is the source's pacing of this migration
    (``MigrationConfig.copy_step_share``; 0: full speed, as a draining source copies), which the
    destination's paced writes follow; None (older sources) leaves the destination's own.

    ``block_hashes`` (stage 0 only): the chain hashes of the request's full blocks, first block
    first. The destination holds the leading run of them it caches instead of reserving blocks
    for it (``Ack.num_cached_blocks``); empty (older sources, nothing full yet): no dedup.
    They travel to the destination only: the event log's copy leaves them out."""

    migration_id: str
    request_id: str
    source_id: str
    destination_id: str
    stage: int
    num_blocks: int
    copy_step_share: float | None = None
    block_hashes: tuple[int, ...] = ()


class Ack(Message, frozen=True, kw_only=True, tag="mig_ack"):
    """The destination reserved the stage's blocks. ``transfer_token`` is the unguessable,
    single-use token the KV buffer of this stage must carry (the destination's transport
    refuses any other); it travels only to the source and is blanked in the event log.

    ``num_cached_blocks`` (stage 0 only): how many leading blocks of the request (of
    ``PreAllocate.block_hashes``) the destination already caches and holds for it until commit
    or abort; they are not copied, and ``block_ids`` are for the stage's other blocks. 0 (older
    destinations, no hit): the whole stage is copied."""

    migration_id: str
    stage: int
    block_ids: tuple[int, ...]
    transfer_token: str = ""
    num_cached_blocks: int = 0


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


class HurryCopy(Message, frozen=True, kw_only=True, tag="mig_hurry_copy"):
    """Either side → the other: copy the rest of this migration at full speed, no longer paced
    (``MigrationConfig.copy_step_share``). ``reason``: ``short_of_memory`` (the source wants the
    memory now) or ``slot_wanted`` (another migration waits for the sender's slot). Pacing only:
    the state machines never see it; the agents' shells do."""

    migration_id: str
    sender_id: str
    reason: str = ""


MigrationMessage = PreAllocate | Ack | Abort | StageDone | StageWritten | HurryCopy | Commit | CommitAck


class MigrationStarted(Message, frozen=True, kw_only=True, tag="mig_started"):
    """Why the source started this migration (appended to the log before ``PreAllocate``).

    With ``PAIRING``/``DRAIN``: the ``MigrateOut`` command's lease epoch and target freeness, and
    the source's own freeness when it chose the request (lower priority first, then shorter)."""

    migration_id: str
    request_id: str
    source_id: str
    destination_id: str
    cause: MigrationCause
    epoch: int = 0
    target_freeness: float | None = None
    source_freeness: float | None = None


MigrationEvent = MigrationMessage | MigrationStarted

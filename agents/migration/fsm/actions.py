"""What the two migration state machines share: local inputs and the actions they emit.

The wire messages (``PreAllocate``, ``Ack``, ``Abort``, ``StageDone``,
``Commit``, ``CommitAck``) come from :mod:`schemas.migration`. The *local*
inputs below are what the agent shell feeds a machine besides them: the clock
(:class:`Tick`), its engine (:class:`Suspended`, :class:`RequestGone`), its
transport (:class:`CopyDone`, :class:`CopyFailed`), its block manager
(:class:`Reserved`, :class:`ReserveFailed`), the destination's receiving
transport (:class:`BlocksReceived`), failure detection
(:class:`PeerFailed`) and the event log (:class:`OutcomeClaimed`).

Actions are plain data the shell executes, in order:

* :class:`SendToPeer` — send the message to the peer agent and append it to
  the migration's log subject; :class:`SendCommit` — the same for the
  ``Commit``, which the shell fills in (token ids, owner epoch, suspend time);
* :class:`CopyBlocks` / :class:`CancelCopy` — transport work on the source.
  :class:`CopyDone` must mean *delivered and written* at the destination:
  the destination's transport asks its machine first (:class:`BlocksReceived`)
  and writes the data only on :class:`WriteBlocks` (into blocks still reserved
  for that stage), or drops it on :class:`RejectBlocks`, which the source sees
  as :class:`CopyFailed`. So a late copy never lands in released blocks;
* :class:`Suspend` (drain the request from the batch at the next step
  boundary, then report :class:`Suspended`), :class:`ResumeOnSource` (cancel
  the suspend or put the request back in the batch), :class:`FreeSourceBlocks`;
* :class:`Reserve` (answer with :class:`Reserved` / :class:`ReserveFailed`
  *before* feeding anything else to that machine), :class:`ReleaseReservation`,
  :class:`AdmitRequest` — the destination's block manager and engine. Stage 0's
  ``Reserve`` carries the request's block hashes: the blocks its prefix cache
  already holds are referenced (``Reserved.cached_block_ids``) instead of copied,
  until ``AdmitRequest`` hands them to the request or ``ReleaseReservation`` drops them;
* :class:`ClaimOutcome` — append the outcome event (the destination's
  ``CommitAck`` or the source's ``Abort``) to the migration's log subject
  *unless an outcome is already there* (JetStream's expected-last-subject-
  sequence), then answer :class:`OutcomeClaimed` with the outcome the log
  holds. The first outcome in the log decides who owns the request;
* :class:`ReportMigrated` / :class:`ReportFailed` — the machine reached its end.

Every reason is a :class:`~schemas.reasons.MigrationAbortReason` member, with
an optional ``detail`` sentence for people. Pure data; no I/O.
"""

from __future__ import annotations

import msgspec

from schemas.migration import Abort, Commit, CommitAck, MigrationMessage
from schemas.reasons import MigrationAbortReason

__all__ = [
    "Action",
    "AdmitRequest",
    "BlocksReceived",
    "CancelCopy",
    "ClaimOutcome",
    "CopyBlocks",
    "CopyDone",
    "CopyFailed",
    "FreeSourceBlocks",
    "LocalEvent",
    "OutcomeClaimed",
    "PeerFailed",
    "RejectBlocks",
    "ReleaseReservation",
    "ReportFailed",
    "ReportMigrated",
    "RequestGone",
    "Reserve",
    "ReserveFailed",
    "Reserved",
    "ResumeOnSource",
    "SendCommit",
    "SendToPeer",
    "Suspend",
    "Suspended",
    "Tick",
    "WriteBlocks",
]


# -- local inputs ---------------------------------------------------------------


class Tick(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Time passed; a machine past its deadline times out."""


class CopyDone(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The source's transport finished copying a stage; ``num_full_blocks`` is the
    request's count of full (unchanging) blocks now."""

    stage: int
    num_full_blocks: int
    num_bytes: int = 0
    duration_s: float = 0.0


class CopyFailed(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A stage's copy failed: ``COPY_FAILED``, or ``REQUEST_FINISHED`` / ``REQUEST_PREEMPTED``
    when the request lost its blocks under the copy."""

    stage: int
    reason: MigrationAbortReason
    detail: str = ""


class Suspended(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The engine drained the request from its batch; ``num_blocks`` is its final block count."""

    num_blocks: int


class RequestGone(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The request finished, was preempted or aborted on the source (``REQUEST_*``)."""

    reason: MigrationAbortReason


class PeerFailed(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Failure detection says the other agent is gone."""


class OutcomeClaimed(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The outcome the log holds for this migration after a :class:`ClaimOutcome`."""

    committed: bool


class Reserved(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The stage's blocks are reserved. ``cached_block_ids`` (stage 0): the request's leading
    blocks the destination's prefix cache already held, now referenced for it (not copied)."""

    stage: int
    block_ids: tuple[int, ...]
    cached_block_ids: tuple[int, ...] = ()


class ReserveFailed(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``OUT_OF_BLOCKS``, ``TOO_MANY_INCOMING`` or ``DESTINATION_TERMINATING``."""

    stage: int
    reason: MigrationAbortReason
    detail: str = ""


class BlocksReceived(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The destination's transport holds a stage's data and asks where it may go."""

    stage: int


LocalEvent = (
    Tick | CopyDone | CopyFailed | Suspended | RequestGone | PeerFailed | OutcomeClaimed
    | Reserved | ReserveFailed | BlocksReceived
)


# -- actions --------------------------------------------------------------------


class SendToPeer(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    message: MigrationMessage


class SendCommit(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Build the ``Commit`` (token ids, prompt length, owner epoch, suspend time), send and log it."""

    migration_id: str


class CopyBlocks(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Copy the request's blocks ``[first_block, end_block)`` into the destination's ``block_ids``."""

    stage: int
    first_block: int
    end_block: int
    destination_block_ids: tuple[int, ...]


class CancelCopy(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    stage: int


class Suspend(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    pass


class ResumeOnSource(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    pass


class FreeSourceBlocks(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    pass


class Reserve(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Reserve the stage's ``num_blocks``; with ``block_hashes`` (stage 0) first take a reference
    to the leading run of them the prefix cache holds and reserve only the rest."""

    stage: int
    num_blocks: int
    block_hashes: tuple[int, ...] = ()


class ReleaseReservation(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Release the reserved ``block_ids`` and drop the references held on ``cached_block_ids``."""

    block_ids: tuple[int, ...]
    cached_block_ids: tuple[int, ...] = ()


class WriteBlocks(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Write the received stage into these reserved blocks, then confirm delivery to the source.

    Execute it before feeding the machine anything else, so no release can
    happen in between.
    """

    stage: int
    block_ids: tuple[int, ...]


class RejectBlocks(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Drop the received stage and report the transfer failed to the source."""

    stage: int
    reason: MigrationAbortReason
    detail: str = ""


class AdmitRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Admit the migrated request into the running batch: its block table is the held cached
    blocks ``cached_block_ids`` (their references become the request's), then the reserved
    ``block_ids``.

    Publish its tokens with owner epoch ``commit.owner_epoch + 1``.
    """

    commit: Commit
    block_ids: tuple[int, ...]
    cached_block_ids: tuple[int, ...] = ()


class ClaimOutcome(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    outcome: CommitAck | Abort


class ReportMigrated(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    pass


class ReportFailed(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    reason: MigrationAbortReason
    detail: str = ""


Action = (
    SendToPeer | SendCommit | CopyBlocks | CancelCopy | Suspend | ResumeOnSource | FreeSourceBlocks
    | Reserve | ReleaseReservation | WriteBlocks | RejectBlocks | AdmitRequest | ClaimOutcome
    | ReportMigrated | ReportFailed
)

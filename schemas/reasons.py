"""Why things end: every rejection, abort, close, failure and finish reason that crosses the bus.

Each is an ``enum.StrEnum``, so a member is its value in logs, JSON and
Prometheus labels, and msgspec encodes it as that string and decodes it back to
the member; a value no member has is a malformed message (``WrongType``).
Components decide on members (``reason is RejectReason.EXCEEDS_MODEL_CONTEXT``,
a lookup table keyed by member), never on text. A message that carries a
reason may also carry a ``detail: str``: a sentence for people and logs, never
for decisions.

Here: the enums. Not here: the messages that carry them (one module per
protocol), what a component does about each reason (next to the component).
"""

from __future__ import annotations

import enum

__all__ = [
    "BypassReason",
    "CloseReason",
    "CommandRejectReason",
    "DispatchFailReason",
    "FailureReason",
    "FinishReason",
    "MigrationAbortReason",
    "MigrationCause",
    "RejectReason",
    "RpcErrorCode",
    "TerminateReason",
    "UnpairReason",
]


class RejectReason(enum.StrEnum):
    """Why an agent refused a ``GenerateRequest`` (``GenerateReply.reason``).

    The first five are the engine's (``add_request`` raises ``RequestRejected``
    with one of them; the engine layer uses this very enum); the rest are the
    agent's own.
    """

    EMPTY_PROMPT = "empty_prompt"
    TOKEN_OUT_OF_RANGE = "token_out_of_range"
    EXCEEDS_MODEL_CONTEXT = "exceeds_model_context"  # prompt longer than max_model_len
    EXCEEDS_CAPACITY = "exceeds_capacity"  # prompt needs more blocks than the instance has
    INVALID_SAMPLING = "invalid_sampling"  # max_tokens <= 0, min_tokens < 0, ...
    TERMINATING = "terminating"  # the instance is draining: it takes no new request
    ABORTED = "aborted"  # an abort for it came first (its frontend gave up on this instance)


class FinishReason(enum.StrEnum):
    """How a request's generation ended (OpenAI's ``finish_reason``; ``TokenDelta.finish_reason``)."""

    STOP = "stop"  # EOS, a stop token or (in the frontend) a stop string
    LENGTH = "length"  # max_tokens, the model's context, the instance's capacity or a deadline
    ABORT = "abort"  # aborted on the instance, or lost in a migration that could not be admitted


class CloseReason(enum.StrEnum):
    """Why the frontend closed a request's stream (``AbortRequest.reason``, ``RequestAborted.reason``)."""

    FINISHED = "finished"  # the instance finished it; nothing to abort
    STOP_STRING = "stop_string"  # the frontend saw a stop string and ended it early
    CLIENT = "client"  # the client went away, or the response could not be completed
    DEADLINE = "deadline"  # the frontend's request deadline passed
    RESCUED = "rescued"  # the request moved to another instance; the old owner stops
    UNPLACED = "unplaced"  # no instance took the request
    NO_INSTANCE = "no_instance"  # its instance failed and no other took it within the rescue timeout
    SHUTDOWN = "shutdown"  # the frontend is stopping


class MigrationAbortReason(enum.StrEnum):
    """Why a live migration did not happen (``Abort.reason``, the source's outcome, the shells' inputs).

    Grouped by where the reason arises; the source reports the destination's
    reason as its own when the destination aborts.
    """

    # the destination cannot take the request
    OUT_OF_BLOCKS = "out_of_blocks"
    TOO_MANY_INCOMING = "too_many_incoming"
    DESTINATION_TERMINATING = "destination_terminating"
    # the request changed on the source
    REQUEST_FINISHED = "request_finished"
    REQUEST_PREEMPTED = "request_preempted"
    REQUEST_ABORTED = "request_aborted"
    REQUEST_STARTED = "request_started"  # a queued request being moved (no KV) started running first
    # the data path
    COPY_FAILED = "copy_failed"  # the engine or the transport failed a stage's copy
    BAD_ACK = "bad_ack"  # the destination reserved a different number of blocks than asked
    STAGE_NOT_RESERVED = "stage_not_reserved"  # landed data with no reservation to go into
    # a phase ran past its deadline (``MigrationConfig``'s timeouts)
    ACK_TIMEOUT = "ack_timeout"
    COPY_TIMEOUT = "copy_timeout"
    SUSPEND_TIMEOUT = "suspend_timeout"
    COMMIT_TIMEOUT = "commit_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    # the other side or the log
    PEER_FAILED = "peer_failed"
    CLAIM_LOST = "claim_lost"  # the log holds the other side's outcome first
    UNKNOWN_MIGRATION = "unknown_migration"
    # refused before it started (source side only)
    SAME_INSTANCE = "same_instance"
    UNKNOWN_DESTINATION = "unknown_destination"
    INCOMPATIBLE = "incompatible"  # model identity or KV layout differ
    TOO_MANY_OUTGOING = "too_many_outgoing"
    ALREADY_MIGRATING = "already_migrating"
    NOT_RUNNING = "not_running"
    NOT_MIGRATABLE = "not_migratable"  # the engine cannot move it faithfully (e.g. seeded sampling on vLLM)
    CANCELLED = "cancelled"  # the agent stopped before the migration ended


class DispatchFailReason(enum.StrEnum):
    """Why the scheduler placed no request (``DispatchReply.reason``)."""

    NOT_ACTIVE = "not_active"  # this scheduler is a standby or its lease lapsed
    NO_INSTANCE = "no_instance"  # no live instance can take the request
    MALFORMED_REQUEST = "malformed_request"


class BypassReason(enum.StrEnum):
    """Why a frontend placed a request itself instead of where the scheduler said
    (``RequestPlaced.bypass_reason``)."""

    SCHEDULER_QUIET = "scheduler_quiet"  # a dispatch timed out recently: not asking for a while
    SCHEDULER_TIMEOUT = "scheduler_timeout"  # the dispatch request timed out
    SCHEDULER_UNREACHABLE = "scheduler_unreachable"  # no scheduler answered (no responders, bus down)
    SCHEDULER_REFUSED = "scheduler_refused"  # it answered without an instance (detail: its reason)
    SCHEDULER_EXCLUDED = "scheduler_excluded"  # it chose an instance this placement excludes
    MALFORMED_REPLY = "malformed_reply"


class MigrationCause(enum.StrEnum):
    """Why a source agent started migrating a request (``MigrationStarted.cause``)."""

    PAIRING = "pairing"  # the scheduler's ``MigrateOut`` for a pairing: freeness below the band
    DRAIN = "drain"  # the instance is terminating (scale-down): every request leaves
    REQUEUE = "requeue"  # the scheduler's ``MoveQueued``: a queued request moves (no KV) off a stalled queue
    REQUESTED = "requested"  # asked directly (``Agent.migrate``, tests, operators)


class CommandRejectReason(enum.StrEnum):
    """Why an agent refused a scheduler command or a resend (``CommandReply.reason``)."""

    STALE_EPOCH = "stale_epoch"
    UNKNOWN_REQUEST = "unknown_request"
    UNKNOWN_DESTINATION = "unknown_destination"
    INCOMPATIBLE = "incompatible"
    MIGRATION_REFUSED = "migration_refused"  # a ``MoveQueued`` the source could not start (see detail)


class UnpairReason(enum.StrEnum):
    """Why the scheduler ended a migration pair (``Unpaired.reason``)."""

    SOURCE_RECOVERED = "source_recovered"
    DESTINATION_FILLED = "destination_filled"
    SOURCE_GONE = "source_gone"
    DESTINATION_GONE = "destination_gone"
    DESTINATION_TERMINATING = "destination_terminating"
    SOURCE_DRAINED = "source_drained"


class FailureReason(enum.StrEnum):
    """Why the scheduler declared an instance failed (``InstanceFailed.reason``)."""

    NO_LOAD_REPORT = "no_load_report"  # silent for longer than the failure timeout


class TerminateReason(enum.StrEnum):
    """Why an instance started terminating (``InstanceTerminating.reason``)."""

    SCALE_DOWN = "scale_down"  # the scheduler's ``Drain`` command
    STOP_SIGNAL = "stop_signal"  # the agent process got SIGTERM (an operator, a rolling restart)


class RpcErrorCode(enum.StrEnum):
    """What went wrong with an RPC (``RpcError.code``)."""

    BAD_REQUEST = "bad_request"  # the request was not the message the subject expects
    MALFORMED = "malformed"  # stands in for an undecodable log entry in folds and replays

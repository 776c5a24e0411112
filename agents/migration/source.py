"""The source side of a live migration: executing the source machine's actions.

A :class:`SourceDriver` runs one :class:`~agents.migration.fsm.SourceState`
machine for one request: it sends the handshake messages, copies each stage's
blocks over the transport while the request keeps decoding, suspends the
request between engine steps for the last stage, builds the ``Commit``, frees
the request's blocks only on the destination's ``CommitAck`` (or the log's
word), claims "aborted" in the log when the ack never comes, and resumes the
request when anything goes wrong. It records one OpenTelemetry span for the
migration and a child span per stage. The outcome is a :class:`MigrationOutcome`.

The first ``PreAllocate`` offers the chain hashes of the request's full blocks
(:func:`schemas.block_hash.block_hashes` over its tokens); the blocks the destination
answers it already caches are not exported (``MigrationOutcome.num_cached_blocks``). The
source's own blocks are released one reference each on commit, so blocks it shares
with other requests (its prefix cache) stay theirs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry import trace

from agents.engines.protocol import (
    InvalidRequestState,
    KVBuffer,
    MigrationError,
    RequestStatus,
    UnknownRequest,
)
from agents.migration.destination import payload_bytes_per_block
from agents.migration.driver import Input, MachineDriver
from agents.migration.fsm.actions import (
    Action,
    CancelCopy,
    ClaimOutcome,
    CopyBlocks,
    CopyDone,
    CopyFailed,
    FreeSourceBlocks,
    OutcomeClaimed,
    ReportFailed,
    ReportMigrated,
    RequestGone,
    ResumeOnSource,
    SendCommit,
    SendToPeer,
    Suspend,
    Suspended,
)
from agents.migration.fsm.config import MigrationConfig
from agents.migration.fsm.record import SourceStart
from agents.migration.fsm.source import SourceState, start_source
from agents.migration.host import DriverContext, MigrationHost
from agents.migration.pacing import CopyPacer, splits_by_block
from schemas.block_hash import block_hashes
from schemas.migration import Ack, Commit, CommitAck, HurryCopy
from schemas.reasons import MigrationAbortReason
from transport import TransferHeader

__all__ = ["MigrationOutcome", "SourceDriver", "StageRecord"]

#: Stages bigger than this are exported in a worker thread (the event loop stays responsive).
_THREAD_EXPORT_BYTES = 1 << 20


@dataclass(frozen=True)
class StageRecord:
    stage: int
    num_blocks: int
    num_bytes: int
    duration_s: float
    #: how the copy was cut (paced copies: agents.migration.pacing)
    num_chunks: int = 1
    largest_chunk_blocks: int = 0


@dataclass
class MigrationOutcome:
    """How one migration ended, seen from the source: ``reason`` is None if it migrated."""

    migration_id: str
    request_id: str
    destination_id: str
    migrated: bool = False
    reason: MigrationAbortReason | None = None
    detail: str = ""
    stages: list[StageRecord] = field(default_factory=list)
    started_at: float = 0.0
    suspended_at: float | None = None
    resumed_at: float | None = None
    finished_at: float = 0.0
    #: why its paced copy went at full speed from some point on (``HurryCopy.reason``), if it did
    hurried: str | None = None
    #: leading blocks the destination already held in its prefix cache (not copied)
    num_cached_blocks: int = 0
    #: the KV bytes of those blocks, which did not travel
    bytes_saved: int = 0

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def downtime_s(self) -> float | None:
        """Suspend (source clock) to resume (destination clock), if both are known."""
        if self.suspended_at is None or self.resumed_at is None:
            return None
        return self.resumed_at - self.suspended_at


class SourceDriver(MachineDriver):
    """Executes a source machine's actions against the engine, the transport and the bus."""

    state: SourceState

    def __init__(
        self,
        manager: DriverContext,
        *,
        migration_id: str,
        request_id: str,
        destination_id: str,
        destination_address: str,
        on_finished: Callable[[SourceDriver], None],
        config: MigrationConfig | None = None,
        queued: bool = False,
    ) -> None:
        agent = manager.agent
        #: a move of a request still queued here (no KV): held out of the queue, never run here
        self.queued = queued
        config = manager.config if config is None else config
        #: each stage's KV transfer token, from the destination's Ack
        self.transfer_tokens: dict[int, str] = {}
        stats = agent.engine.request_stats(request_id)
        if stats is None:
            raise UnknownRequest(request_id)
        # a queued move copies nothing: it holds the request first (and aborts if it runs)
        num_full_blocks = 0 if queued else stats.num_computed_tokens // agent.engine.info.block_size
        start = SourceStart(
            migration_id=migration_id,
            request_id=request_id,
            source_id=agent.instance_id,
            destination_id=destination_id,
            num_full_blocks=num_full_blocks,
            at=time.time(),
            block_hashes=self._chain(agent, request_id, num_full_blocks),
        )
        state, actions = start_source(
            migration_id=migration_id,
            request_id=request_id,
            source_id=agent.instance_id,
            destination_id=destination_id,
            num_full_blocks=start.num_full_blocks,
            now=start.at,
            config=config,
            block_hashes=start.block_hashes,
        )
        super().__init__(manager, state, start, config)
        self.request_id = request_id
        self.destination_id = destination_id
        self.destination_address = destination_address
        self.outcome = MigrationOutcome(migration_id, request_id, destination_id, started_at=time.time())
        self.done: asyncio.Future[MigrationOutcome] = asyncio.get_running_loop().create_future()
        self.copies: dict[int, asyncio.Task[None]] = {}
        self.written: dict[int, asyncio.Future[None]] = {}
        self.awaiting_suspend = False
        self.span = manager.tracer.start_span(
            "migration",
            context=agent.trace_context(request_id),  # a child of the request's span, if traced
            attributes={
                "shoal.migration.id": migration_id,
                "shoal.request.id": request_id,
                "shoal.migration.source": agent.instance_id,
                "shoal.migration.destination": destination_id,
                "shoal.migration.side": "source",
            },
        )
        self._initial = actions
        self._on_finished = on_finished
        #: the pacer of the stage being sent paced, if one is
        self._pacer: CopyPacer | None = None

    @staticmethod
    def _chain(agent: MigrationHost, request_id: str, num_full_blocks: int) -> tuple[int, ...]:
        """The chain hashes of the request's first ``num_full_blocks`` blocks (its computed ones)."""
        record = agent.request_record(request_id)
        if record is None or num_full_blocks <= 0:
            return ()
        block_size = agent.engine.info.block_size
        tokens = (*record.prompt_token_ids, *agent.engine.output_token_ids(request_id))
        return tuple(block_hashes(tokens[: num_full_blocks * block_size], block_size))

    def begin(self) -> None:
        self.start(self._initial)

    # -- actions ----------------------------------------------------------------------

    async def execute(self, action: Action) -> Input | None:
        engine = self.agent.engine
        if isinstance(action, SendToPeer):
            await self.manager.send(self.destination_id, action.message, self.span)
        elif isinstance(action, SendCommit):
            await self.manager.send(self.destination_id, self._commit(), self.span)
        elif isinstance(action, CopyBlocks):
            self.copies[action.stage] = self.helper(self._copy(action))
        elif isinstance(action, CancelCopy):
            copy = self.copies.pop(action.stage, None)
            if copy is not None:
                copy.cancel()
        elif isinstance(action, Suspend):
            self._suspend()
        elif isinstance(action, ResumeOnSource):
            try:
                engine.resume(self.request_id)
            except (UnknownRequest, InvalidRequestState):
                pass
            self.awaiting_suspend = False
            self.agent.wake()
        elif isinstance(action, FreeSourceBlocks):
            try:
                engine.release_request(self.request_id)
            except UnknownRequest:
                pass
            self.agent.forget_request(self.request_id)
            self.agent.wake()
        elif isinstance(action, ClaimOutcome):
            self.helper(self._claim(action))
        elif isinstance(action, ReportMigrated):
            self._report(migrated=True)
        elif isinstance(action, ReportFailed):
            self._log_abandoned(action)
            self._report(migrated=False, reason=action.reason, detail=action.detail)
        return None

    def _commit(self) -> Commit:
        record = self.agent.request_record(self.request_id)
        if record is None:
            raise RuntimeError(f"request {self.request_id!r} vanished while suspended for its commit")
        outputs = self.agent.engine.output_token_ids(self.request_id)
        return Commit(
            migration_id=self.migration_id,
            request_id=self.request_id,
            source_id=self.agent.instance_id,
            destination_id=self.destination_id,
            token_ids=(*record.prompt_token_ids, *outputs),
            num_prompt_tokens=record.num_prompt_tokens,
            owner_epoch=record.owner_epoch,
            suspended_at=self.outcome.suspended_at or time.time(),
            sampling=record.sampling,
            priority=record.priority,
            delta_subject=record.delta_subject,
            stream=record.stream,
        )

    def _suspend(self) -> None:
        if self.queued:
            stats = self.agent.engine.request_stats(self.request_id)
            if stats is not None and stats.status is not RequestStatus.WAITING:
                # it started running (or ran and was preempted) before the hold: it stays here
                self.feed(RequestGone(reason=MigrationAbortReason.REQUEST_STARTED))
                return
        try:
            self.agent.engine.suspend(self.request_id)
        except UnknownRequest:
            self.feed(RequestGone(reason=MigrationAbortReason.REQUEST_FINISHED))
            return
        except InvalidRequestState:
            self.feed(RequestGone(reason=MigrationAbortReason.REQUEST_PREEMPTED))
            return
        if self.agent.is_stepping:
            self.awaiting_suspend = True  # applies once the step in flight completes
        else:
            self._report_suspended()

    def on_step_done(self) -> None:
        if self.awaiting_suspend:
            self.awaiting_suspend = False
            self._report_suspended()

    def _report_suspended(self) -> None:
        stats = self.agent.engine.request_stats(self.request_id)
        if stats is None or not stats.status.holds_blocks:
            self.feed(RequestGone(reason=self._gone_reason()))
            return
        self.outcome.suspended_at = time.time()
        self.span.add_event("suspended", {"shoal.blocks": stats.num_blocks})
        self.feed(Suspended(num_blocks=stats.num_blocks))

    async def _copy(self, action: CopyBlocks) -> None:
        num_blocks = action.end_block - action.first_block
        span = self.manager.tracer.start_span(
            "migration.stage",
            context=trace.set_span_in_context(self.span),
            attributes={"shoal.migration.stage": action.stage, "shoal.migration.blocks": num_blocks},
        )
        started = time.perf_counter()
        if num_blocks == 0:  # the destination held every block of this stage cached: nothing to send
            span.end()
            self.outcome.stages.append(StageRecord(action.stage, 0, 0, 0.0, 0, 0))
            self.feed(CopyDone(stage=action.stage, num_full_blocks=self._num_full_blocks()))
            return
        try:
            delay = self.agent.config.faults.copy_delay_s
            if delay:
                await asyncio.sleep(delay)
            if (gate := self.agent.config.faults.copy_gate) is not None:
                async with asyncio.timeout(self.config.copy_timeout_s):
                    await gate.wait()
            written = self._written_future(action.stage)
            if self.config.paces(num_blocks) and not self.state.last_stage and self.outcome.hurried is None:
                buffer, pacer = await self._send_paced(action, self.config.copy_step_share)
                span.set_attribute("shoal.migration.chunks", pacer.num_chunks)
                span.set_attribute("shoal.migration.largest_chunk_blocks", pacer.largest_chunk)
                chunks, largest = pacer.num_chunks, pacer.largest_chunk
            else:
                buffer = await self._export(range(action.first_block, action.end_block))
                await self.agent.transport.send(
                    self.destination_address,
                    self._header(action.stage, memoryview(buffer.payload).nbytes),
                    buffer.payload,
                    timeout=self.config.copy_timeout_s,
                )
                chunks, largest = 1, num_blocks
            remaining = self.config.copy_timeout_s - (time.perf_counter() - started)
            async with asyncio.timeout(max(remaining, 0.001)):
                await written
        except asyncio.CancelledError:
            span.set_attribute("shoal.migration.cancelled", True)
            span.end()
            raise
        except Exception as exc:  # the engine or the transport refused: the stage failed
            span.record_exception(exc)
            span.end()
            gone = isinstance(exc, UnknownRequest) or (
                isinstance(exc, MigrationError) and not self._holds_blocks()
            )
            reason = self._gone_reason() if gone else MigrationAbortReason.COPY_FAILED
            self.feed(CopyFailed(stage=action.stage, reason=reason, detail=f"{type(exc).__name__}: {exc}"))
            return
        duration = time.perf_counter() - started
        span.set_attribute("shoal.migration.bytes", buffer.nbytes)
        span.set_attribute("shoal.migration.duration_ms", duration * 1e3)
        span.end()
        self.outcome.stages.append(
            StageRecord(action.stage, num_blocks, buffer.nbytes, duration, chunks, largest)
        )
        self.feed(CopyDone(
            stage=action.stage, num_full_blocks=self._num_full_blocks(), num_bytes=buffer.nbytes,
            duration_s=duration,
        ))

    def _num_full_blocks(self) -> int:
        engine = self.agent.engine
        stats = engine.request_stats(self.request_id)
        return 0 if stats is None else stats.num_computed_tokens // engine.info.block_size

    async def _export(self, indices: range) -> KVBuffer:
        engine = self.agent.engine
        if len(indices) * engine.info.bytes_per_block > _THREAD_EXPORT_BYTES:
            return await asyncio.to_thread(engine.export_blocks, self.request_id, list(indices))
        return engine.export_blocks(self.request_id, list(indices))

    def _header(self, stage: int, nbytes: int) -> TransferHeader:
        return TransferHeader(
            migration_id=self.migration_id,
            stage=stage,
            nbytes=nbytes,
            reservation_id=self.transfer_tokens.get(stage, ""),
        )

    async def _send_paced(self, action: CopyBlocks, share: float) -> tuple[KVBuffer, CopyPacer]:
        """Export and send the stage in chunks of about ``share`` of a step each, one per step.

        Engines whose buffers are block-major (:func:`splits_by_block`) export chunk by
        chunk; the others export the stage at once and only its sending is paced.
        """
        engine = self.agent.engine
        info = engine.info
        num_blocks = action.end_block - action.first_block
        per_block = payload_bytes_per_block(info.engine, info.bytes_per_block)
        pacer = self._pacer = CopyPacer(
            self.manager.step_clock,
            share=share,
            total=num_blocks,
            time_limit_s=self.config.copy_timeout_s / 2,
            urgent=self._short_of_memory,
        )
        whole: KVBuffer | None = None
        if not splits_by_block(info.engine):
            whole = await self._export(range(action.first_block, action.end_block))

        async def next_chunk(offset: int) -> memoryview:
            done = offset // per_block
            units = await pacer.next_chunk(done)
            if whole is not None:
                return memoryview(whole.payload).cast("B")[offset : offset + units * per_block]
            first = action.first_block + done
            chunk = await self._export(range(first, first + units))
            return memoryview(chunk.payload).cast("B")

        try:
            await self.agent.transport.send_paced(
                self.destination_address,
                self._header(action.stage, num_blocks * per_block),
                next_chunk,
                timeout=self.config.copy_timeout_s,
            )
        finally:
            self._pacer = None
        return whole or KVBuffer(num_blocks, num_blocks * info.bytes_per_block, b""), pacer

    def _short_of_memory(self) -> bool:
        """Asked before each paced chunk: if this agent is now short of memory, the migration
        hurries (the rest of it at full speed) and this says so."""
        if self.outcome.hurried is None and self.manager.short_of_memory():
            self.hurry("short_of_memory")
        return self.outcome.hurried is not None

    def hurry(self, reason: str, *, tell: bool = True) -> bool:
        """Copy the rest of this migration at full speed (:meth:`CopyPacer.hurry`): the stage
        being sent and every later one, and with ``tell`` the destination's writes too
        (``HurryCopy``). Whether it was paced until now."""
        if self.outcome.hurried is not None or self.is_final or self.config.copy_step_share <= 0:
            return False
        self.outcome.hurried = reason
        if self._pacer is not None:
            self._pacer.hurry()
        self.span.add_event("hurried", {"shoal.migration.hurry_reason": reason})
        if tell:
            message = HurryCopy(
                migration_id=self.migration_id, sender_id=self.agent.instance_id, reason=reason
            )
            self.helper(self.manager.send(self.destination_id, message, self.span))
        return True

    def _written_future(self, stage: int) -> asyncio.Future[None]:
        future = self.written.get(stage)
        if future is None:
            future = self.written[stage] = asyncio.get_running_loop().create_future()
        return future

    def on_ack(self, ack: Ack) -> None:
        """Keep the stage's transfer token from the destination's ``Ack`` for the buffer's header."""
        self.transfer_tokens[ack.stage] = ack.transfer_token

    def on_written(self, stage: int) -> None:
        """The destination wrote the stage into its blocks (``StageWritten``)."""
        future = self._written_future(stage)
        if not future.done():
            future.set_result(None)

    def _holds_blocks(self) -> bool:
        stats = self.agent.engine.request_stats(self.request_id)
        return stats is not None and stats.status.holds_blocks

    def _gone_reason(self) -> MigrationAbortReason:
        """Why the request no longer holds its blocks: it finished (the engine forgot it) or was preempted."""
        if self.agent.engine.request_stats(self.request_id) is None:
            return MigrationAbortReason.REQUEST_FINISHED
        return MigrationAbortReason.REQUEST_PREEMPTED

    async def _claim(self, action: ClaimOutcome) -> None:
        try:
            committed = await self.manager.log.claim(action.outcome)
        except Exception:  # the bus is unreachable: the machine claims again on its next deadline
            return
        self.feed(OutcomeClaimed(committed=committed))

    def on_commit_ack(self, ack: CommitAck) -> None:
        self.outcome.resumed_at = ack.resumed_at

    def _report(
        self, *, migrated: bool, reason: MigrationAbortReason | None = None, detail: str = ""
    ) -> None:
        outcome = self.outcome
        outcome.migrated, outcome.reason, outcome.detail = migrated, reason, detail
        outcome.finished_at = time.time()
        outcome.num_cached_blocks = self.state.num_cached_blocks
        outcome.bytes_saved = outcome.num_cached_blocks * self.agent.engine.info.bytes_per_block
        span = self.span
        span.set_attribute("shoal.migration.outcome", "migrated" if migrated else "aborted")
        if reason is not None:
            span.set_attribute("shoal.migration.reason", reason.value)
        if detail:
            span.set_attribute("shoal.migration.detail", detail)
        span.set_attribute("shoal.migration.stages", outcome.num_stages)
        span.set_attribute("shoal.migration.bytes", sum(s.num_bytes for s in outcome.stages))
        if outcome.num_cached_blocks:
            span.set_attribute("shoal.migration.cached_blocks", outcome.num_cached_blocks)
        if outcome.downtime_s is not None:
            span.set_attribute("shoal.migration.downtime_ms", outcome.downtime_s * 1e3)
        span.end()
        if not self.done.done():
            self.done.set_result(outcome)

    def finished(self) -> None:
        self._on_finished(self)
        if not self.done.done():  # cancelled before an outcome: report it as failed
            self.outcome.reason = self.outcome.reason or MigrationAbortReason.CANCELLED
            self.outcome.finished_at = time.time()
            self.span.end()
            self.done.set_result(self.outcome)

    def abandon(self) -> None:
        super().abandon()
        for copy in self.copies.values():
            copy.cancel()

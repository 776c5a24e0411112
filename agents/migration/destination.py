"""The destination side of a live migration: executing the destination machine's actions.

A :class:`DestinationDriver` runs one :class:`~agents.migration.fsm.DestinationState`
machine: on ``PreAllocate`` it reserves blocks in the engine (answering at
once, ``Reserved`` or ``ReserveFailed``) and registers the transport slot for
that stage *before* the ``Ack`` goes out; a landed buffer is written into the
stage's reserved blocks only when the machine says so (``WriteBlocks``); on
``Commit`` the machine claims the outcome in the log and, if it wins, the
request joins the running batch and the agent publishes its tokens on the same
subject from the next index with the owner epoch incremented. Releases cancel
the transport slots too, so late data never lands in released blocks.

Stage 0 first takes a reference to the leading blocks of the request's chain (the
``PreAllocate``'s block hashes) that the engine's prefix cache holds
(:class:`~agents.migration.host.CachedBlockHolder`), then reserves blocks for the rest
only, so only those are copied; the references are the admitted request's, or are
dropped with the reservations when the migration is given up. An engine without a
prefix cache (or one that lends none) holds nothing and every block is copied.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Mapping

import msgspec
from opentelemetry import trace

from agents.engines.protocol import KVBuffer, MigrationError, OutOfBlocks, RequestRejected, Reservation
from agents.migration.driver import Input, MachineDriver
from agents.migration.fsm.actions import (
    Action,
    AdmitRequest,
    BlocksReceived,
    ClaimOutcome,
    OutcomeClaimed,
    RejectBlocks,
    ReleaseReservation,
    ReportFailed,
    ReportMigrated,
    Reserve,
    Reserved,
    ReserveFailed,
    SendToPeer,
    WriteBlocks,
)
from agents.migration.fsm.config import MigrationConfig
from agents.migration.fsm.destination import DestinationState
from agents.migration.fsm.record import DestinationStart
from agents.migration.host import CachedBlockHolder, DriverContext
from agents.migration.pacing import CopyPacer, splits_by_block
from agents.tracing import parent_context
from schemas.migration import Ack, Commit, HurryCopy, StageWritten
from schemas.reasons import MigrationAbortReason
from transport import PendingTransfer, TransportError

__all__ = ["DestinationDriver", "payload_bytes_per_block"]

#: Imports bigger than this run in a worker thread.
_THREAD_IMPORT_BYTES = 1 << 20


def payload_bytes_per_block(engine_name: str, bytes_per_block: int) -> int:
    """Bytes a KV buffer carries per block: the KV itself, or an 8-byte fingerprint for ``sim``."""
    return 8 if engine_name == "sim" else bytes_per_block


class DestinationDriver(MachineDriver):
    """Executes a destination machine's actions against the engine, the transport and the bus."""

    state: DestinationState

    def __init__(
        self,
        manager: DriverContext,
        state: DestinationState,
        start: DestinationStart,
        headers: Mapping[str, str],
        *,
        on_finished: Callable[[DestinationDriver], None],
        config: MigrationConfig | None = None,
    ) -> None:
        super().__init__(manager, state, start, config)
        self._on_finished = on_finished
        self.reservations: dict[int, Reservation] = {}
        #: cached blocks of the request's prefix held for it since stage 0 (not copied)
        self.held: tuple[int, ...] = ()
        #: the KV transfer token of each stage, sent to the source in our Ack
        self.transfer_tokens: dict[int, str] = {}
        self.pending: dict[int, PendingTransfer] = {}
        self.received: dict[int, object] = {}
        self.delivered: set[int] = set()
        self.writes: list[asyncio.Future[None]] = []
        self._stop_writes = False
        #: stage -> (chunks, largest chunk in blocks) of the stages written paced
        self.write_chunks: dict[int, tuple[int, int]] = {}
        #: why the rest of the migration is written at full speed (``HurryCopy.reason``), if it is
        self.hurried: str | None = None
        self._pacers: set[CopyPacer] = set()
        self.span = manager.tracer.start_span(
            "migration.destination",
            context=parent_context(headers),
            attributes={
                "shoal.migration.id": state.migration_id,
                "shoal.request.id": state.request_id,
                "shoal.migration.source": state.source_id,
                "shoal.migration.destination": manager.agent.instance_id,
                "shoal.migration.side": "destination",
            },
        )

    # -- actions ----------------------------------------------------------------------

    async def execute(self, action: Action) -> Input | None:
        if isinstance(action, Reserve):
            return self._reserve(action)
        if isinstance(action, SendToPeer):
            message = action.message
            if isinstance(message, Ack):
                token = self.transfer_tokens.get(message.stage, "")
                message = msgspec.structs.replace(message, transfer_token=token)
            await self.manager.send(self.state.source_id, message, self.span)
        elif isinstance(action, WriteBlocks):
            await self._write(action)
        elif isinstance(action, RejectBlocks):
            self.received.pop(action.stage, None)
            self.span.add_event(
                "rejected-blocks",
                {"shoal.migration.stage": action.stage, "shoal.migration.reason": action.reason.value},
            )
        elif isinstance(action, ReleaseReservation):
            await self._release()
        elif isinstance(action, AdmitRequest):
            await self._admit(action.commit)
        elif isinstance(action, ClaimOutcome):
            self.helper(self._claim(action))
        elif isinstance(action, ReportMigrated):
            self.span.set_attribute("shoal.migration.outcome", "migrated")
            self.span.end()
        elif isinstance(action, ReportFailed):
            self._log_abandoned(action)
            self.span.set_attribute("shoal.migration.outcome", "aborted")
            self.span.set_attribute("shoal.migration.reason", action.reason.value)
            if action.detail:
                self.span.set_attribute("shoal.migration.detail", action.detail)
            self.span.end()
        return None

    def _reserve(self, action: Reserve) -> Input:
        engine = self.agent.engine
        if action.stage == 0 and self.manager.num_incoming > self.manager.config.max_concurrent_per_instance:
            self.manager.slot_wanted(incoming=True)  # paced copies coming in give way
            return ReserveFailed(stage=action.stage, reason=MigrationAbortReason.TOO_MANY_INCOMING)
        if action.stage == 0 and self.agent.terminating:
            return ReserveFailed(stage=action.stage, reason=MigrationAbortReason.DESTINATION_TERMINATING)
        # hold the cached prefix before reserving, so the reservation cannot evict it
        held = self._hold(action.block_hashes)
        try:
            reservation = engine.reserve(action.num_blocks - len(held))
        except OutOfBlocks as exc:
            self._drop_held()
            return ReserveFailed(
                stage=action.stage, reason=MigrationAbortReason.OUT_OF_BLOCKS, detail=str(exc)
            )
        self.reservations[action.stage] = reservation
        if reservation.num_blocks == 0:  # nothing to copy (held cached, or a queued move without KV)
            return Reserved(stage=action.stage, block_ids=reservation.block_ids, cached_block_ids=held)
        info = engine.info
        nbytes = reservation.num_blocks * payload_bytes_per_block(info.engine, info.bytes_per_block)
        # only the source learns the token (in our Ack): a buffer without it is refused, and a
        # replay of the real one finds the slot used (single use)
        token = self.transfer_tokens[action.stage] = secrets.token_urlsafe(24)
        pending = self.agent.transport.expect(self.migration_id, action.stage, nbytes, reservation_id=token)
        self.pending[action.stage] = pending
        self.helper(self._await_transfer(action.stage, pending))
        return Reserved(stage=action.stage, block_ids=reservation.block_ids, cached_block_ids=held)

    def _hold(self, block_hashes: tuple[int, ...]) -> tuple[int, ...]:
        """Reference the leading blocks of ``block_hashes`` the engine caches (stage 0 only)."""
        engine = self.agent.engine
        if not block_hashes or self.held or not isinstance(engine, CachedBlockHolder):
            return ()
        self.held = engine.hold_cached_blocks(block_hashes)
        if self.held:
            self.span.set_attribute("shoal.migration.cached_blocks", len(self.held))
        return self.held

    def _drop_held(self) -> None:
        engine = self.agent.engine
        held, self.held = self.held, ()
        if held and isinstance(engine, CachedBlockHolder):
            engine.drop_held_blocks(held)

    async def _await_transfer(self, stage: int, pending: PendingTransfer) -> None:
        try:
            buffer = await pending.wait()
        except TransportError:  # cancelled, timed out or closed: the machine decides what that means
            return
        self._landed(stage, buffer)

    def _landed(self, stage: int, buffer: object) -> bool:
        if stage in self.delivered:
            return False
        self.delivered.add(stage)
        self.received[stage] = buffer
        self.feed(BlocksReceived(stage=stage))
        return True

    async def before_input(self, event: Input) -> None:
        """Before a ``Commit``, write every stage whose data has landed but was not seen yet.

        The source sends ``Commit`` only after its last transfer returned (the data
        sits in our slot), but the waiter task may not have run yet.
        """
        if not isinstance(event, Commit):
            return
        for stage, pending in sorted(self.pending.items(), key=lambda item: item[0]):
            if pending.done() and stage not in self.delivered:
                self.delivered.add(stage)
                try:
                    self.received[stage] = await pending.wait()
                except TransportError:
                    continue
                await self.apply(BlocksReceived(stage=stage))

    async def _write(self, action: WriteBlocks) -> None:
        """Write a landed stage into its reserved blocks.

        A big stage is written by a worker thread while the machine goes on (the
        next stage's ``PreAllocate`` is answered meanwhile, so the source never
        waits on it); releasing and admitting wait for every write first, so no
        block is released or handed to the batch while data is still going in.
        """
        payload = self.received.pop(action.stage)
        self.pending.pop(action.stage, None)  # it holds the landed buffer too
        engine = self.agent.engine
        num_blocks = len(action.block_ids)
        buffer = KVBuffer(num_blocks, num_blocks * engine.info.bytes_per_block, payload)  # type: ignore[arg-type]
        if self._paced(num_blocks):
            self.writes.append(
                asyncio.ensure_future(self._write_paced(action.stage, action.block_ids, buffer))
            )
        elif buffer.nbytes > _THREAD_IMPORT_BYTES:
            self.writes.append(
                asyncio.ensure_future(self._write_in_thread(action.stage, action.block_ids, buffer))
            )
        else:
            engine.import_blocks(action.block_ids, buffer)
            await self._confirm(action.stage)
        self.span.add_event(
            "stage-written", {"shoal.migration.stage": action.stage, "shoal.blocks": num_blocks}
        )

    def _paced(self, num_blocks: int) -> bool:
        """Whether to write this stage in paced chunks: pacing is on, the engine's buffers split
        by block, and the stage is bigger than a last stage is (so a suspended request's last
        stage is written at once; only a last stage forced by ``max_stages`` may be paced)."""
        return (
            self.hurried is None
            and self.config.paces(num_blocks)
            and splits_by_block(self.agent.engine.info.engine)
        )

    @property
    def paced(self) -> bool:
        """Whether this migration's copies may still be paced (the source paces, no hurry yet)."""
        return self.hurried is None and self.config.copy_step_share > 0 and not self.is_final

    def hurry(self, reason: str, *, tell: bool = True) -> bool:
        """Write the rest of this migration at full speed (:meth:`CopyPacer.hurry`), and with
        ``tell`` have the source send it so too (``HurryCopy``). Whether it was paced until now."""
        if not self.paced:
            return False
        self.hurried = reason
        for pacer in self._pacers:
            pacer.hurry()
        self.span.add_event("hurried", {"shoal.migration.hurry_reason": reason})
        if tell:
            message = HurryCopy(
                migration_id=self.migration_id, sender_id=self.agent.instance_id, reason=reason
            )
            self.helper(self.manager.send(self.state.source_id, message, self.span))
        return True

    async def _write_paced(self, stage: int, block_ids: tuple[int, ...], buffer: KVBuffer) -> None:
        """Write the stage in chunks of about ``copy_step_share`` of a step each, one per step
        (:mod:`agents.migration.pacing`); stops between chunks once the reservation is released."""
        engine = self.agent.engine
        info = engine.info
        per_block = payload_bytes_per_block(info.engine, info.bytes_per_block)
        payload = memoryview(buffer.payload).cast("B")
        pacer = CopyPacer(
            self.manager.step_clock,
            share=self.config.copy_step_share,
            total=len(block_ids),
            # the source's send may have used half of the stage's copy_timeout_s already
            time_limit_s=self.config.copy_timeout_s / 4,
        )
        self._pacers.add(pacer)
        done = 0
        try:
            while done < len(block_ids):
                units = await pacer.next_chunk(done)
                if self._stop_writes:
                    return
                data = payload[done * per_block : (done + units) * per_block]
                chunk = KVBuffer(units, units * info.bytes_per_block, data)
                ids = block_ids[done : done + units]
                if chunk.nbytes > _THREAD_IMPORT_BYTES:
                    await asyncio.to_thread(engine.import_blocks, ids, chunk)
                else:
                    engine.import_blocks(ids, chunk)
                done += units
        finally:
            self._pacers.discard(pacer)
        self.write_chunks[stage] = (pacer.num_chunks, pacer.largest_chunk)
        self.span.add_event(
            "stage-written-paced",
            {"shoal.migration.stage": stage, "shoal.migration.chunks": pacer.num_chunks},
        )
        await self._confirm(stage)

    async def _write_in_thread(self, stage: int, block_ids: tuple[int, ...], buffer: KVBuffer) -> None:
        await asyncio.to_thread(self.agent.engine.import_blocks, block_ids, buffer)
        await self._confirm(stage)

    async def _confirm(self, stage: int) -> None:
        """Tell the source the stage is written (only now does it count the stage as copied)."""
        written = StageWritten(migration_id=self.migration_id, stage=stage)
        await self.manager.send(self.state.source_id, written, self.span)

    async def _writes_done(self) -> BaseException | None:
        """Wait for the stage writes under way; the first error, if any."""
        writes, self.writes = self.writes, []
        results = await asyncio.gather(*writes, return_exceptions=True)
        return next((r for r in results if isinstance(r, BaseException)), None)

    async def _release(self) -> None:
        self.agent.transport.cancel(self.migration_id)
        self._stop_writes = True  # paced writes stop at their next chunk
        await self._writes_done()
        for reservation in self.reservations.values():
            self.agent.engine.release_reservation(reservation)
        self.reservations.clear()
        self._drop_held()
        self.received.clear()

    async def _admit(self, commit: Commit) -> None:
        agent = self.agent
        reservations = [self.reservations[s] for s in sorted(self.reservations)]
        prompt = commit.token_ids[: commit.num_prompt_tokens]
        outputs = commit.token_ids[commit.num_prompt_tokens :]
        failed_write = await self._writes_done()
        if not self.held and not any(r.block_ids for r in reservations):
            self._queue_moved(commit, reservations)  # no KV came: queue it here as it was there
            return
        engine = agent.engine
        try:
            if failed_write is not None:
                raise MigrationError(f"writing a stage failed: {failed_write!r}")
            if self.held and isinstance(engine, CachedBlockHolder):
                engine.admit_migrated(
                    commit.request_id,
                    prompt,
                    outputs,
                    commit.sampling,
                    commit.priority,
                    reservations,
                    cached_block_ids=self.held,
                )
            else:
                engine.admit_migrated(
                    commit.request_id, prompt, outputs, commit.sampling, commit.priority, reservations
                )
        except MigrationError as exc:  # the data did not all arrive: the request cannot continue here
            self.span.record_exception(exc)
            for reservation in reservations:
                engine.release_reservation(reservation)
            self.reservations.clear()
            self._drop_held()
            agent.spawn(agent.publish_failure(commit, str(exc)))
            return
        self.reservations.clear()
        self.held = ()  # the request's references now
        agent.adopt_migrated(commit, trace_context=trace.set_span_in_context(self.span))

    def _queue_moved(self, commit: Commit, reservations: list[Reservation]) -> None:
        """Admit a request that moved without KV (it was queued at the source): into the queue."""
        agent = self.agent
        for reservation in reservations:
            agent.engine.release_reservation(reservation)
        self.reservations.clear()
        try:
            agent.engine.add_request(
                commit.request_id,
                commit.token_ids[: commit.num_prompt_tokens],
                commit.sampling,
                commit.priority,
                output_token_ids=commit.token_ids[commit.num_prompt_tokens :],
            )
        except RequestRejected as exc:  # the engines differ (model length, capacity): end its stream
            self.span.record_exception(exc)
            agent.spawn(agent.publish_failure(commit, str(exc)))
            return
        agent.adopt_migrated(commit, trace_context=trace.set_span_in_context(self.span), queued=True)

    async def _claim(self, action: ClaimOutcome) -> None:
        try:
            committed = await self.manager.log.claim(action.outcome)
        except Exception:  # the bus is unreachable: the machine claims again on its next deadline
            return
        self.feed(OutcomeClaimed(committed=committed))

    def finished(self) -> None:
        self.pending.clear()  # landed buffers: a finished machine is kept (for late messages), its data not
        self.received.clear()
        self._on_finished(self)

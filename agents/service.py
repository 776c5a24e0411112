"""The agent: one engine, its step loop, its RPCs, its token deltas and load reports.

:class:`Agent` is the shell around an :class:`~agents.engines.protocol.Engine`. Started
(``await agent.start()``), it first serves a warm-up request through the engine's own step
(:mod:`agents.warm_up`; an engine that cannot is never announced), then announces the
instance (``InstanceJoined``), runs
the engine step loop without ever waiting on the scheduler, publishes one
:class:`~schemas.TokenDelta` per request per step on the request's token
subject, or — for requests whose ``GenerateRequest`` names a ``delta_subject``
(a frontend's) — one :class:`~schemas.TokenDeltaBatch` per step and subject
for all of them (keeping a short buffer for ``resend``; a step's deltas go
out just before the next step starts),
appends load reports (which are the liveness heartbeat), serves the RPCs of
the contract (``generate``, ``abort``, ``resend``, ``migrate_out``,
``stop_migration``, ``drain``, ``stats``: a fresh load report, for drills
and operators checking that no block is left reserved, and ``liveness``: whether
its reports are still being sent, asked by the scheduler before it marks a silent
instance failed) and hands migration messages to
:class:`agents.migration.manager.MigrationManager`. After each step its prefix cache's
changes go to :class:`agents.cache_events.CacheEventPublisher` (published off the step path).

Requests whose frontend is gone are aborted: every ``orphan_check_interval_s``
the agent sends a :class:`~schemas.TokenProbe` request on each subject its live
requests' tokens go to (a frontend's batch subject once for all of that
frontend's requests, else a request's own token subject); the frontend that
listens there ignores it, and NATS answers *no responders* when nothing
subscribes any more. Two such answers in a row
abort the request (no blocks held, no tokens generated into the void); a
probe that times out (the listener exists, or the bus is slow) never does.

Not here: load-report arithmetic (:mod:`agents.reporting`), the delta buffer
(:mod:`agents.deltas`), the migration shells (:mod:`agents.migration`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context

from agents.cache_events import CacheEventPublisher
from agents.config import AgentConfig
from agents.deltas import DeltaBuffer, RequestTokens
from agents.engines.protocol import (
    Engine,
    EngineStats,
    PreemptionEvent,
    RequestRejected,
    RequestStats,
    StepResult,
)
from agents.metrics import AgentMetrics
from agents.migration.fsm.config import MigrationConfig
from agents.migration.manager import MigrationManager, MigrationOutcome
from agents.reporting import (
    build_load_report,
    load_signature,
    queued_in_order,
    requeue_candidate,
    urgent_signature,
)
from agents.tracing import RequestSpans, parent_context, tracer_from
from agents.warm_up import inject_first_step_fault, warm_up
from bus import Bus, BusError, InvalidName, NoResponders, Service
from bus import tracing as bus_tracing
from bus.event_loop import cancel_and_wait, wait_event
from bus.wildcards import validate_subject
from scheduler.policy.growth import OutputLengthEstimate
from schemas import (
    AbortReply,
    AbortRequest,
    Body,
    Codec,
    CommandRejectReason,
    CommandReply,
    Commit,
    Drain,
    FinishReason,
    GenerateReply,
    GenerateRequest,
    InstanceJoined,
    InstanceLeft,
    InstanceTerminating,
    Liveness,
    LoadReport,
    MigrateOut,
    MigrationAbortReason,
    MoveQueued,
    RejectReason,
    RequestAdmitted,
    RequestPreempted,
    ResendRequest,
    RpcError,
    RpcErrorCode,
    StopMigration,
    TerminateReason,
    TokenDelta,
    TokenDeltaBatch,
    TokenProbe,
)
from transport import KVTransport, open_transport

__all__ = ["Agent"]

log = logging.getLogger(__name__)

_REPLY_CACHE = 16_384
#: Request ids aborted here before any generate for them arrived, kept (most recent) so a late
#: generate is refused, not run with nobody listening.
_ABORTED_UNKNOWN = 4_096
_LOOP_LAG_WARNING_S = 1.0


class Agent:
    """Drives one engine on the bus; see the module docstring.

    ``bus`` must be connected; the agent never closes it except in :meth:`kill`.
    """

    def __init__(
        self,
        engine: Engine,
        bus: Bus,
        config: AgentConfig,
        *,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self.engine = engine
        self.bus = bus
        self.config = config
        self.subjects = bus.config.subjects
        self.codec = Codec(producer=config.instance_id)
        self.deltas = DeltaBuffer(
            steps_per_request=config.delta_buffer_steps, finished_limit=config.finished_buffers
        )
        self.num_accepted = 0
        self.num_steps = 0
        #: requests aborted because nobody listened to their tokens any more (their frontend died)
        self.num_orphans_aborted = 0
        #: scheduler commands that did not decode as the command their subject serves
        self.num_malformed_commands = 0
        self.terminating = False
        #: set by :meth:`drain`: the step loop stops the agent once it is empty (``terminating`` alone
        #: only refuses new requests)
        self._draining = False
        self._replies: OrderedDict[tuple[str, int], GenerateReply] = OrderedDict()
        self._aborted_unknown: OrderedDict[str, None] = OrderedDict()
        self._transport: KVTransport | None = None
        self._services: list[Service] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._work = asyncio.Event()
        self._stopped = asyncio.Event()
        self._stepping = False
        self._stepped = False  # any engine step yet (the warm-up's is the first)
        self._unpublished: list[tuple[str | None, TokenDelta]] = []  # (batch subject or None, delta)
        #: token subjects of recent requests (building one validates the request id each time)
        self._token_subject = functools.lru_cache(maxsize=4096)(self.subjects.tok)
        #: Requests waiting for their (re)admission by the engine: since when, and whether a preemption
        #: put them back (``RequestAdmitted`` is logged at their first output).
        self._queued_since: dict[str, tuple[float, bool]] = {}
        #: The output length of the requests finished here (``LoadReport.expected_growth_blocks``).
        self.output_length = OutputLengthEstimate()
        self._report_seq = 0
        self._last_signature: tuple[object, ...] | None = None
        self._last_urgent: tuple[object, ...] | None = None
        self.num_reports = 0
        self._last_report_at = 0.0
        #: loop times: when the report loop last began a report, and when one was last stored
        self._report_attempt_at: float | None = None
        self._report_stored_at: float | None = None
        self._report_error = ""
        self._report_task: asyncio.Task[Any] | None = None
        self._epoch_seen = -1
        self._started = False
        self.last_engine_stats: EngineStats | None = None
        self._last_step_s = 0.0
        self.metrics = AgentMetrics(lambda: self.last_engine_stats)
        self.step_listeners: list[Callable[[StepResult], None]] = [self.metrics.observe_step]
        #: the spans of traced requests (generate RPCs whose headers carry a trace context)
        self.request_spans = RequestSpans(tracer_from(tracer_provider), config.instance_id)
        self.migration = MigrationManager(self, tracer_provider=tracer_provider)
        self.migration.outcome_listeners.append(self.metrics.observe_migration)
        #: prefix-cache events (made in :meth:`start`, after the warm-up, so its first batch has it)
        self.cache_events: CacheEventPublisher | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def instance_id(self) -> str:
        return self.config.instance_id

    @property
    def transport(self) -> KVTransport:
        if self._transport is None:
            raise RuntimeError("agent not started")
        return self._transport

    @property
    def is_stepping(self) -> bool:
        """Whether an engine step is in flight (a suspend then applies after it)."""
        return self._stepping

    @property
    def stopped(self) -> asyncio.Event:
        """Set when the agent stops (after a drain completes, :meth:`stop` or :meth:`kill`)."""
        return self._stopped

    def joined_event(self) -> InstanceJoined:
        info = self.engine.info
        return InstanceJoined(
            instance_id=self.instance_id,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            model=info.model,
            kv_layout=info.kv_layout,
            transport_address=self.transport.address,
            transport_kind=self.transport.kind,
            engine=info.engine,
            max_batch_size=info.max_batch_size,
            max_model_len=info.max_model_len,
        )

    async def start(self) -> None:
        """Warm the engine up, open the transport, announce the instance, serve RPCs, start the loops.

        The warm-up (:func:`agents.warm_up.warm_up`: one short request through the engine's own
        step) comes first: an engine that cannot serve it raises
        :class:`~agents.warm_up.WarmUpFailed` here, and the instance is never announced, never
        reports load and is never given a request.
        """
        if self._started:
            raise RuntimeError("agent already started")
        self._started = True
        log.info(
            "agent %s: warm-up request (%s engine, %s); a process that dies now cannot compute here%s",
            self.instance_id, self.engine.info.engine, self.engine.info.model.dtype or "its dtype",
            "" if self.engine.info.model.dtype in ("float32", "") else " in this dtype: try --dtype float32",
        )
        done = await warm_up(
            self.engine, lambda: self._engine_step(exclusive=True), timeout_s=self.config.warm_up_timeout_s
        )
        log.info(
            "agent %s: warm-up request served (%d tokens in %d steps, %.2f s)",
            self.instance_id, len(done.token_ids), done.num_steps, done.seconds,
        )
        self._transport = await open_transport(self.config.transport)
        await self.migration.start()
        await self._append_instance_event(self.joined_event())
        handlers: dict[str, Callable[[bytes, dict[str, str]], Awaitable[bytes]]] = {
            "generate": self._serve_generate,
            "abort": self._serve_abort,
            "resend": self._serve_resend,
            "migrate_out": self._serve_migrate_out,
            "move_queued": self._serve_move_queued,
            "stop_migration": self._serve_stop_migration,
            "drain": self._serve_drain,
            "stats": self._serve_stats,
            "liveness": self._serve_liveness,
        }
        for method, handler in sorted(handlers.items(), key=lambda item: item[0]):
            self._services.append(
                await self.bus.serve(self.subjects.rpc_agent(self.instance_id, method), handler)
            )
        await self._start_cache_events()
        self.spawn(self._step_loop())
        self._report_task = self.spawn(self._report_loop())
        if self.config.orphan_check_interval_s > 0:
            self.spawn(self._orphan_loop())

    async def _start_cache_events(self) -> None:
        publisher = self.cache_events = CacheEventPublisher(
            self.engine,
            instance_id=self.instance_id,
            block_size=self.engine.info.block_size,
            subject=self.subjects.kv(self.instance_id),
            append=lambda subject, data, msg_id, timeout: self.bus.append(
                subject, data, msg_id=msg_id, timeout=timeout
            ),
            codec=self.codec,
            config=self.config.cache_events,
        )
        self.step_listeners.append(publisher.after_step)
        sync = await self.bus.serve(self.subjects.kv_sync(self.instance_id), publisher.serve_sync)
        self._services.append(sync)
        self.spawn(publisher.run())

    async def stop(self) -> None:
        """Stop cleanly: stop serving, end migrations, announce ``InstanceLeft``, close the transport."""
        for service in self._services:
            with contextlib.suppress(BusError):
                await service.stop()
        self._services.clear()
        await self.migration.close()
        await self._cancel_tasks()
        await self._flush_deltas()
        self.request_spans.close_all()
        with contextlib.suppress(BusError):
            await self._append_instance_event(InstanceLeft(instance_id=self.instance_id))
        if self._transport is not None:
            await self._transport.close()
        self._stopped.set()

    async def kill(self) -> None:
        """Die abruptly (tests): cancel everything, close the connection and transport, no goodbyes."""
        self.migration.abandon()
        self.request_spans.close_all()
        await self._cancel_tasks()
        for service in self._services:
            with contextlib.suppress(Exception):
                await service.stop()
        self._services.clear()
        with contextlib.suppress(Exception):
            await self.bus.close()
        if self._transport is not None:
            with contextlib.suppress(Exception):
                await self._transport.close()
        self._stopped.set()

    async def _cancel_tasks(self) -> None:
        await cancel_and_wait([t for t in self._tasks if t is not asyncio.current_task()])
        self._tasks.clear()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as one of the agent's tasks (cancelled on stop or kill; errors logged)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("agent %s: task failed", self.instance_id, exc_info=task.exception())

    async def _append_instance_event(self, event: Body) -> None:
        await self.bus.append(
            self.subjects.instance(self.instance_id), self.codec.encode(event, time=time.time())
        )

    def wake(self) -> None:
        """New work for the step loop."""
        self._work.set()

    # ------------------------------------------------------------------ step loop

    async def _step_loop(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished():
                await self._flush_deltas()
                self._work.clear()
                if self._draining and self.migration.is_idle:
                    self.spawn(self._finish_drain())
                    return
                await wait_event(self._work, self.config.tick_interval_s)
                continue
            self._stepping = True
            started = time.perf_counter()
            try:
                result = await self._step_publishing(engine)
            finally:
                self._stepping = False
            self.num_steps += 1
            self._after_step(result)
            if (pace := self.config.faults.pace) is not None and pace.min_step_s:  # a test holds it back
                await asyncio.sleep(max(0.0, pace.min_step_s - (time.perf_counter() - started)))
            if result.num_scheduled == 0:
                await self._flush_deltas()
                self._work.clear()
                await wait_event(self._work, self.config.idle_sleep_s)
            elif not self._unpublished:
                await asyncio.sleep(0)  # RPCs run between steps (else the next step's publishing yields)

    async def _step_publishing(self, engine: Engine) -> StepResult:
        """One engine step, once the previous step's deltas are on the wire.

        The deltas go out first, not while the step computes: on CPU the forward
        pass needs the GIL between kernels, so publishing alongside it only slows
        it down. The step may compute on this thread (``exclusive``) unless a
        migration needs the loop meanwhile for its handshake and KV transfers.
        An engine whose step computes in another process (``overlaps_loop``, the
        torch engine's ``process`` core) starts the step first and publishes
        while it computes: there is no GIL to share.
        """
        if self._unpublished and not getattr(engine, "overlaps_loop", False):
            await self._flush_deltas()
            await asyncio.sleep(0)  # the NATS client's flusher writes them to the socket now
        self.request_spans.step_started()
        if not self._unpublished:
            return await self._engine_step(exclusive=self.migration.is_idle)
        step = asyncio.ensure_future(self._engine_step(exclusive=self.migration.is_idle))
        await asyncio.sleep(0)  # the step is planned and handed to the engine's process
        try:
            await self._flush_deltas()
        finally:
            result = await step
        return result

    async def _engine_step(self, *, exclusive: bool) -> StepResult:
        """One step of the engine, the warm-up's and every later one; the first may be a test's fault."""
        if not self._stepped and (fault := self.config.faults.first_step) is not None:
            self._stepped = True
            inject_first_step_fault(fault)
        self._stepped = True
        return await self.engine.step_async(exclusive=exclusive)

    def _after_step(self, result: StepResult) -> None:
        """Book a completed step's tokens and queue its deltas (sent by :meth:`_flush_deltas`)."""
        self._log_admissions_and_preemptions(result)
        spans = self.request_spans
        if spans:
            for output in result.outputs:
                finish = None if output.finish_reason is None else str(output.finish_reason)
                spans.output(output.request_id, output.first_index, len(output.token_ids), finish)
            for request_id in result.preempted:
                spans.preempted(request_id)
        # once per output of every step: the lookups are hoisted, and a streamed delta is recorded
        # and queued inline (what _queue_delta does, without two calls per request per step)
        live, unpublished, instance_id = self.deltas.live, self._unpublished, self.instance_id
        for output in result.outputs:
            tokens = live(output.request_id)
            if tokens is None:
                continue  # moved away or aborted while the step ran
            tokens.output_token_ids.extend(output.token_ids)
            if output.prompt_logprobs is not None:
                tokens.prompt_logprobs = output.prompt_logprobs
                tokens.prompt_top_logprobs = output.prompt_top_logprobs
            if tokens.stream:
                delta = TokenDelta(
                    request_id=output.request_id,
                    instance_id=instance_id,
                    owner_epoch=tokens.owner_epoch,
                    first_index=output.first_index,
                    token_ids=output.token_ids,
                    logprobs=output.logprobs,
                    top_logprobs=output.top_logprobs,
                    finish_reason=output.finish_reason,
                    num_prompt_tokens=len(tokens.prompt_token_ids),
                    num_cached_tokens=output.num_cached_tokens,
                    prompt_logprobs=output.prompt_logprobs,
                    prompt_top_logprobs=output.prompt_top_logprobs,
                )
                tokens.recent.append(delta)
                unpublished.append((tokens.delta_subject, delta))
            elif output.finish_reason is not None:
                self._queue_delta(
                    TokenDelta(
                        request_id=output.request_id,
                        instance_id=self.instance_id,
                        owner_epoch=tokens.owner_epoch,
                        first_index=0,
                        token_ids=tuple(tokens.output_token_ids),
                        finish_reason=output.finish_reason,
                        num_prompt_tokens=tokens.num_prompt_tokens,
                        num_cached_tokens=output.num_cached_tokens,
                        prompt_logprobs=tokens.prompt_logprobs,
                        prompt_top_logprobs=tokens.prompt_top_logprobs,
                    ),
                    tokens.delta_subject,
                )
            if output.finish_reason is not None:
                if output.finish_reason is not FinishReason.ABORT:
                    self.output_length.observe(len(tokens.output_token_ids))
                self._request_done(output.request_id)
                self.migration.request_gone(output.request_id, MigrationAbortReason.REQUEST_FINISHED)
        for request_id in result.preempted:
            self.migration.request_gone(request_id, MigrationAbortReason.REQUEST_PREEMPTED)
        self.migration.step_done(result.duration_s)
        self._last_step_s = result.duration_s
        for listener in self.step_listeners:
            listener(result)

    def _log_admissions_and_preemptions(self, result: StepResult) -> None:
        """Log ``RequestAdmitted`` for requests this step ran for the first time since they were
        accepted or preempted (the step started ``duration_s`` ago), and ``RequestPreempted``."""
        now = time.time()
        if self._queued_since:
            started = now - result.duration_s
            for output in result.outputs:
                queued = self._queued_since.pop(output.request_id, None)
                if queued is not None:
                    self._log_request_event(
                        RequestAdmitted(
                            request_id=output.request_id,
                            instance_id=self.instance_id,
                            queued_s=max(0.0, started - queued[0]),
                            readmission=queued[1],
                        )
                    )
        events = self.engine.take_events()
        freed = {e.request_id: e.num_blocks_freed for e in events if isinstance(e, PreemptionEvent)}
        for request_id in result.preempted:
            tokens = self.deltas.live(request_id)
            self._queued_since[request_id] = (now, True)
            self._log_request_event(
                RequestPreempted(
                    request_id=request_id,
                    instance_id=self.instance_id,
                    num_blocks_freed=freed.get(request_id, 0),
                    num_output_tokens=0 if tokens is None else len(tokens.output_token_ids),
                )
            )

    def _log_request_event(self, body: RequestAdmitted | RequestPreempted) -> None:
        async def append() -> None:
            try:
                await self.bus.append(
                    self.subjects.req(body.request_id), self.codec.encode(body, time=time.time())
                )
            except BusError as exc:
                log.info("agent %s: request event not logged: %s", self.instance_id, exc)

        self.spawn(append())

    def _queue_delta(self, delta: TokenDelta, batch_subject: str | None) -> None:
        self.deltas.record(delta)
        self._unpublished.append((batch_subject, delta))

    async def _flush_deltas(self) -> None:
        """Publish the queued deltas, oldest first: one batch per batch subject, the others one by one.

        Everything is encoded first (one time stamp), then sent.
        """
        while self._unpublished:
            queued, self._unpublished = self._unpublished, []
            now = time.time()
            encode, token_subject = self.codec.encode, self._token_subject
            batches: dict[str, list[TokenDelta]] = {}
            frames: list[tuple[str, bytes, str]] = []
            for batch_subject, delta in queued:
                if batch_subject is None:
                    subject = token_subject(delta.request_id)
                    frames.append((subject, encode(delta, time=now), delta.request_id))
                else:
                    batches.setdefault(batch_subject, []).append(delta)
            for subject, deltas in batches.items():
                batch = TokenDeltaBatch(instance_id=self.instance_id, deltas=tuple(deltas))
                frames.append((subject, encode(batch, time=now), f"{len(deltas)} requests"))
            for frame in frames:
                await self._send_frame(*frame)

    async def _publish_delta(self, delta: TokenDelta, batch_subject: str | None) -> None:
        """Publish one delta now, after those still queued (a request's deltas stay in order)."""
        self._queue_delta(delta, batch_subject)
        await self._flush_deltas()

    async def _send_frame(self, subject: str, data: bytes, what: str) -> None:
        try:
            await self.bus.publish(subject, data)
        except BusError as exc:
            log.warning("agent %s: publishing deltas of %s failed: %s", self.instance_id, what, exc)

    def _request_done(self, request_id: str) -> None:
        self.deltas.close(request_id)
        self._queued_since.pop(request_id, None)

    def _owner_delta(self, commit: Commit, finish_reason: FinishReason | None = None) -> TokenDelta:
        """A delta with no tokens from this agent as the migrated request's new owner (epoch + 1)."""
        return TokenDelta(
            request_id=commit.request_id,
            instance_id=self.instance_id,
            owner_epoch=commit.owner_epoch + 1,
            first_index=len(commit.token_ids) - commit.num_prompt_tokens,
            token_ids=(),
            finish_reason=finish_reason,
            num_prompt_tokens=commit.num_prompt_tokens,
        )

    async def publish_failure(self, commit: Commit, detail: str) -> None:
        """A migrated request could not be admitted after the log gave it to us: end its stream."""
        log.error("agent %s: migrated request %s lost: %s", self.instance_id, commit.request_id, detail)
        await self._publish_delta(
            self._owner_delta(commit, FinishReason.ABORT),
            commit.delta_subject,
        )

    def request_record(self, request_id: str) -> RequestTokens | None:
        """The agent's record of a live request (prompt, sampling, priority, epoch, tokens)."""
        return self.deltas.live(request_id)

    def forget_request(self, request_id: str) -> None:
        """A request that moved away: stop publishing for it (its buffer stays for resends)."""
        self._request_done(request_id)
        self.request_spans.close(request_id, attributes={"shoal.moved_away": True})

    def trace_context(self, request_id: str) -> Context | None:
        """The context of ``request_id``'s ``generate`` span here (None: not traced)."""
        return self.request_spans.context(request_id)

    def adopt_migrated(
        self, commit: Commit, *, trace_context: Context | None = None, queued: bool = False
    ) -> None:
        """A migrated request joined the engine here: publish its tokens with the next owner epoch.

        ``queued``: it moved without KV and waits in the queue here (counted as accepted, so the
        scheduler's pending dispatch for the move is reconciled)."""
        if queued:
            self.num_accepted += 1
            self._queued_since[commit.request_id] = (time.time(), False)
        if trace_context is not None:
            self.request_spans.open(commit.request_id, trace_context, {
                "shoal.owner_epoch": commit.owner_epoch + 1,
                "shoal.migrated_from": commit.source_id,
                "shoal.migration.id": commit.migration_id,
                "shoal.num_prompt_tokens": commit.num_prompt_tokens,
            })
        prompt = commit.token_ids[: commit.num_prompt_tokens]
        self.deltas.open(
            commit.request_id,
            owner_epoch=commit.owner_epoch + 1,
            stream=commit.stream,
            prompt_token_ids=prompt,
            sampling=commit.sampling,
            priority=commit.priority,
            output_token_ids=commit.token_ids[commit.num_prompt_tokens :],
            delta_subject=commit.delta_subject,
        )
        if queued:  # no token may come for a while: tell the frontend the new owner now
            self.spawn(self._publish_delta(self._owner_delta(commit), commit.delta_subject))
        self.wake()

    # ------------------------------------------------------------------ reports

    def load_report(self) -> LoadReport:
        """The load report of the engine as it is now (also used by tests); keeps the stats for metrics."""
        stats = self.last_engine_stats = self.engine.stats()
        queued = queued_in_order(stats)
        since = self._queued_since.get(queued[0].request_id) if queued else None
        return build_load_report(
            stats,
            instance_id=self.instance_id,
            seq=self._report_seq,
            block_size=self.engine.info.block_size,
            num_accepted=self.num_accepted,
            config=self.config.policy,
            terminating=self.terminating,
            num_migrating_out=self.migration.num_outgoing,
            num_migrating_in=self.migration.num_incoming,
            head_of_line_wait_s=0.0 if since is None else max(0.0, time.time() - since[0]),
            requeue_candidate=requeue_candidate(stats, self._may_move_queued) if queued else None,
            expected_output_tokens=self.output_length.expected_output_tokens,
        )

    def _may_move_queued(self, request: RequestStats) -> bool:
        """A queued request may move without KV once: it never moved here and is not moving."""
        record = self.deltas.live(request.request_id)
        return (
            record is not None
            and record.owner_epoch == 0
            and not self.migration.is_migrating(request.request_id)
        )

    async def _report_loop(self) -> None:
        loop = asyncio.get_running_loop()
        config = self.config
        interval, heartbeat = config.report_interval_s, config.heartbeat_interval_s
        while True:
            report = self.load_report()
            signature = load_signature(report)
            urgent = urgent_signature(report)
            now = self._report_attempt_at = loop.time()
            since = now - self._last_report_at
            if since >= heartbeat or (
                signature != self._last_signature
                and (
                    urgent != self._last_urgent
                    or self._last_signature is None
                    or since >= config.gradual_report_interval_s
                )
            ):
                self._report_seq += 1
                report = msgspec.structs.replace(report, seq=self._report_seq)
                try:
                    await self.bus.append(
                        self.subjects.load(self.instance_id),
                        self.codec.encode(report, time=time.time()),
                        timeout=max(1.0, heartbeat),
                    )
                except BusError as exc:
                    log.warning("agent %s: load report failed: %s", self.instance_id, exc)
                    self._report_error = str(exc) or type(exc).__name__
                else:
                    self._last_signature, self._last_urgent = signature, urgent
                    self._last_report_at = now
                    self._report_stored_at, self._report_error = loop.time(), ""
                    self.num_reports += 1
            slept_at = loop.time()
            await asyncio.sleep(interval)
            self._observe_loop_lag(loop.time() - slept_at - interval)

    def _observe_loop_lag(self, lag: float) -> None:
        """A timed sleep that woke ``lag`` late: every bus message waited as long (a step computing
        on the loop, a blocking call, a starved machine); a long one is logged, with its cause."""
        self.metrics.loop_lag.observe(max(0.0, lag))
        if lag >= _LOOP_LAG_WARNING_S:
            log.warning("agent %s: event loop blocked for %.1fs (last step %.2fs); RPCs waited as long",
                        self.instance_id, lag, self._last_step_s)

    # ------------------------------------------------------------------ orphans

    async def _orphan_loop(self) -> None:
        """Abort the requests nobody has listened to in two probes in a row (see the module docstring)."""
        suspects: set[str] = set()
        while True:
            await asyncio.sleep(self.config.orphan_check_interval_s)
            by_subject: dict[str, list[str]] = {}
            for request_id in self.deltas.live_ids():
                by_subject.setdefault(self._listening_subject(request_id), []).append(request_id)
            subjects = list(by_subject)
            unheard = await asyncio.gather(*(self._nobody_listens(s, by_subject[s][0]) for s in subjects))
            gone = {r for s, nobody in zip(subjects, unheard, strict=True) if nobody for r in by_subject[s]}
            for request_id in sorted(gone & suspects):
                if self.deltas.live(request_id) is None:
                    continue
                log.warning("agent %s: nobody listens to %s any more (its frontend is gone): aborting",
                            self.instance_id, request_id)
                self.num_orphans_aborted += 1
                await self.abort(request_id)
            suspects = gone - suspects

    def _listening_subject(self, request_id: str) -> str:
        """Where a request's tokens go: its frontend's batch subject, else the request's own token subject."""
        tokens = self.deltas.live(request_id)
        if tokens is not None and tokens.delta_subject is not None:
            return tokens.delta_subject
        return self._token_subject(request_id)

    async def _nobody_listens(self, subject: str, request_id: str) -> bool:
        probe = TokenProbe(request_id=request_id, instance_id=self.instance_id)
        try:
            await self.bus.request(subject, self.codec.encode(probe, time=time.time()),
                                   timeout=self.config.orphan_probe_timeout_s)
        except NoResponders:
            return True
        except BusError:
            return False
        return False

    # ------------------------------------------------------------------ RPCs

    def _reply(self, body: Body) -> bytes:
        return self.codec.encode(body, time=time.time())

    def _decode(self, data: bytes, expected: type) -> Any:
        envelope = self.codec.decode_or_none(data)
        if envelope is None or not isinstance(envelope.body, expected):
            return None
        return envelope.body

    async def _serve_generate(self, data: bytes, headers: dict[str, str]) -> bytes:
        request: GenerateRequest | None = self._decode(data, GenerateRequest)
        if request is None:
            return self._reply(RpcError(code=RpcErrorCode.BAD_REQUEST, message="expected a GenerateRequest"))
        try:  # its deltas go to a subject named after it, unless it names one
            self._token_subject(request.request_id)
        except ValueError as exc:
            return self._reply(RpcError(code=RpcErrorCode.BAD_REQUEST, message=f"request_id: {exc}"))
        if request.delta_subject is not None:
            try:
                validate_subject(request.delta_subject)
            except InvalidName as exc:
                return self._reply(RpcError(code=RpcErrorCode.BAD_REQUEST, message=f"delta_subject: {exc}"))
        traced = bus_tracing.header(headers, bus_tracing.TRACEPARENT) is not None
        return self._reply(self.generate(request, trace_context=parent_context(headers) if traced else None))

    def generate(self, request: GenerateRequest, *, trace_context: Context | None = None) -> GenerateReply:
        """Start a request; the reply says whether it was accepted.

        Idempotent by (request id, owner epoch): a retried generate gets the
        first reply, while a rescue (the next owner epoch) of a request that
        once ran here — and has since moved away — starts it again.
        """
        key = (request.request_id, request.owner_epoch)
        cached = self._replies.get(key)
        if cached is not None:
            return cached
        if self.terminating:
            return self._refusal(request, RejectReason.TERMINATING, "instance is terminating")
        if request.request_id in self._aborted_unknown:  # the abort overtook it: nobody waits for it
            return self._refusal(request, RejectReason.ABORTED, "aborted here before it arrived")
        num_prompt = (
            len(request.token_ids) if request.num_prompt_tokens is None else request.num_prompt_tokens
        )
        prompt = request.token_ids[:num_prompt]
        outputs = request.token_ids[num_prompt:]
        try:
            added = self.engine.add_request(
                request.request_id,
                prompt,
                request.sampling,
                request.priority,
                output_token_ids=outputs,
            )
        except RequestRejected as exc:
            reply = self._refusal(request, exc.reason, str(exc))
        else:
            if added:
                self.num_accepted += 1
                self._queued_since[request.request_id] = (time.time(), False)
                self.deltas.open(
                    request.request_id,
                    owner_epoch=request.owner_epoch,
                    stream=request.stream,
                    prompt_token_ids=prompt,
                    sampling=request.sampling,
                    priority=request.priority,
                    output_token_ids=outputs,
                    delta_subject=request.delta_subject,
                )
                if trace_context is not None:
                    self.request_spans.open(request.request_id, trace_context, {
                        "shoal.owner_epoch": request.owner_epoch,
                        "shoal.rescue": request.owner_epoch > 0,
                        "shoal.num_prompt_tokens": len(prompt),
                        "shoal.num_resumed_tokens": len(outputs),
                    })
                self.wake()
            reply = GenerateReply(
                request_id=request.request_id,
                instance_id=self.instance_id,
                accepted=True,
                num_accepted=self.num_accepted,
            )
        self._replies[key] = reply
        while len(self._replies) > _REPLY_CACHE:
            self._replies.popitem(last=False)
        return reply

    def _refusal(self, request: GenerateRequest, reason: RejectReason, detail: str) -> GenerateReply:
        return GenerateReply(
            request_id=request.request_id,
            instance_id=self.instance_id,
            accepted=False,
            num_accepted=self.num_accepted,
            reason=reason,
            detail=detail,
        )

    async def _serve_abort(self, data: bytes, headers: dict[str, str]) -> bytes:
        request: AbortRequest | None = self._decode(data, AbortRequest)
        if request is None:
            return self._reply(RpcError(code=RpcErrorCode.BAD_REQUEST, message="expected an AbortRequest"))
        return self._reply(await self.abort(request.request_id))

    async def abort(self, request_id: str) -> AbortReply:
        """Abort a request here; publishes a final delta with ``FinishReason.ABORT``.

        An abort for a request this agent never heard of is remembered (the latest
        ``_ABORTED_UNKNOWN``): a generate for it that arrives later, one the frontend gave up
        waiting for, is refused (``RejectReason.ABORTED``) instead of run for nobody.
        """
        found = self.engine.abort(request_id)
        if not found and self.deltas.get(request_id) is None:
            self._aborted_unknown[request_id] = None
            while len(self._aborted_unknown) > _ABORTED_UNKNOWN:
                self._aborted_unknown.popitem(last=False)
        tokens = self.deltas.live(request_id)
        if found and tokens is not None:
            await self._publish_delta(
                TokenDelta(
                    request_id=request_id,
                    instance_id=self.instance_id,
                    owner_epoch=tokens.owner_epoch,
                    first_index=len(tokens.output_token_ids),
                    token_ids=(),
                    finish_reason=FinishReason.ABORT,
                    num_prompt_tokens=tokens.num_prompt_tokens,
                ),
                tokens.delta_subject,
            )
            self._request_done(request_id)
        if found:
            self.request_spans.close(request_id, attributes={"shoal.aborted": True})
            self.migration.request_gone(request_id, MigrationAbortReason.REQUEST_ABORTED)
        return AbortReply(request_id=request_id, found=found)

    async def _serve_resend(self, data: bytes, headers: dict[str, str]) -> bytes:
        request: ResendRequest | None = self._decode(data, ResendRequest)
        if request is None:
            return self._reply(RpcError(code=RpcErrorCode.BAD_REQUEST, message="expected a ResendRequest"))
        deltas = self.deltas.resend(request.request_id, request.from_index)
        record = self.deltas.get(request.request_id)
        if deltas is None or record is None:
            return self._reply(CommandReply(accepted=False, reason=CommandRejectReason.UNKNOWN_REQUEST))
        if record.delta_subject is not None:
            batch = TokenDeltaBatch(instance_id=self.instance_id, deltas=tuple(deltas))
            await self.bus.publish(record.delta_subject, self.codec.encode(batch, time=time.time()))
        else:
            for delta in deltas:
                await self.bus.publish(
                    self.subjects.tok(delta.request_id), self.codec.encode(delta, time=time.time())
                )
        return self._reply(CommandReply(accepted=True, detail=f"{len(deltas)} deltas"))

    def _epoch_ok(self, epoch: int) -> bool:
        if epoch < self._epoch_seen:
            return False
        self._epoch_seen = epoch
        return True

    async def _serve_migrate_out(self, data: bytes, headers: dict[str, str]) -> bytes:
        command: MigrateOut | None = self._decode(data, MigrateOut)
        if command is None:
            return self._reply(RpcError(code=RpcErrorCode.BAD_REQUEST, message="expected a MigrateOut"))
        if not self._epoch_ok(command.epoch):
            return self._reply(CommandReply(accepted=False, reason=CommandRejectReason.STALE_EPOCH))
        return self._reply(await self.migration.command_migrate_out(command))

    async def _serve_move_queued(self, data: bytes, headers: dict[str, str]) -> bytes:
        command: MoveQueued | None = self._decode(data, MoveQueued)
        if command is None:
            self.num_malformed_commands += 1
            return self._reply(RpcError(code=RpcErrorCode.BAD_REQUEST, message="expected a MoveQueued"))
        if not self._epoch_ok(command.epoch):
            return self._reply(CommandReply(accepted=False, reason=CommandRejectReason.STALE_EPOCH))
        return self._reply(await self.migration.move_queued(command))

    async def _serve_stop_migration(self, data: bytes, headers: dict[str, str]) -> bytes:
        command: StopMigration | None = self._decode(data, StopMigration)
        if command is None:
            return self._reply(RpcError(code=RpcErrorCode.BAD_REQUEST, message="expected a StopMigration"))
        if not self._epoch_ok(command.epoch):
            return self._reply(CommandReply(accepted=False, reason=CommandRejectReason.STALE_EPOCH))
        stopped = self.migration.command_stop(command.destination_id)
        return self._reply(CommandReply(accepted=True, detail="stopped" if stopped else "no such command"))

    async def _serve_drain(self, data: bytes, headers: dict[str, str]) -> bytes:
        command: Drain | None = self._decode(data, Drain)
        if command is None:
            return self._reply(RpcError(code=RpcErrorCode.BAD_REQUEST, message="expected a Drain"))
        if not self._epoch_ok(command.epoch):
            return self._reply(CommandReply(accepted=False, reason=CommandRejectReason.STALE_EPOCH))
        await self.drain()
        return self._reply(CommandReply(accepted=True, detail="terminating"))

    async def _serve_stats(self, data: bytes, headers: dict[str, str]) -> bytes:
        """The engine's usage now (any request body): a :class:`~schemas.LoadReport` built on the spot."""
        return self._reply(self.load_report())

    def liveness(self) -> Liveness:
        """Whether this agent still sends load reports (the scheduler's probe of a silent instance).

        ``reporting`` holds while the report loop runs and began a report within twice the append
        timeout plus the report interval: a loop blocked on a stream without a leader qualifies, a
        loop that died or was stopped does not.
        """
        now = asyncio.get_running_loop().time()
        config = self.config
        bound = 2 * (max(1.0, config.heartbeat_interval_s) + config.report_interval_s)
        attempt, stored = self._report_attempt_at, self._report_stored_at
        running = self._report_task is not None and not self._report_task.done()
        return Liveness(
            instance_id=self.instance_id,
            reporting=running and attempt is not None and now - attempt <= bound,
            seconds_since_attempt=None if attempt is None else round(now - attempt, 3),
            seconds_since_stored=None if stored is None else round(now - stored, 3),
            last_error=self._report_error,
        )

    async def _serve_liveness(self, data: bytes, headers: dict[str, str]) -> bytes:
        """:meth:`liveness` (any request body)."""
        return self._reply(self.liveness())

    async def drain(self, reason: TerminateReason = TerminateReason.SCALE_DOWN) -> None:
        """Terminate: refuse new requests, report terminating, stop once every request has left."""
        if self.terminating:
            return
        self.terminating = self._draining = True
        self._last_signature = None
        await self._append_instance_event(InstanceTerminating(instance_id=self.instance_id, reason=reason))
        self.wake()

    async def _finish_drain(self) -> None:
        await self.stop()

    async def migrate(
        self, request_id: str, destination_id: str, *, config: MigrationConfig | None = None
    ) -> MigrationOutcome:
        """Migrate one running request to ``destination_id`` now and wait for the outcome.

        ``config`` overrides the agent's migration settings for this migration only.
        """
        return await self.migration.migrate(request_id, destination_id, config=config)

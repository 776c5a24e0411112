"""The frontend's bus side: placing requests, following their token streams, bypass and rescue.

:class:`Gateway` owns the frontend's view of the cluster (a :class:`~frontend.board.LoadBoard`
fed by tailing instance events and load reports) and opens one
:class:`RequestStream` per client request. The gateway subscribes once, at
start, to its own token subject (``Subjects.tok_batch``): every request it
places names that subject (``GenerateRequest.delta_subject``), so agents send
all of this frontend's deltas of one step in one :class:`~schemas.TokenDeltaBatch`,
and the gateway hands each delta to its request's stream. Per request, as the
contract says:

1. register the request's stream (its deltas are routed to it) *before* placing it;
2. ask the scheduler (``rpc_dispatch``, short timeout) with the prompt's block-hash chain
   (:func:`schemas.block_hash.block_hashes`, computed once per prompt: :meth:`Gateway.prompt_chain`)
   for its prefix index; on a timeout, no responders, an error or no answer, place it from the
   board (bypass mode);
3. send ``GenerateRequest`` to the chosen agent; an agent that does not answer
   or refuses for its own reasons is excluded and the placement retried. A
   refusal is decided on its :class:`~schemas.reasons.RejectReason`: a client
   fault (:data:`CLIENT_FAULTS`) is the client's OpenAI error at once;
4. reassemble deltas (:class:`~frontend.streams.DeltaAssembler`), ask the
   owner to resend from a gap that outlives ``gap_grace``; keep the prompt tokens the engine
   that produced the first tokens found in its prefix cache (``num_cached_tokens``: usage's
   ``cached_tokens``, whatever instance continues the request);
5. rescue — re-place prompt + generated tokens with the next owner epoch —
   when the owner is declared failed, falls silent on the board, or the stream
   stalls for ``stall_timeout`` since admission or the last token. A rescue that
   finds no instance is tried again every second; once ``rescue_timeout`` has
   passed since the first such try, the request fails with a 503
   (:func:`~frontend.errors.unavailable`) and closes as ``CloseReason.NO_INSTANCE``; and
6. close it with a :class:`~schemas.reasons.CloseReason`, which the abort sent
   to its owner and the lifecycle log carry.

Closing a stream that has not finished aborts the request on its owner (a
client that went away frees its blocks). Lifecycle events go to
:class:`~frontend.lifecycle.LifecycleLog`. Text and stop strings live in
:mod:`frontend.turns`, HTTP in :mod:`frontend.routes`; this module speaks token ids only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from bus import Bus, BusError, RequestTimeout, Subscription
from bus import tracing as bus_tracing
from bus.event_loop import cancel_and_wait
from frontend import tracing
from frontend.board import LoadBoard
from frontend.config import FrontendConfig
from frontend.errors import APIError, context_length_exceeded, invalid_parameter, unavailable
from frontend.lifecycle import LifecycleLog
from frontend.metrics import FrontendMetrics
from frontend.streams import Accepted, DeltaAssembler
from schemas import (
    AbortRequest,
    BypassReason,
    CloseReason,
    Codec,
    DispatchReply,
    DispatchRequest,
    FinishReason,
    GenerateReply,
    GenerateRequest,
    RejectReason,
    ResendRequest,
    SamplingParams,
    TokenDelta,
    TokenDeltaBatch,
)
from schemas.block_hash import block_hashes, extend_block_hashes, root_hash
from schemas.requests import (
    RequestAborted,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPlaced,
    RequestRescued,
)

__all__ = [
    "CLIENT_FAULTS", "NO_CHAIN", "Chain", "DeltaInbox", "Gateway", "Job", "RequestStream",
    "common_block_size",
]

log = logging.getLogger(__name__)

#: Agent refusals that another instance would repeat: the client's request is at fault, and the
#: client gets this OpenAI error. Any other refusal (``EXCEEDS_CAPACITY``, ``TERMINATING``) is the
#: instance's: the request is tried on another one, and 503 if none takes it.
CLIENT_FAULTS: Mapping[RejectReason, Callable[[str], APIError]] = {
    RejectReason.EMPTY_PROMPT: invalid_parameter,
    RejectReason.TOKEN_OUT_OF_RANGE: invalid_parameter,
    RejectReason.INVALID_SAMPLING: invalid_parameter,
    RejectReason.EXCEEDS_MODEL_CONTEXT: context_length_exceeded,
}


class Bypass(NamedTuple):
    """Why the frontend placed a request itself (logged in ``RequestPlaced``)."""

    reason: BypassReason
    detail: str = ""


def _bypass_of(reply: object) -> Bypass:
    """Why a scheduler's answer gave no usable instance."""
    if not isinstance(reply, DispatchReply):
        return Bypass(BypassReason.MALFORMED_REPLY, "not a DispatchReply")
    if reply.instance_id:
        return Bypass(BypassReason.SCHEDULER_EXCLUDED, f"it chose {reply.instance_id}, which is excluded")
    reason = "" if reply.reason is None else reply.reason.value
    return Bypass(BypassReason.SCHEDULER_REFUSED, f"{reason}: {reply.detail}" if reply.detail else reason)


def common_block_size(block_sizes: Iterable[int]) -> int:
    """The block size most instances use (the smallest among equals); 0 when there is none."""
    counts = Counter(size for size in block_sizes if size > 0)
    if not counts:
        return 0
    return min(counts, key=lambda size: (-counts[size], size))


class Chain(NamedTuple):
    """A prompt's block-hash chain (:func:`schemas.block_hash.block_hashes`) for blocks of
    ``block_size`` tokens; ``block_size`` 0: none was computed."""

    block_size: int = 0
    hashes: tuple[int, ...] = ()


#: no chain: the scheduler places without its prefix index
NO_CHAIN = Chain()


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One request as the gateway runs it: token ids, engine sampling parameters, the prompt's chain."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0
    deadline: float | None = None  # monotonic seconds
    #: the prompt's block-hash chain (``Gateway.prompt_chain``), sent with every placement
    chain: Chain = NO_CHAIN


class Gateway:
    """Places requests and follows their streams. ``await start()`` before use, ``stop()`` after."""

    def __init__(
        self,
        bus: Bus,
        config: FrontendConfig,
        *,
        metrics: FrontendMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.config = config
        self.subjects = bus.config.subjects
        self.codec = Codec(producer="frontend")
        self.clock = clock
        self.board = LoadBoard(policy=config.dispatch_policy, stale_after=config.instance_stale_after)
        self.metrics = metrics or FrontendMetrics(
            lambda: self.board.loads(self.clock()), lambda: self.board.readiness_view(self.clock())
        )
        self.lifecycle = LifecycleLog(bus, self.codec)
        self._tasks: set[asyncio.Task[None]] = set()
        self.streams: dict[str, RequestStream] = {}
        self.num_scheduler_placements = 0
        self.scheduler_quiet_until = 0.0  # after a dispatch timed out: bypass without asking until then
        #: this frontend's token subject: agents publish its requests' deltas there, a batch per step
        self.delta_subject = self.subjects.tok_batch(f"f{uuid.uuid4().hex[:12]}")
        self.deltas_closed = False
        self._delta_subscription: Subscription | None = None

    # -- life ----------------------------------------------------------------
    async def start(self) -> None:
        self._delta_subscription = await self.bus.subscribe(self.delta_subject)
        self._spawn(self._route_deltas(self._delta_subscription), "route-deltas")
        await self.lifecycle.start()
        events = [f"{self.subjects.prefix}.ev.instance.*"]
        self._spawn(self._tail(self.subjects.events_stream, events), "tail-instances")
        self._spawn(self._tail(self.subjects.loads_stream, None), "tail-loads")

    async def stop(self) -> None:
        for stream in list(self.streams.values()):
            await stream.close(CloseReason.SHUTDOWN)
        await cancel_and_wait(self._tasks)
        if self._delta_subscription is not None:
            with contextlib.suppress(Exception):
                await self._delta_subscription.unsubscribe()
        await self.lifecycle.close()

    def _spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.ensure_future(coroutine)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tail(self, stream: str, subjects: list[str] | None) -> None:
        while True:
            try:
                async with self.bus.tail(stream, from_seq=1, subjects=subjects) as feed:
                    async for message in feed:
                        envelope = self.codec.decode_or_none(message.data)
                        if envelope is None:
                            continue
                        position = message.position
                        age = max(0.0, time.time() - message.time) if message.time > 0 else 0.0
                        try:
                            self.board.observe(position, envelope.body, self.clock() - age)
                        except Exception as exc:  # a fold error must not stop the tail
                            log.warning("board could not fold %s: %s", position, exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("tail of %s failed (%s); retrying", stream, exc)
                await asyncio.sleep(0.5)

    async def _route_deltas(self, subscription: Subscription) -> None:
        """Hand every delta on this frontend's token subject to its request's stream."""
        streams = self.streams
        try:
            async for message in subscription:
                envelope = self.codec.decode_or_none(message.data)
                body = envelope.body if envelope is not None else None
                if isinstance(body, TokenDeltaBatch):
                    deltas: tuple[TokenDelta, ...] = body.deltas
                elif isinstance(body, TokenDelta):
                    deltas = (body,)
                else:
                    continue  # malformed (counted by the codec) or not a delta
                for delta in deltas:
                    stream = streams.get(delta.request_id)
                    if stream is not None:
                        stream.inbox.put(delta)
        finally:  # the subscription ended (the connection closed): streams cannot get tokens any more
            self.deltas_closed = True
            for stream in list(streams.values()):
                stream.inbox.put(None)

    def fire_and_forget(self, coroutine: Coroutine[Any, Any, None], name: str = "background") -> None:
        self._spawn(coroutine, name)

    # -- requests ------------------------------------------------------------
    def max_model_len(self) -> int:
        return self.board.max_model_len(self.config.max_model_len)

    def prefix_block_size(self) -> int:
        """The block size of the chains sent to the scheduler: ``config.prefix_block_size``, or when
        that is None the one most instances announced (0: no chain)."""
        configured = self.config.prefix_block_size
        if configured is not None:
            return configured
        board = self.board
        return common_block_size(
            record.joined.block_size for instance_id, record in board.state.instances.items()
            if not board.is_failed(instance_id)
        )

    def prompt_chain(self, prompt_ids: Sequence[int]) -> Chain:
        """``prompt_ids``' block-hash chain for the scheduler's prefix index (empty when off)."""
        block_size = self.prefix_block_size()
        if block_size <= 0:
            return NO_CHAIN
        return Chain(block_size, tuple(block_hashes(prompt_ids, block_size)))

    async def open(self, job: Job) -> RequestStream:
        """Register, place and start ``job``; raises :class:`APIError` if no instance takes it."""
        if self.deltas_closed or self._delta_subscription is None:
            raise unavailable("the frontend is not receiving tokens (not started, or its bus closed)",
                              self.config.retry_after_s)
        stream = RequestStream(self, job)
        self.lifecycle.emit(RequestArrived(
            request_id=job.request_id, num_prompt_tokens=len(job.prompt_ids),
            max_tokens=job.sampling.max_tokens, priority=job.priority,
        ))
        self.streams[job.request_id] = stream
        tracing.mark({"request.id": job.request_id, "request.num_prompt_tokens": len(job.prompt_ids)})
        try:
            await stream.start()
        except BaseException:
            await stream.close(CloseReason.UNPLACED)
            raise
        return stream

    async def place(
        self, request: GenerateRequest, exclude: tuple[str, ...] = (), chain: Chain = NO_CHAIN
    ) -> tuple[str, Bypass | None]:
        """Place and start ``request`` on some instance; returns the instance and, if the frontend
        placed it itself, why. ``chain``: the block-hash chain of ``request.token_ids``."""
        excluded = list(exclude)
        last_error = "no instance is available"
        for _ in range(self.config.max_placement_attempts):
            instance_id, bypass = await self._choose(request, tuple(excluded), chain)
            if instance_id is None:
                break
            outcome = await self._generate(instance_id, request)
            if outcome is None:
                if bypass is not None:
                    self.metrics.bypass.inc()
                else:
                    self.num_scheduler_placements += 1
                    self.metrics.scheduler_placements.inc()
                tracing.mark({"placement.instance": instance_id, "placement.bypass": bypass is not None})
                return instance_id, bypass
            last_error = outcome
            excluded.append(instance_id)
        raise unavailable(f"no instance could take the request: {last_error}", self.config.retry_after_s)

    async def _choose(
        self, request: GenerateRequest, exclude: tuple[str, ...], chain: Chain
    ) -> tuple[str | None, Bypass | None]:
        num_prompt = len(request.token_ids)
        ask = DispatchRequest(
            request_id=request.request_id, num_prompt_tokens=num_prompt, priority=request.priority,
            exclude=exclude, block_size=chain.block_size, block_hashes=chain.hashes,
        )
        bypass = Bypass(BypassReason.SCHEDULER_QUIET, "a dispatch timed out recently")
        if self.clock() >= self.scheduler_quiet_until:
            try:
                reply = await self.bus.request(
                    self.subjects.rpc_dispatch, self.codec.encode(ask, time=time.time()),
                    timeout=self.config.dispatch_timeout, headers=bus_tracing.inject({}),
                )
                envelope = self.codec.decode_or_none(reply.data)
                body = envelope.body if envelope is not None else None
                if isinstance(body, DispatchReply) and body.instance_id and body.instance_id not in exclude:
                    return body.instance_id, None
                bypass = _bypass_of(body)
            except RequestTimeout as exc:  # a scheduler that hangs: stop waiting on it for a while
                self.scheduler_quiet_until = self.clock() + self.config.scheduler_backoff
                log.info("dispatch timed out (%s); bypass for %.1fs", exc, self.config.scheduler_backoff)
                bypass = Bypass(BypassReason.SCHEDULER_TIMEOUT, str(exc))
            except BusError as exc:
                log.debug("dispatch for %s fell back to bypass: %s", request.request_id, exc)
                bypass = Bypass(BypassReason.SCHEDULER_UNREACHABLE, str(exc))
        decision = self.board.choose(
            request.request_id, num_prompt, priority=request.priority, exclude=exclude, now=self.clock()
        )
        if decision is None:
            return None, bypass
        self.board.record_placement(decision.instance_id, decision.demand_blocks)
        return decision.instance_id, bypass

    async def _generate(self, instance_id: str, request: GenerateRequest) -> str | None:
        """Start ``request`` on ``instance_id``; None on success, else why not (client faults raise).

        An agent that does not answer in ``generate_timeout`` may be busy (a long step, a loaded
        machine) or may have started the request and its answer be late, so it is asked again,
        ``generate_retries`` times: generate is idempotent by (request id, owner epoch), and a
        retry gets the first answer. An instance given up on is sent an abort, so a request it
        starts late does not run for nobody.
        """
        subject = self.subjects.rpc_agent(instance_id, "generate")
        timed_out: RequestTimeout | None = None
        for _ in range(1 + self.config.generate_retries):
            try:
                reply = await self.bus.request(
                    subject, self.codec.encode(request, time=time.time()),
                    timeout=self.config.generate_timeout, headers=bus_tracing.inject({}),
                )
            except asyncio.CancelledError:  # given up on (a rescue's bound): it must not run for nobody
                self.fire_and_forget(
                    self.send_abort(instance_id, request.request_id, CloseReason.UNPLACED), "abort-cancelled"
                )
                raise
            except RequestTimeout as exc:
                timed_out = exc
                self.metrics.generate_timeouts.inc()
                log.warning("%s did not answer generate %s in %.1fs", instance_id, request.request_id,
                            self.config.generate_timeout)
                continue
            except BusError as exc:
                return f"{instance_id}: {exc}"
            break
        else:
            self.fire_and_forget(
                self.send_abort(instance_id, request.request_id, CloseReason.UNPLACED), "abort-unanswered"
            )
            return f"{instance_id}: {timed_out}"
        envelope = self.codec.decode_or_none(reply.data)
        body = envelope.body if envelope is not None else None
        if isinstance(body, GenerateReply):
            if body.accepted:
                return None
            reason = body.reason
            if reason is not None:
                self.metrics.refusals.labels(reason=reason).inc()
            explain = body.detail or (reason or "refused")
            client_fault = CLIENT_FAULTS.get(reason) if reason is not None else None
            if client_fault is not None:
                raise client_fault(explain)
            return f"{instance_id}: {explain}"
        return f"{instance_id}: unexpected reply"

    async def send_abort(self, instance_id: str, request_id: str, reason: CloseReason) -> None:
        with contextlib.suppress(BusError):
            await self.bus.request(
                self.subjects.rpc_agent(instance_id, "abort"),
                self.codec.encode(AbortRequest(request_id=request_id, reason=reason), time=time.time()),
                timeout=self.config.generate_timeout,
            )

    async def send_resend(self, instance_id: str, request_id: str, from_index: int) -> None:
        with contextlib.suppress(BusError):
            await self.bus.request(
                self.subjects.rpc_agent(instance_id, "resend"),
                self.codec.encode(
                    ResendRequest(request_id=request_id, from_index=from_index), time=time.time()
                ),
                timeout=self.config.generate_timeout,
            )


class DeltaInbox:
    """One request's deltas as the gateway routes them, for the one task that reads them.

    :meth:`get` waits for the next item or for the inbox's tick, whichever comes first: the
    tick is one timer, started by a wait that finds none pending and not moved by the items
    that arrive meanwhile, so a reader woken by a delta per engine step does not start and
    cancel a timer per delta (:func:`asyncio.timeout` would), and still wakes at least every
    ``tick`` seconds when nothing comes.
    """

    __slots__ = ("_items", "_tick", "_waiter")

    def __init__(self) -> None:
        self._items: deque[TokenDelta | None] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._tick: asyncio.TimerHandle | None = None

    def put(self, item: TokenDelta | None) -> None:
        """Queue a delta (None: the gateway's subscription ended) and wake the reader."""
        self._items.append(item)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_tick(self) -> None:
        self._tick = None
        self._wake()

    async def get(self, tick: float) -> TokenDelta | None:
        """The next item; None when the tick came first (or the subscription ended)."""
        if not self._items:
            loop = asyncio.get_running_loop()
            if self._tick is None:
                self._tick = loop.call_later(tick, self._on_tick)
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None
            if not self._items:
                return None
        return self._items.popleft()

    def close(self) -> None:
        """Stop the tick (the stream ended)."""
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None


class RequestStream:
    """One request's ordered tokens; iterate with ``await next_chunk()`` until it returns None."""

    def __init__(self, gateway: Gateway, job: Job) -> None:
        self.gateway = gateway
        self.job = job
        #: this request's deltas, routed by the gateway; None when the gateway's subscription ended
        self.inbox = DeltaInbox()
        self.assembler = DeltaAssembler()
        self.generated: list[int] = []
        self.owner_id: str | None = None
        self.bypass = False
        self.arrival = gateway.clock()
        self.first_token_at: float | None = None
        self.last_progress = self.arrival
        self.gap_since: float | None = None
        self.num_rescues = 0
        self.next_rescue_at = 0.0
        #: when a rescue first found no instance (None: none has, or the last one succeeded)
        self.unplaced_since: float | None = None
        self.unplaced_why = ""
        self.unplaced_cause = ""
        self.closed = False
        self.close_reason: CloseReason | None = None
        self.finish_reason: FinishReason | None = None
        #: prompt tokens the engine that produced the first tokens found in its prefix cache
        #: (None until a token came)
        self.num_cached_tokens: int | None = None

    @property
    def request_id(self) -> str:
        return self.job.request_id

    def _request(self, generated: tuple[int, ...], epoch: int) -> GenerateRequest:
        return GenerateRequest(
            request_id=self.job.request_id,
            token_ids=self.job.prompt_ids + generated,
            sampling=self.job.sampling,
            priority=self.job.priority,
            num_prompt_tokens=len(self.job.prompt_ids),
            first_index=len(generated),
            owner_epoch=epoch,
            stream=True,
            delta_subject=self.gateway.delta_subject,
        )

    async def start(self) -> None:
        gateway = self.gateway
        self.owner_id, bypass = await gateway.place(self._request((), 0), chain=self.job.chain)
        self.bypass = bypass is not None
        self.assembler.expect_epoch(0, self.owner_id)
        self.last_progress = gateway.clock()
        gateway.lifecycle.emit(RequestPlaced(
            request_id=self.request_id, instance_id=self.owner_id, bypass=self.bypass,
            bypass_reason=None if bypass is None else bypass.reason,
            bypass_detail="" if bypass is None else bypass.detail,
        ))

    async def next_chunk(self) -> Accepted | None:
        """The next tokens in order (a chunk with ``finish_reason`` ends it); None once finished."""
        gateway = self.gateway
        config = gateway.config
        tick = min(config.gap_grace, 0.25)
        while not self.assembler.finished:
            delta = await self.inbox.get(tick)
            if delta is None and gateway.deltas_closed:
                raise APIError(503, "the token stream closed unexpectedly")
            now = gateway.clock()
            if self.job.deadline is not None and now >= self.job.deadline:
                await self._end_early(FinishReason.LENGTH)
                break
            if delta is not None:
                chunk = self._on_delta(delta, now)
                if chunk is not None:
                    return chunk
            await self._watch(now)
        return None

    def _on_delta(self, delta: TokenDelta, now: float) -> Accepted | None:
        if delta.request_id != self.request_id:
            return None
        epoch_before = self.assembler.owner_epoch
        stale_before = self.assembler.num_stale + self.assembler.num_duplicates
        accepted = self.assembler.accept(delta)
        metrics = self.gateway.metrics
        if self.assembler.num_stale + self.assembler.num_duplicates > stale_before:
            metrics.stale_deltas.inc()
        if self.assembler.owner_epoch > epoch_before:
            metrics.migrations.inc()
        if self.assembler.owner_id is not None:
            self.owner_id = self.assembler.owner_id
        self.gap_since = (self.gap_since or now) if self.assembler.gap_from is not None else None
        if not accepted.token_ids and accepted.finish_reason is None:
            return None
        if accepted.token_ids:
            if self.num_cached_tokens is None:
                self.num_cached_tokens = delta.num_cached_tokens
            self.generated.extend(accepted.token_ids)
            self.last_progress = now
            if self.first_token_at is None:
                self.first_token_at = now
                tracing.event("first_token", instance=self.owner_id or "")
                self.gateway.metrics.ttft.observe(now - self.arrival)
                self.gateway.lifecycle.emit(RequestFirstToken(
                    request_id=self.request_id, instance_id=delta.instance_id, ttft_s=now - self.arrival
                ))
        if accepted.finish_reason is not None:
            self.finish_reason = accepted.finish_reason
        return accepted

    async def _watch(self, now: float) -> None:
        """Deadline, gap repair, owner failure and stall checks between messages."""
        gateway, config = self.gateway, self.gateway.config
        if self.gap_since is not None and now - self.gap_since >= config.gap_grace and self.owner_id:
            gap = self.assembler.gap_from
            if gap is not None:
                gateway.metrics.resends.inc()
                gateway.fire_and_forget(gateway.send_resend(self.owner_id, self.request_id, gap), "resend")
            self.gap_since = now
        if now < self.next_rescue_at:
            return
        owner = self.owner_id
        if self.unplaced_since is not None:  # a rescue found no instance: try again, whatever the owner does
            await self.rescue(self.unplaced_cause)
        elif owner is not None and (gateway.board.is_failed(owner) or gateway.board.is_silent(owner, now)):
            await self.rescue("failed")
        elif now - self.last_progress >= config.stall_timeout:
            await self.rescue("stall")

    async def _end_early(self, reason: FinishReason) -> None:
        if self.owner_id is not None:
            self.gateway.fire_and_forget(
                self.gateway.send_abort(self.owner_id, self.request_id, CloseReason.DEADLINE), "abort"
            )
        self.assembler.finish_reason = reason
        self.finish_reason = reason

    async def rescue(self, cause: str) -> None:
        """Continue the request elsewhere from its prompt plus the tokens generated so far.

        The instance it leaves is excluded, on later tries only while the board counts it failed
        or silent. When no instance takes it, it is tried again a second later; once
        ``rescue_timeout`` has passed since the first try that found none, the request is closed
        as ``CloseReason.NO_INSTANCE`` and a 503 :class:`APIError` raised. A placement in
        progress is cut off at that bound.
        """
        gateway = self.gateway
        bound = gateway.config.rescue_timeout
        failed = self.owner_id or ""
        if failed and self.unplaced_since is None:  # it may be alive but stuck: stop it producing (once:
            # an agent restarted under its id remembers an abort of a request it never had, and refuses it)
            gateway.fire_and_forget(gateway.send_abort(failed, self.request_id, CloseReason.RESCUED), "abort")
        generated = tuple(self.generated)
        if len(generated) >= max(self.job.sampling.max_tokens, 1):  # 0: the prompt only, still to score
            self.assembler.finish_reason = self.finish_reason = FinishReason.LENGTH
            return
        epoch = self.assembler.owner_epoch + 1
        self.assembler.expect_epoch(epoch)
        exclude = tuple(i for i in (failed,) if i)
        board, now = gateway.board, gateway.clock()
        if self.unplaced_since is not None and failed and not (
            board.is_failed(failed) or board.is_silent(failed, now)
        ):
            exclude = ()  # it came back (restarted under its id) or was only stalled: it may take it again
        since = self.unplaced_since if self.unplaced_since is not None else now
        try:
            async with asyncio.timeout(max(since + bound - gateway.clock(), 0.0)):
                new_owner, _ = await gateway.place(self._request(generated, epoch), exclude,
                                                   self._chain(generated))
        except (APIError, TimeoutError) as exc:
            why = exc.message if isinstance(exc, APIError) else (
                self.unplaced_why or "no instance answered in time")
            self.unplaced_why, self.unplaced_cause = why, cause
            now = gateway.clock()
            self.unplaced_since = since
            if now - since >= bound:
                log.warning("rescue of %s found no instance for %.1fs; it fails (%s)",
                            self.request_id, now - since, why)
                await self.close(CloseReason.NO_INSTANCE)
                raise unavailable(
                    f"the instance running this request failed and no other instance took it within "
                    f"{bound:g} s (the frontend's rescue timeout): {why}", gateway.config.retry_after_s,
                ) from None
            self.next_rescue_at = min(now + 1.0, since + bound)  # nothing can take it now: try again soon
            log.warning("rescue of %s found no instance; will retry for %.1fs more (%s)",
                        self.request_id, since + bound - now, why)
            return
        self.unplaced_since, self.unplaced_why = None, ""
        self.num_rescues += 1
        self.owner_id = new_owner
        self.assembler.expect_epoch(epoch, new_owner)
        self.last_progress = gateway.clock()
        gateway.metrics.rescues.labels(cause=cause).inc()
        tracing.mark({"rescues": self.num_rescues})
        tracing.event("rescue", cause=cause, failed_instance=failed, new_instance=new_owner,
                      num_tokens_kept=len(generated))
        gateway.metrics.recomputes.inc()
        gateway.lifecycle.emit(RequestRescued(
            request_id=self.request_id, failed_instance_id=failed, new_instance_id=new_owner,
            num_tokens_kept=len(generated),
        ))

    def _chain(self, generated: tuple[int, ...]) -> Chain:
        """The chain of the prompt plus ``generated`` (a rescue's prompt): the prompt's, extended."""
        block_size, hashes = self.job.chain
        if block_size <= 0:
            return self.job.chain
        tokens = self.job.prompt_ids + generated
        chain = extend_block_hashes(list(hashes), tokens, block_size, root_hash(block_size))
        return Chain(block_size, tuple(chain))

    async def close(self, reason: CloseReason = CloseReason.FINISHED) -> None:
        """End the request: abort it on its owner unless it finished, log, unsubscribe. Idempotent.

        ``reason`` (kept as :attr:`close_reason`) says why: ``FINISHED`` and ``STOP_STRING`` log
        the request as finished, any other reason as aborted with that reason.
        """
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self.inbox.close()
        gateway = self.gateway
        gateway.streams.pop(self.request_id, None)
        now = gateway.clock()
        finished = self.assembler.finished and reason is CloseReason.FINISHED
        tracing.event("close", reason=reason.value, num_output_tokens=len(self.generated))
        if not self.assembler.finished and self.owner_id is not None:
            gateway.fire_and_forget(gateway.send_abort(self.owner_id, self.request_id, reason), "abort")
        if finished or reason is CloseReason.STOP_STRING:
            gateway.lifecycle.emit(RequestFinished(
                request_id=self.request_id, finish_reason=self.finish_reason or FinishReason.STOP,
                num_prompt_tokens=len(self.job.prompt_ids), num_output_tokens=len(self.generated),
                e2e_s=now - self.arrival,
            ))
            gateway.metrics.e2e.observe(now - self.arrival)
            if self.first_token_at is not None and len(self.generated) > 1:
                gateway.metrics.tpot.observe((now - self.first_token_at) / (len(self.generated) - 1))
        else:
            gateway.metrics.aborted.labels(reason=reason).inc()
            gateway.lifecycle.emit(RequestAborted(request_id=self.request_id, reason=reason))

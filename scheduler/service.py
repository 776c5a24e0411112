"""The global scheduler service: a thin shell around the fold, the policies and the lease.

One :class:`SchedulerService` per process. It

* recovers: loads the latest snapshot (:mod:`scheduler.snapshots`) and
  follows the log's tail from its fold point as a :class:`~scheduler.follower.Shadow`
  of the active scheduler, applying the fold points the log records, and
  (``verify_shadow``) recomputing each decision it sees;
* contends for the lease (:mod:`scheduler.lease`); on winning, appends a
  takeover ``SchedulerTick`` of its new epoch and, once that is back from the
  log, becomes active;
* while active: answers ``DispatchRequest`` on ``subjects.rpc_dispatch``
  (queue group ``scheduler``) from memory — folds what arrived since the
  last fold point, decides with :func:`scheduler.recompute.dispatch_decision`,
  replies (the handler is synchronous: the bus runs it where the request
  arrives), and hands the ``Dispatched`` event to a pipelined appender without
  waiting (:mod:`scheduler.outbox`: confirmed when the scheduler reads it back
  from the log, not by a publish acknowledgement); every ``pairing_interval_s``
  records a fold point, marks instances whose load reports stopped as failed,
  runs auto-scaling (if an :class:`~scheduler.instances.InstanceManager` is
  given), emits pairing
  decisions and sends the agents their ``MigrateOut`` / ``StopMigration`` /
  ``Drain`` commands (and, with ``requeue_after_s``, ``MoveQueued`` for a
  queued request on a stalled instance); saves snapshots every ``snapshot_every_events`` folded
  events or ``snapshot_every_s`` seconds; archives the load reports it reads
  into the history stream and appends a checkpoint of its state there every
  ``checkpoint_every_s`` (:mod:`scheduler.history`); scaling and failure
  decisions carry the clock readings they were made from;
* in every role: folds the agents' prefix-cache batches (the kv stream) into
  its :class:`~scheduler.prefix_index.PrefixIndex`, so a standby's index is the
  active one's; while active, asks an agent the index is unsure of for a full
  batch (``KVCacheSync``), and records in each ``Dispatched`` how many leading
  blocks of the request's chain each instance held;
* steps down when it sees a newer epoch in the log or cannot renew its lease,
  and starts over as a standby.

The decision rules live in :mod:`scheduler.recompute`; this module only moves
messages, keeps time and holds the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from typing import Any

from opentelemetry import trace

from bus import tracing as bus_tracing
from bus.errors import BusError, BusTimeout, NoResponders, NotConnected, StreamNotFound
from bus.event_loop import cancel_and_wait, wait_event
from bus.protocol import Bus, StoredMessage
from scheduler.cluster_state import ClusterState, InstanceStatus, initial_state, live_loads
from scheduler.config import encode_policy
from scheduler.follower import LogFollower, Shadow
from scheduler.history import LoadArchiver, checkpoint_message
from scheduler.instances import InstanceManager
from scheduler.lease import Lease, LeaseLost
from scheduler.metrics import SchedulerMetrics
from scheduler.outbox import Outbox
from scheduler.policy.dispatch import make_dispatcher
from scheduler.policy.load import freeness_after_admit, load_freeness
from scheduler.policy.scaling import ScaleDownDecision, ScalingState, decide_scaling
from scheduler.prefix_index import (
    PREFIX_HITS_KEPT,
    SYNC_REASONS,
    PrefixIndex,
    ResyncTracker,
    decode_index,
    encode_index,
    prefix_hits,
)
from scheduler.prefix_metrics import PrefixIndexCollector, PrefixIndexReading, read_index
from scheduler.recompute import (
    Cursor,
    apply_overlay,
    dispatch_decision,
    failure_event,
    pairing_plan_events,
    requeue_decision,
    scaling_event,
    scheduler_epoch,
)
from scheduler.service_config import (
    SENT_HEADER,
    Role,
    SchedulerConfig,
    SchedulerStats,
    default_scheduler_id,
)
from scheduler.snapshots import SnapshotStore
from schemas.decisions import Dispatched, Paired, ScaleDown, ScaleUp, SchedulerTick, Unpaired
from schemas.envelope import Body, Codec
from schemas.instance import FailureInputs, InstanceFailed, InstanceJoined, InstanceLeft
from schemas.kv_events import KVCacheEvents, KVCacheSync, KVSyncReason
from schemas.load import LoadReport
from schemas.reasons import DispatchFailReason, RpcErrorCode
from schemas.rpc import (
    DispatchReply,
    DispatchRequest,
    Drain,
    Liveness,
    MigrateOut,
    MoveQueued,
    RpcError,
    StopMigration,
)

__all__ = [
    "PREFIX_HITS_KEPT",
    "SENT_HEADER",
    "Role",
    "SchedulerConfig",
    "SchedulerService",
    "SchedulerStats",
    "default_scheduler_id",
]

log = logging.getLogger(__name__)

#: a standby reads the lease at most this often (plus every ``lease_ttl_s / 4`` when nothing happens)
LEASE_POLL_MIN_S = 0.05

#: How long the scheduler waits for the full cache batch it asked a stale instance for before
#: asking again (the request or the batch may have been lost).
KV_RESYNC_RETRY_S = 5.0

#: How often at most the prefix index is encoded again for a snapshot.
INDEX_SNAPSHOT_EVERY_S = 30.0

#: How long recovery waits for the kv stream's tail before serving with the index it has.
KV_CATCH_UP_S = 10.0

#: How many requeued request ids the scheduler remembers (each request moves at most once).
_REQUEUED_KEPT = 100_000

_MALFORMED = RpcError(code=RpcErrorCode.MALFORMED, message="undecodable log entry")


class _Deposed(Exception):
    pass


class SchedulerService:
    """Runs until :meth:`stop`; see the module docstring."""

    def __init__(
        self,
        bus: Bus,
        config: SchedulerConfig | None = None,
        *,
        instance_manager: InstanceManager | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self.bus = bus
        self.config = config or SchedulerConfig()
        #: spans: one ``dispatch`` per dispatch RPC, a child of the caller's span (NATS headers)
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer("shoal.scheduler")
        self.manager = instance_manager
        self.subjects = bus.config.subjects
        self.codec = Codec(producer=f"scheduler:{self.config.scheduler_id}")
        self._wall = wall_clock
        self._clock = clock
        self.role = Role.STARTING
        self.epoch = 0
        self.stats = SchedulerStats()
        self.snapshots = SnapshotStore(bus)
        self.archiver = LoadArchiver(bus, interval_s=self.config.archive_interval_s)
        self._checkpoint_at = float("-inf")
        self._policy_json = encode_policy(self.config.policy)
        #: kept across dispatches: it rescores only instances whose view changed
        self._dispatcher = make_dispatcher(self.config.policy.dispatch_policy, self.config.policy)
        self.lease = Lease(bus, holder=self.config.scheduler_id, ttl_s=self.config.lease_ttl_s, clock=clock)
        self.shadow: Shadow | None = None
        self._stop = asyncio.Event()
        self._deposed = asyncio.Event()
        self._changed = asyncio.Event()
        self._own: deque[tuple[str, Body]] = deque()
        self._own_counter = 0
        self._view: ClusterState | None = None
        self.metrics = SchedulerMetrics(lambda: (self.role, self.epoch))
        self.outbox = Outbox(
            bus, max_in_flight=self.config.max_in_flight_appends,
            observe_append=self.metrics.append_latency.observe,
        )
        self._last_seen: dict[str, float] = {}
        #: The loads-stream sequence of the last report received per instance (0: none since joining).
        self._last_report_seq: dict[str, int] = {}
        #: Liveness probes of silent instances: in flight (None) or answered (True: alive, False: not).
        self._probes: dict[str, bool | None] = {}
        self._scaling = ScalingState()
        #: each instance's last load report and when it came (scheduler clock): what triggers a requeue
        self._last_report: dict[str, tuple[LoadReport, float]] = {}
        #: requests already told to move while queued (each moves at most once)
        self._requeued: OrderedDict[str, None] = OrderedDict()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._snapshot_events = 0
        self._snapshot_at = 0.0
        self._active_since = 0.0
        self._starting_up = True
        self._crashed = False
        #: ``(wall time, handling ms, inbound ms)`` per dispatch (benchmarks): handling is from the
        #: handler's start to the encoded reply; inbound from the requester's ``SENT_HEADER`` stamp
        #: (wall clock, same host) to the handler's start, -1 without it.
        self.decision_times: deque[tuple[float, float, float]] = deque(maxlen=500_000)
        #: which instance caches which prefix blocks: folded from the kv stream by every role
        #: (a standby's equals the active one's), snapshotted with the state
        self.prefix = PrefixIndex()
        self._kv_received = 0
        self._resync = ResyncTracker(retry_s=KV_RESYNC_RETRY_S)
        self._stale_reasons: dict[str, KVSyncReason] = {}
        self._encoded_index: tuple[tuple[int, int], float, bytes] = ((-1, -1), float("-inf"), b"")
        #: the index's figures at the last tick, for a scrape (on another thread)
        self.prefix_reading = PrefixIndexReading()
        self.metrics.registry.register(PrefixIndexCollector(lambda: self.prefix_reading))

    # -- public -------------------------------------------------------------------------
    @property
    def follower(self) -> LogFollower:
        if self.shadow is None:
            raise RuntimeError("the scheduler has not started")
        return self.shadow.follower

    @property
    def state(self) -> ClusterState:
        """The folded state at the last fold point (no own decisions in flight)."""
        return self.follower.state

    def view(self) -> ClusterState:
        """The state the next decision would see: the fold point plus own decisions not folded yet."""
        if self._view is None:
            self._view = apply_overlay(self.follower.state, [body for _, body in self._own])
        return self._view

    async def run(self) -> None:
        """Serve until :meth:`stop`: recover, follow, take over, decide; start over when deposed."""
        while not self._stop.is_set():
            try:
                await self._run_once()
            except _Deposed:
                self.stats.step_downs += 1
                log.warning("scheduler %s stepped down from epoch %d", self.config.scheduler_id, self.epoch)
            except NotConnected:
                raise  # the bus was closed under us: nothing to start over on
            except BusError as exc:
                # NATS unavailable for a while (a cluster electing a stream leader): start over shortly
                self.stats.bus_restarts += 1
                log.warning("scheduler %s starting over: %s", self.config.scheduler_id, exc)
                await self._wait_changed(self.config.lease_ttl_s / 3)
            finally:
                await self._teardown()
        self.role = Role.STOPPED

    async def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    async def wait_active(self, timeout: float = 30.0) -> None:
        deadline = self._clock() + timeout
        while self.role is not Role.ACTIVE:
            if self._clock() > deadline:
                raise TimeoutError(f"scheduler not active after {timeout}s (role {self.role})")
            await asyncio.sleep(0.01)

    def crash(self) -> None:
        """Stop every task at once without releasing anything (tests: a kill -9 in process)."""
        self._stop.set()
        for task in [*self._tasks, *self._background]:
            task.cancel()
        self.outbox.reset()
        self._crashed = True

    # -- lifecycle ----------------------------------------------------------------------
    async def _recover(self) -> tuple[ClusterState, Cursor, int, str]:
        """State, fold point, control epoch and that epoch's recorded policy ("" if unknown)."""
        events = self.subjects.events_stream
        record = await self.snapshots.load() if self.config.use_snapshot else None
        self.prefix = PrefixIndex()
        if record is not None:
            try:
                self.prefix = decode_index(record.prefix_index)
            except ValueError as exc:
                log.warning("snapshot's prefix index ignored (rebuilt from the kv stream): %s", exc)
            self._kv_received = self.prefix.kv_seq
            return record.decode_state(), record.cursor, record.control_epoch, record.policy
        state = initial_state(
            gapless_streams=(events,), pending_report_limit=self.config.pending_report_limit
        )
        return state, Cursor(0, 0), 0, ""

    async def _run_once(self) -> None:
        self.role = Role.STARTING
        self._deposed.clear()
        self._own.clear()
        self._view = None
        self._own_counter = 0
        self.outbox.reset()
        state, cursor, control_epoch, recorded_policy = await self._recover()
        follower = LogFollower(
            state,
            events_stream=self.subjects.events_stream,
            loads_stream=self.subjects.loads_stream,
            cursor=cursor,
        )
        # no recomputation while catching up (that is ``shoal replay``'s job): only the live tail is checked
        self.shadow = Shadow(follower, control_epoch=control_epoch, policy=self.config.policy, verify=False)
        if recorded_policy:
            self.shadow.adopt_policy(control_epoch, recorded_policy)
        targets = Cursor(
            await self.bus.last_seq(self.subjects.events_stream),
            await self.bus.last_seq(self.subjects.loads_stream),
        )
        try:
            kv_target = await self.bus.last_seq(self.subjects.kv_stream)
        except StreamNotFound:  # a cluster provisioned without it: no index, dispatch as before
            log.warning("no %s stream: the prefix index stays empty", self.subjects.kv_stream)
            kv_target = None
        self._kv_received = self.prefix.kv_seq
        self._tasks = [
            asyncio.create_task(self._read_events(cursor.events_seq + 1)),
            asyncio.create_task(self._read_loads(cursor.loads_seq + 1)),
            asyncio.create_task(self.outbox.run()),
        ]
        if kv_target is None:
            kv_target = 0
        else:
            self._tasks.append(asyncio.create_task(self._read_kv(self.prefix.kv_seq + 1)))
        # the kv stream's tail is waited for a bounded time: retention may have dropped its last entries
        kv_deadline = self._clock() + KV_CATCH_UP_S
        while not follower.received.covers(targets) or (
            self._kv_received < kv_target and self._clock() < kv_deadline
        ):
            await self._wait_changed(0.05)
            self._check_tasks()
            self.shadow.advance()
        if self._kv_received < kv_target:
            log.warning("kv stream read to seq %d of %d within %.0f s; the prefix index goes on filling",
                        self._kv_received, kv_target, KV_CATCH_UP_S)
        self.shadow.advance()
        gc.freeze()  # what recovery built is long-lived: keep it out of later collections (latency)
        self.role = Role.STANDBY
        self.shadow.verify = self.config.verify_shadow
        self.stats.recovered_at = self._wall()
        while not await self.lease.try_acquire(min_epoch=self.shadow.control_epoch):
            tried = self._clock()
            # what it folds wakes a standby (a released lease comes with the holder's last events),
            # but it reads the lease at most every LEASE_POLL_MIN_S, not once per message
            await self._wait_changed(self.config.lease_ttl_s / 4)
            self._check_tasks()
            if self._stop.is_set():
                return
            if (wait := tried + min(LEASE_POLL_MIN_S, self.config.lease_ttl_s / 4) - self._clock()) > 0:
                await wait_event(self._stop, wait)
                if self._stop.is_set():
                    return
        renew = asyncio.create_task(self._renew_lease())
        self._tasks.append(renew)
        # serving before the takeover completes: until then requests get an error (requesters bypass)
        service = await self.bus.serve(self.subjects.rpc_dispatch, self._handle_dispatch, queue="scheduler")
        try:
            await self._take_over()
            self._tasks.append(asyncio.create_task(self._ticker()))
            while not self._stop.is_set():
                await self._wait_changed(0.5)
                self._check_tasks()
                if self._deposed.is_set():
                    raise _Deposed()
        finally:
            if not self._crashed:
                await service.stop()
            if not self._deposed.is_set() and self._stop.is_set() and not self._crashed:
                self.tick()  # record the last fold point, then snapshot it for a quick handover
                await self._maybe_snapshot(force=True)
                await self.outbox.drain()
                if self.config.archive_loads:
                    with contextlib.suppress(BusError):
                        await self.archiver.flush()
                with contextlib.suppress(BusError):
                    await self.lease.release()

    async def _take_over(self) -> None:
        assert self.shadow is not None
        self.epoch = self.lease.epoch
        self.role = Role.TAKING_OVER
        self._emit(SchedulerTick(epoch=self.epoch, takeover=True, policy=self._policy_json))
        while self.shadow.control_epoch < self.epoch:
            await self._wait_changed(0.05)
            self._check_tasks()
            if self._stop.is_set() or self._deposed.is_set():
                return
        follower = self.shadow.follower
        self._own = deque(
            (event.msg_id, event.body)
            for event in follower.events
            if scheduler_epoch(event.body) == self.epoch
        )
        self._view = None
        self._active_since = self._clock()
        self._starting_up = True  # until min_instances are live, or the startup grace ran out
        self._snapshot_at = self._clock()
        self._snapshot_events = follower.state.num_events
        self._checkpoint_at = float("-inf")
        if self.config.archive_loads:
            self.archiver.archived_through = -1  # another scheduler may have archived since: look it up
            self._tasks.append(asyncio.create_task(self.archiver.run()))
        self.stats.takeovers += 1
        self.role = Role.ACTIVE
        log.info("scheduler %s active at epoch %d", self.config.scheduler_id, self.epoch)

    async def _teardown(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
        self.outbox.reset()
        if self.role is not Role.STOPPED:
            self.role = Role.STARTING

    def _check_tasks(self) -> None:
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def _wait_changed(self, timeout: float) -> None:
        await wait_event(self._changed, timeout)
        self._changed.clear()

    # -- reading the log -----------------------------------------------------------------
    def _body(self, message: StoredMessage) -> Body:
        envelope = self.codec.decode_or_none(message.data)
        return _MALFORMED if envelope is None else envelope.body

    async def _read_events(self, from_seq: int) -> None:
        async with self.bus.tail(self.subjects.events_stream, from_seq=from_seq) as feed:
            async for message in feed:
                if self.role is not Role.STARTING:
                    self.metrics.observe_read("events", message.time, time.time())
                self._on_event(
                    message.position.seq, self._body(message), message.headers.get("Nats-Msg-Id", "")
                )

    def _on_event(self, seq: int, body: Body, msg_id: str) -> None:
        assert self.shadow is not None
        if msg_id:
            self.outbox.confirm(msg_id)  # one of our own appends, read back: it is stored
        if self.role is Role.ACTIVE:
            self.follower.add_event(seq, body, msg_id)
            epoch = scheduler_epoch(body)
            if epoch is not None and epoch > self.epoch:
                self._deposed.set()
                self._changed.set()
        else:
            self.shadow.on_event(seq, body, msg_id)
            if self.role is not Role.STARTING:  # catching up advances in batches (see _run_once)
                self.shadow.advance()
            self._changed.set()  # what recovery and the takeover wait for
        if isinstance(body, InstanceJoined):
            self._last_seen[body.instance_id] = self._clock()
            self._last_report_seq[body.instance_id] = 0
        elif isinstance(body, (InstanceFailed, InstanceLeft)):
            self._drop_cached(body)

    # -- the prefix index ----------------------------------------------------------------
    async def _read_kv(self, from_seq: int) -> None:
        async with self.bus.tail(self.subjects.kv_stream, from_seq=from_seq) as feed:
            async for message in feed:
                self._on_kv(message.position.seq, self._body(message))

    def _on_kv(self, seq: int, body: Body) -> None:
        """Fold one kv-stream entry into the prefix index; ask at once for a full batch where it
        left an instance stale (the active scheduler only)."""
        self._kv_received = seq
        if not isinstance(body, KVCacheEvents):
            self.prefix.reject(seq)
            log.warning("kv stream seq %d: not a cache batch (%s); skipped", seq, type(body).__name__)
        else:
            reason = SYNC_REASONS.get(self.prefix.apply(body, seq))
            if reason is not None:
                self._stale_reasons[body.instance_id] = reason
                if self.role is Role.ACTIVE:
                    self._ask_resyncs()
        if self.role is Role.STARTING:
            self._changed.set()  # what recovery waits for

    def _ask_resyncs(self) -> None:
        """Ask each stale instance's agent for its full batch: once, again after a timeout."""
        for instance_id in self._resync.due(self.prefix.stale_instances(), self._clock()):
            reason = self._stale_reasons.get(instance_id, KVSyncReason.GAP)
            log.info("prefix index unsure of %s (%s): asking for its full cache batch", instance_id, reason)
            sync = KVCacheSync(instance_id=instance_id, reason=reason)
            self._spawn(self._request(self.subjects.kv_sync(instance_id), sync))

    def _drop_cached(self, body: InstanceFailed | InstanceLeft) -> None:
        """An instance that failed or left caches nothing any more (an earlier incarnation's
        failure, which the fold ignores, leaves the index alone too)."""
        record = self.follower.state.instances.get(body.instance_id)
        if isinstance(body, InstanceFailed) and body.incarnation and record is not None:
            if body.incarnation != record.incarnation:
                return
        self.prefix.drop(body.instance_id)
        self._stale_reasons.pop(body.instance_id, None)

    def prefix_hits(self, request: DispatchRequest, view: ClusterState) -> tuple[tuple[str, int], ...]:
        """Per live instance of the request's block size, the leading blocks of its chain that
        instance's cache holds: the ``PREFIX_HITS_KEPT`` holding most (only those holding some, by id)."""
        if not request.block_hashes:
            return ()

        def eligible(instance_id: str) -> bool:
            record = view.instances.get(instance_id)
            return (
                record is not None
                and record.status is not InstanceStatus.FAILED
                and record.joined.block_size == request.block_size
            )

        return prefix_hits(
            self.prefix, request.block_hashes, block_size=request.block_size, eligible=eligible
        )

    def _encoded_prefix_index(self, *, force: bool = False) -> bytes:
        """The index for a snapshot: encoded again when it changed, at most every
        ``INDEX_SNAPSHOT_EVERY_S`` (encoding takes about 0.3 s per million entries, on the loop);
        an older one is as good, recovery tails the kv stream from the sequence it names."""
        version = (self.prefix.kv_seq, len(self.prefix))  # batches folded, instances dropped
        encoded, encoded_at, data = self._encoded_index
        if version != encoded and (force or self._clock() - encoded_at >= INDEX_SNAPSHOT_EVERY_S):
            data = encode_index(self.prefix)
            self._encoded_index = (version, self._clock(), data)
        return data

    async def _read_loads(self, from_seq: int) -> None:
        async with self.bus.tail(self.subjects.loads_stream, from_seq=from_seq) as feed:
            async for message in feed:
                if self.role is not Role.STARTING:
                    self.metrics.observe_read("loads", message.time, time.time())
                if self.config.archive_loads:
                    self.archiver.offer(message)
                body = self._body(message)
                if not isinstance(body, LoadReport):
                    continue
                self._last_seen[body.instance_id] = self._clock()
                self._probes.pop(body.instance_id, None)  # it spoke: a probe's answer is moot
                self._last_report_seq[body.instance_id] = message.position.seq
                self._last_report[body.instance_id] = (body, self._clock())
                assert self.shadow is not None
                self.shadow.on_load(message.position.seq, body)
                if self.role is not Role.ACTIVE:
                    if self.role is not Role.STARTING:
                        self.shadow.advance()
                    # what recovery waits for; an active scheduler's main loop needs no wake-up per
                    # message (it only watches for a stop, a step-down and failed tasks)
                    self._changed.set()

    # -- deciding -------------------------------------------------------------------------
    def _fold_point(self) -> tuple[ClusterState, Cursor]:
        """Fold what arrived since the last fold point, committing it; the view after it."""
        follower = self.follower
        if not follower.num_buffered:
            return self.view(), follower.cursor
        state, cursor = follower.preview()
        self._commit(state, cursor)
        return self.view(), cursor

    def _commit(self, state: ClusterState, cursor: Cursor) -> None:
        folded = self.follower.commit(state, cursor)
        own_ids = {event.msg_id for event in folded if event.msg_id}
        if own_ids:
            self._own = deque(item for item in self._own if item[0] not in own_ids)
        self._view = None

    def _emit(self, body: Body) -> None:
        """Append ``body`` through the pipelined appender and count it as an own decision in flight."""
        self._own_counter += 1
        msg_id = f"{self.config.scheduler_id}:{self.epoch}:{self._own_counter}"
        self.outbox.put(self._subject_of(body), self.codec.encode(body, time=self._wall()), msg_id)
        self.metrics.observe_decision(body)
        if self.role is not Role.TAKING_OVER:
            self._own.append((msg_id, body))
            self._view = apply_overlay(self._view, (body,)) if self._view is not None else None

    def _subject_of(self, body: Body) -> str:
        match body:
            case Dispatched():
                return self.subjects.sched("dispatch")
            case Paired():
                return self.subjects.sched("pair")
            case Unpaired():
                return self.subjects.sched("unpair")
            case ScaleUp():
                return self.subjects.sched("scale_up")
            case ScaleDown():
                return self.subjects.sched("scale_down")
            case InstanceFailed():
                return self.subjects.instance(body.instance_id)
            case _:
                return self.subjects.sched("tick")

    def dispatch(self, request: DispatchRequest) -> DispatchReply:
        """Place one request now (the RPC handler's body; synchronous, from memory)."""
        if self.role is not Role.ACTIVE or self.lease.expired_locally():
            self.stats.dispatch_errors += 1
            self.metrics.dispatch_failures.labels(reason=DispatchFailReason.NOT_ACTIVE.value).inc()
            return DispatchReply(
                request_id=request.request_id,
                instance_id=None,
                epoch=self.epoch,
                reason=DispatchFailReason.NOT_ACTIVE,
                detail=f"scheduler is {self.role.value}",
            )
        follower = self.follower
        if follower.num_buffered:
            state, cursor = follower.preview()
            folded_ids = {e.msg_id for e in follower.events if e.seq <= cursor.events_seq and e.msg_id}
            view = apply_overlay(state, [body for mid, body in self._own if mid not in folded_ids])
        else:
            state, cursor, view = follower.state, follower.cursor, self.view()
        event = dispatch_decision(
            view, request, epoch=self.epoch, cursor=cursor, policy=self.config.policy,
            dispatcher=self._dispatcher, cached_blocks=self.prefix_hits(request, view),
            kv_seq=self.prefix.kv_seq if request.block_hashes else 0,
        )
        if event is None:
            self.stats.dispatch_errors += 1
            self.metrics.dispatch_failures.labels(reason=DispatchFailReason.NO_INSTANCE.value).inc()
            return DispatchReply(
                request_id=request.request_id,
                instance_id=None,
                epoch=self.epoch,
                reason=DispatchFailReason.NO_INSTANCE,
                detail="no instance can take the request",
            )
        if state is not follower.state:
            self._commit(state, cursor)
            self._view = view
        self._emit(event)
        span = trace.get_current_span()
        if span.is_recording():
            record = view.instances.get(event.instance_id)
            span.set_attribute("shoal.dispatch.instance", event.instance_id)
            if record is not None:
                policy = self.config.policy
                span.set_attribute("shoal.dispatch.freeness", load_freeness(record.load, policy))
                demand = record.load.demand_blocks(request.num_prompt_tokens)
                span.set_attribute(
                    "shoal.dispatch.freeness_after_admit", freeness_after_admit(record.load, demand, policy)
                )
        self.stats.dispatched += 1
        if not self.stats.first_dispatch_at:
            self.stats.first_dispatch_at = self._wall()
        return DispatchReply(request_id=request.request_id, instance_id=event.instance_id, epoch=self.epoch)

    def _handle_dispatch(self, data: bytes, headers: dict[str, str]) -> bytes:
        """The dispatch RPC: synchronous, so the bus answers it where it arrives (no task per request)."""
        started = time.perf_counter()
        try:
            if bus_tracing.header(headers, bus_tracing.TRACEPARENT) is None:
                return self._answer_dispatch(data)  # no trace to join: no span
            with self.tracer.start_as_current_span(
                "dispatch", context=bus_tracing.extract(headers), kind=trace.SpanKind.SERVER,
                attributes={
                    "shoal.scheduler.id": self.config.scheduler_id,
                    "shoal.scheduler.epoch": self.epoch,
                    "shoal.dispatch.policy": self.config.policy.dispatch_policy.value,
                },
            ):
                return self._answer_dispatch(data)
        finally:
            self.metrics.decision_latency.observe(time.perf_counter() - started)
            if self.config.record_decision_times:
                now = self._wall()
                sent = headers.get(SENT_HEADER)
                inbound = (now - float(sent)) * 1e3 if sent else -1.0
                self.decision_times.append((now, (time.perf_counter() - started) * 1e3, inbound))

    def _answer_dispatch(self, data: bytes) -> bytes:
        envelope = self.codec.decode_or_none(data)
        if envelope is None or not isinstance(envelope.body, DispatchRequest):
            reply = DispatchReply(
                request_id="", instance_id=None, epoch=self.epoch,
                reason=DispatchFailReason.MALFORMED_REQUEST, detail="expected a DispatchRequest",
            )
        else:
            reply = self.dispatch(envelope.body)
            span = trace.get_current_span()
            if span.is_recording():
                span.set_attribute("shoal.request.id", reply.request_id)
                if reply.reason is not None:
                    span.set_attribute("shoal.dispatch.failed", reply.reason.value)
        return self.codec.encode(reply, time=self._wall())

    def tick(self) -> list[Body]:
        """One round: record the fold point, detect failures, scale, pair. Returns the events emitted."""
        if self.role is not Role.ACTIVE:
            return []
        emitted: list[Body] = []
        before = self.follower.cursor
        view, cursor = self._fold_point()
        if cursor != before:
            emitted.append(
                SchedulerTick(epoch=self.epoch, events_seq=cursor.events_seq, loads_seq=cursor.loads_seq)
            )
            self._emit(emitted[-1])
            view = self.view()
        now = self._clock()
        for instance_id in sorted(view.instances):
            record = view.instances[instance_id]
            if record.status is InstanceStatus.FAILED:
                continue
            seen = self._last_seen.setdefault(instance_id, max(now, self._active_since))
            inputs = FailureInputs(
                clock=now,
                last_seen=seen,
                timeout_s=self.config.failure_timeout_s,
                last_report_seq=self._last_report_seq.get(instance_id, 0),
            )
            failed = failure_event(
                self.view(), instance_id, epoch=self.epoch, inputs=inputs,
                last_heartbeat=self._wall() - (now - seen),
            )
            if failed is not None and not self._confirmed_silent(instance_id, now - seen):
                continue
            if failed is not None:
                emitted.append(failed)
                self._emit(failed)
                self.stats.failures_detected += 1
        view = self.view()
        if self.manager is not None and self._may_scale(view, now):
            timers = self._scaling
            self._scaling, decision = decide_scaling(
                live_loads(view),
                now=now,
                state=timers,
                config=self.config.policy.scaling,
                num_launching=view.num_launching,
            )
            if decision is not None:
                emitted.append(scaling_event(decision, epoch=self.epoch, clock=now, before=timers))
                self._emit(emitted[-1])
                self._carry_out_scaling(decision)
                view = self.view()
        if self.config.policy.dispatch_policy.migrates:
            _, pairing = pairing_plan_events(view, epoch=self.epoch, policy=self.config.policy)
            for event in pairing:
                self._emit(event)
                self._send_command(event)
            emitted.extend(pairing)
        if self.config.requeue_after_s is not None:
            emitted.extend(self._requeue_stalled(cursor, now))
        self._ask_resyncs()
        self.prefix_reading = read_index(self.prefix, self._resync.num_asked)
        self.stats.ticks += 1
        return emitted

    def _may_scale(self, view: ClusterState, now: float) -> bool:
        """Whether to take scaling decisions now: not right after becoming active while fewer
        than ``min_instances`` are live, for up to ``ScalingConfig.startup_grace_s`` (the
        instances started beside the scheduler are still joining)."""
        if not self._starting_up:
            return True
        scaling = self.config.policy.scaling
        waited = now - self._active_since
        if len(live_loads(view)) >= scaling.min_instances or waited >= scaling.startup_grace_s:
            self._starting_up = False
        return not self._starting_up

    def _requeue_stalled(self, cursor: Cursor, now: float) -> list[Dispatched]:
        """Move queued requests (no KV) off instances whose queue stalled: the head of line has
        waited ``requeue_after_s`` by the instance's last report (plus the time since it came).
        The report names the one request that may go (``requeue_candidate``); where it goes is
        :func:`~scheduler.recompute.requeue_decision` over the view, logged as a ``Dispatched``
        with ``requeued_from`` and sent to the source as ``MoveQueued``. One per instance per
        tick, each request at most once."""
        after = self.config.requeue_after_s
        assert after is not None
        emitted: list[Dispatched] = []
        for instance_id in sorted(self._last_report):
            report, received = self._last_report[instance_id]
            candidate = report.requeue_candidate
            record = self.view().instances.get(instance_id)
            if candidate is None or record is None or record.status is not InstanceStatus.ACTIVE:
                continue
            waited = report.head_of_line_wait_s + (now - received)
            if waited < after or candidate.request_id in self._requeued:
                continue
            event = requeue_decision(
                self.view(), candidate, instance_id,
                epoch=self.epoch, cursor=cursor, policy=self.config.policy,
            )
            if event is None:
                continue
            self._requeued[candidate.request_id] = None
            while len(self._requeued) > _REQUEUED_KEPT:
                self._requeued.popitem(last=False)
            self._emit(event)
            emitted.append(event)
            self.stats.requeues += 1
            command = MoveQueued(
                epoch=self.epoch, request_id=event.request_id, destination_id=event.instance_id
            )
            self._spawn(self._request(self.subjects.rpc_agent(instance_id, "move_queued"), command))
        return emitted

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.pairing_interval_s)
            if self.lease.expired_locally():
                self._deposed.set()
                self._changed.set()
                return
            self.tick()
            await self._maybe_snapshot()

    async def _maybe_snapshot(self, *, force: bool = False) -> None:
        state = self.follower.state
        due_events = state.num_events - self._snapshot_events >= self.config.snapshot_every_events
        due_time = self._clock() - self._snapshot_at >= self.config.snapshot_every_s
        if not (due_events or due_time or force):
            return
        self._snapshot_events = state.num_events
        self._snapshot_at = self._clock()
        cursor, emitted = self.follower.cursor, self._own_counter
        # the fold point must be in the log before a snapshot names it
        stored = await self.outbox.wait_acked(emitted, timeout=self.config.lease_ttl_s)
        if not stored or self.role is not Role.ACTIVE:
            return
        try:
            await self.snapshots.save(
                state,
                cursor,
                control_epoch=self.epoch,
                taken_at=self._wall(),
                holder=self.config.scheduler_id,
                policy=self._policy_json,
                prefix_index=self._encoded_prefix_index(force=force),
            )
            self.stats.snapshots += 1
        except BusError as exc:
            log.warning("snapshot failed: %s", exc)
            return
        due = self._clock() - self._checkpoint_at >= self.config.checkpoint_every_s
        if self.config.archive_loads and due:
            self._checkpoint_at = self._clock()
            checkpoint = checkpoint_message(
                state, cursor, epoch=self.epoch, taken_at=self._wall(), policy=self._policy_json
            )
            try:
                await self.bus.append(
                    self.subjects.history("checkpoint"),
                    self.codec.encode(checkpoint, time=self._wall()),
                    msg_id=f"checkpoint:{self.epoch}:{cursor.events_seq}:{cursor.loads_seq}",
                )
                self.stats.checkpoints += 1
            except BusError as exc:
                log.warning("checkpoint failed: %s", exc)

    async def _renew_lease(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_ttl_s / 3)
            try:
                await self.lease.renew()
            except LeaseLost:
                self._deposed.set()
                self._changed.set()
                return
            except BusError as exc:
                log.warning("lease renewal failed: %s", exc)

    # -- failure detection -------------------------------------------------------------------
    def _confirmed_silent(self, instance_id: str, silence_s: float) -> bool:
        """Whether a silent instance may be marked failed: its probe did not show it still reporting.

        The first call starts the probe (the agent's ``liveness`` RPC) and says no; later calls say
        no while it is in flight. An agent that answers that its report loop is running and sending
        is alive and only its reports are late (the loads stream may have lost its leader): its
        silence starts over, and the next failure needs a new probe. Anything else confirms the
        silence: no responders, a timeout, or an answer that its reports stopped (a report loop that
        died, an agent stuck in its shutdown). A bus error on our side asks again.
        """
        if self.config.failure_probe_timeout_s <= 0:
            return True
        if instance_id not in self._probes:
            self._probes[instance_id] = None
            self._spawn(self._probe(instance_id, silence_s))
            return False
        answer = self._probes[instance_id]
        if answer is None:
            return False
        del self._probes[instance_id]
        if answer:
            self._last_seen[instance_id] = self._clock()
            self.stats.failures_averted += 1
            return False
        return True

    async def _probe(self, instance_id: str, silence_s: float) -> None:
        subject = self.subjects.rpc_agent(instance_id, "liveness")
        try:
            reply = await self.bus.request(subject, b"", timeout=self.config.failure_probe_timeout_s)
        except NoResponders:
            result = "no_responders"
        except BusTimeout:
            result = "timeout"
        except BusError as exc:  # our own connection, say: that says nothing about the instance
            log.info("liveness probe of %s failed on the bus: %s", instance_id, exc)
            self.metrics.failure_probes.labels(result="error").inc()
            self._probes.pop(instance_id, None)  # ask again at the next tick
            return
        else:
            envelope = self.codec.decode_or_none(reply.data)
            body = None if envelope is None else envelope.body
            if isinstance(body, Liveness) and body.reporting:
                result = "alive"
                log.warning(
                    "instance %s sent no load report the scheduler received for %.1fs, but it is sending "
                    "them (last stored %s s ago, last error %r): the loads stream is late (no leader?); "
                    "not marking it failed", instance_id, silence_s, body.seconds_since_stored,
                    body.last_error,
                )
            else:
                result = "not_reporting"
                log.warning(
                    "instance %s answers but sends no load reports (%s): marking it failed",
                    instance_id, body if isinstance(body, Liveness) else "unexpected reply",
                )
        self.metrics.failure_probes.labels(result=result).inc()
        if instance_id in self._probes:
            self._probes[instance_id] = result == "alive"
        self._changed.set()

    # -- side effects ------------------------------------------------------------------------
    def _spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task: asyncio.Task[Any] = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _send_command(self, event: Paired | Unpaired) -> None:
        if isinstance(event, Paired):
            body: Body = MigrateOut(
                epoch=self.epoch, destination_id=event.destination_id, target_freeness=event.target_freeness,
                room_blocks=event.destination_room_blocks,
                max_moves_per_request=self.config.policy.pairing.max_moves_per_request,
            )
            subject = self.subjects.rpc_agent(event.source_id, "migrate_out")
        else:
            body = StopMigration(epoch=self.epoch, destination_id=event.destination_id)
            subject = self.subjects.rpc_agent(event.source_id, "stop_migration")
        self._spawn(self._request(subject, body))

    def _carry_out_scaling(self, decision: object) -> None:
        if isinstance(decision, ScaleDownDecision):
            subject = self.subjects.rpc_agent(decision.instance_id, "drain")
            self._spawn(self._request(subject, Drain(epoch=self.epoch)))
            if self.manager is not None:
                self._spawn(self._stop_after_drain(decision.instance_id))
        elif self.manager is not None:
            count = getattr(decision, "num_instances", 1)
            self._spawn(self.manager.start_instances(count))

    async def _stop_after_drain(self, instance_id: str) -> None:
        while instance_id in self.follower.state.instances and not self._stop.is_set():
            await asyncio.sleep(self.config.pairing_interval_s)
        if self.manager is not None:
            await self.manager.stop_instance(instance_id)

    async def _request(self, subject: str, body: Body) -> None:
        try:
            await self.bus.request(
                subject, self.codec.encode(body, time=self._wall()), timeout=self.config.command_timeout_s
            )
            self.stats.commands_sent += 1
        except BusError as exc:
            self.stats.command_errors += 1
            log.info("command on %s failed: %s", subject, exc)

"""Injecting a scenario's fault into a cluster the drill started, and verifying that it took effect.

A fault counts only once it is seen to have happened: a killed process is
gone (reaped, its pid no longer in ``/proc``; a killed nats-server's port
refuses connections), a stopped one is in state ``T`` in ``/proc/<pid>/stat``,
an agent sent SIGTERM has announced ``InstanceTerminating`` in the log, a chaos
proxy has delayed, held or reset traffic. Targets are picked from what the
drill sees: the busiest agent (its ``stats`` RPC), an idle one, the source or
destination of a migration in flight in the event log (started by a
``migrate_out`` under the scheduler's epoch if none is under way). Each fault
yields :class:`FaultRecord` s with the drill-clock times of injection,
verification and healing.

On a supervised cluster (``cluster.supervise``) the drill also follows what the
supervisor does: every agent killed at once is awaited until it announces
itself ready again (``InstanceJoined`` after the kill); a crash-looping agent is
killed again each time it is back, until the supervisor leaves it down; the
agents whose engine fails at its first step (``cluster.first_step_faults``) are
verified by their processes' exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from bus import BusError
from frontend.drill.cluster import DrillCluster, port_refuses, process_state
from frontend.drill.proxy import ChaosProxy
from frontend.drill.scenario import FaultKind, FaultSpec, Target
from frontend.drill.watch import BusWatch, MigrationSeen
from frontend.supervisor import LeftDown
from frontend.up import Child

__all__ = ["FaultNotApplied", "FaultRecord", "inject"]


class FaultNotApplied(RuntimeError):
    """The fault's precondition never held, or the fault was not seen to take effect."""


@dataclass
class FaultRecord:
    kind: str
    target: str
    component: str = ""
    pid: int | None = None
    injected_at: float | None = None
    verified_at: float | None = None
    verified_by: str = ""
    healed_at: float | None = None
    restarted_at: float | None = None
    migration_id: str | None = None
    migration_stage: int | None = None
    #: nats faults: the events stream's last acknowledged sequence just before the fault
    events_acked: int | None = None
    #: agent faults: requests the agent held just before the fault
    target_requests: int | None = None
    #: frontend faults: requests the agents held when it died, and how long until they held none
    requests_on_agents: int | None = None
    agents_empty_after_s: float | None = None
    #: a killed agent brought back by its supervisor: when it announced itself ready again; a
    #: restarted frontend: when it answered ``/health`` with a ready instance again
    back_at: float | None = None
    #: crash loop: whether the supervisor left the agent down, and what it said
    left_down: bool | None = None
    left_down_reason: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return self.verified_at is not None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verified": self.verified}


class _Injector:
    def __init__(
        self,
        cluster: DrillCluster,
        watch: BusWatch,
        clock: Callable[[], float],
        stats_sink: Callable[[str, Any], None],
    ) -> None:
        self.cluster = cluster
        self.watch = watch
        self.clock = clock
        self.stats_sink = stats_sink

    # ------------------------------------------------------------------ picking targets

    async def _usage(self) -> dict[str, int]:
        """Requests each live agent holds now (running + waiting)."""
        usage: dict[str, int] = {}
        for instance_id in self.cluster.live_agents():
            report = await self.watch.stats(instance_id, 1.0)
            if report is not None:
                usage[instance_id] = report.batch_size + report.num_waiting
        return usage

    async def _busiest(self) -> str:
        usage = await self._usage()
        if not usage:
            raise FaultNotApplied("no agent answered its stats RPC")
        return max(sorted(usage), key=lambda i: usage[i])

    async def _busy(self, fault: FaultSpec, record: FaultRecord) -> str:
        """The busiest agent once one holds a request (a fault on an empty agent would prove nothing)."""
        deadline = time.monotonic() + fault.wait_s
        while time.monotonic() < deadline:
            usage = await self._usage()
            if usage and max(usage.values()) > 0:
                name = max(sorted(usage), key=lambda i: usage[i])
                record.notes.append(f"busiest by its stats RPC: {name} ({usage[name]} requests)")
                return name
            await asyncio.sleep(0.05)
        raise FaultNotApplied(f"no agent held a request within {fault.wait_s}s")

    async def _idle(self, fault: FaultSpec, record: FaultRecord) -> str:
        deadline = time.monotonic() + fault.wait_s
        while time.monotonic() < deadline:
            usage = await self._usage()
            idle = sorted(i for i, n in usage.items() if n == 0)
            if idle:
                record.notes.append(f"idle by its stats RPC: {idle[0]}")
                return idle[0]
            await asyncio.sleep(0.05)
        raise FaultNotApplied(f"no agent was idle within {fault.wait_s}s")

    async def _migration(self, fault: FaultSpec, record: FaultRecord) -> MigrationSeen:
        """A migration in flight (one is started if none is) that has reached its copy."""

        def current() -> MigrationSeen | None:
            live = set(self.cluster.live_agents())
            flying = [m for m in self.watch.in_flight() if m.source_id in live and m.destination_id in live]
            return flying[0] if flying else None

        deadline = time.monotonic() + fault.wait_s
        asked = 0.0
        while time.monotonic() < deadline:
            seen = current()
            if seen is not None:
                await asyncio.sleep(0.15)  # into the stage's copy (the drill cluster delays each copy)
                if seen.outcome is None:
                    record.migration_id, record.migration_stage = seen.migration_id, seen.stage
                    return seen
            elif time.monotonic() - asked > 1.5:
                usage = await self._usage()
                busy = sorted((i for i, n in usage.items() if n > 0), key=lambda i: (-usage[i], i))
                if busy and len(usage) > 1:
                    source = busy[0]
                    destination = min((i for i in sorted(usage) if i != source), key=lambda i: usage[i])
                    if await self.watch.migrate_out(source, destination):
                        record.notes.append(f"started migrations {source} -> {destination} (migrate_out)")
                asked = time.monotonic()
            await asyncio.sleep(0.02)
        raise FaultNotApplied(f"no migration in flight within {fault.wait_s}s")

    async def _component(self, fault: FaultSpec, record: FaultRecord) -> str:
        target = fault.target
        assert target is not None
        if target is Target.SCHEDULER:
            return "scheduler"
        if target is Target.FRONTEND:
            return "frontend"
        if target is Target.NATS:
            return "nats"
        if target is Target.AGENT_IDLE:
            return await self._idle(fault, record)
        if target.needs_migration:
            seen = await self._migration(fault, record)
            return seen.source_id if target is Target.MIGRATION_SOURCE else seen.destination_id
        return await self._busy(fault, record)

    # ------------------------------------------------------------------ process faults

    def _signal(self, name: str, sig: signal.Signals) -> int:
        pid = self.cluster.pid(name)
        if pid is None:
            raise FaultNotApplied(f"{name} is not running")
        os.kill(pid, sig)
        return pid

    async def _until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        return await self.watch.wait_for(condition, timeout_s, 0.01)

    async def process_fault(self, fault: FaultSpec, fault_s: float) -> FaultRecord:
        record = FaultRecord(fault.kind.value, fault.target.value if fault.target else "")
        name = record.component = await self._component(fault, record)
        cluster = self.cluster
        if name.startswith("agent"):
            report = await self.watch.stats(name, 1.0)
            if report is not None:
                self.stats_sink(name, report)
                record.target_requests = report.batch_size + report.num_waiting
        if name == "nats":
            await self._nats_fault(fault, fault_s, record)
            return record
        kind = fault.kind
        sig = {
            FaultKind.KILL: signal.SIGKILL,
            FaultKind.STOP: signal.SIGSTOP,
            FaultKind.TERM: signal.SIGTERM,
            FaultKind.RESTART: signal.SIGTERM,
        }[kind]
        record.pid = self._signal(name, sig)
        record.injected_at = self.clock()
        child = cluster.child(name)
        assert child is not None
        pid = record.pid
        if kind is FaultKind.KILL:
            if (
                await self._until(lambda: child.process.poll() is not None, 5.0)
                and process_state(pid) is None
            ):
                record.verified_at, record.verified_by = (
                    self.clock(),
                    f"pid {pid} gone (exit {child.process.returncode})",
                )
        elif kind is FaultKind.STOP:
            if await self._until(lambda: process_state(pid) == "T", 5.0):
                record.verified_at, record.verified_by = self.clock(), f"/proc/{pid}/stat state T"
        elif kind in (FaultKind.TERM, FaultKind.RESTART):
            if name.startswith("agent"):
                if await self._until(lambda: name in self.watch.terminating, 10.0):
                    record.verified_at = self.clock()
                    record.verified_by = f"{name} announced InstanceTerminating"
            elif await self._until(lambda: child.process.poll() is not None, 15.0):
                record.verified_at, record.verified_by = self.clock(), f"pid {pid} exited"
        if not record.verified:
            raise FaultNotApplied(f"{kind.value} of {name} (pid {pid}) was not seen to take effect")
        if name == "frontend" and kind is FaultKind.KILL and fault.restart_after_s is None:
            await self._agents_empty(record)
        await asyncio.sleep(max(0.0, fault_s - (self.clock() - record.injected_at)))
        if kind is FaultKind.STOP:
            os.kill(pid, signal.SIGCONT)
            await self._until(lambda: process_state(pid) not in ("T", None), 5.0)
            record.healed_at = self.clock()
        elif kind in (FaultKind.TERM, FaultKind.RESTART) and name.startswith("agent"):
            exited = await asyncio.get_running_loop().run_in_executor(None, cluster.wait_exit, name, 90.0)
            record.healed_at = self.clock()
            record.notes.append(
                f"{name} drained and exited (code {child.process.returncode})"
                if exited
                else f"{name} did not exit within 90 s of SIGTERM"
            )
        elif (
            name in ("scheduler", "frontend")
            and fault.restart_after_s is not None
        ):
            if kind is not FaultKind.KILL:
                await asyncio.get_running_loop().run_in_executor(None, cluster.wait_exit, name, 15.0)
            await asyncio.sleep(fault.restart_after_s)
            cluster.respawn(name)
            record.restarted_at = self.clock()
            record.healed_at = record.restarted_at
            if name == "frontend":
                await self._frontend_back(record)
        return record

    async def _frontend_back(self, record: FaultRecord, timeout_s: float = 60.0) -> None:
        """Wait until the restarted frontend's ``/health`` lists a ready instance (``back_at``)."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient() as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    body = (await http.get(f"{self.cluster.url}/health", timeout=1.0)).json()
                    if body.get("status") == "ok" and body.get("instances"):
                        record.back_at = self.clock()
                        return
                await asyncio.sleep(0.2)
        record.notes.append(f"the restarted frontend listed no ready instance within {timeout_s:g}s")

    # ------------------------------------------------------------------ supervised faults

    def _left_down(self, name: str) -> LeftDown | None:
        return next((d for d in self.cluster.left_down if d.name == name), None)

    @property
    def _comeback_s(self) -> float:
        """How long a killed agent may take to be ready again: the supervisor's longest delay and
        an agent's start."""
        supervisor = self.cluster.supervisor
        delay = 0.0 if supervisor is None else supervisor.policy.max_delay_s
        return delay + self.cluster.agent_start_timeout_s

    async def _reaped(self, child: Child, pid: int, record: FaultRecord) -> None:
        """Verified once the killed process is reaped and its pid gone from ``/proc``."""
        if await self._until(lambda: child.process.poll() is not None, 5.0) and process_state(pid) is None:
            record.verified_at = self.clock()
            record.verified_by = f"pid {pid} gone (exit {child.process.returncode})"

    async def _kill_verified(self, name: str, record: FaultRecord) -> None:
        """kill -9 ``name`` now; verified once its process is reaped and its pid gone."""
        child = self.cluster.child(name)
        if child is None or not child.alive():
            raise FaultNotApplied(f"{name} is not running")
        report = await self.watch.stats(name, 1.0)
        if report is not None:
            self.stats_sink(name, report)
            record.target_requests = report.batch_size + report.num_waiting
        pid = record.pid = self._signal(name, signal.SIGKILL)
        record.injected_at = self.clock()
        await self._reaped(child, pid, record)

    async def kill_agents(self, fault: FaultSpec, fault_s: float) -> list[FaultRecord]:
        """kill -9 every agent once one holds a request; on a supervised cluster, wait until each
        announced itself ready again."""
        first = FaultRecord(fault.kind.value, Target.AGENTS.value)
        await self._busy(fault, first)
        names = self.cluster.live_agents()
        children = {name: self.cluster.child(name) for name in names}
        usage = await self._usage()
        records = []
        for name in names:  # every signal first, so no agent outlives the others by a stats RPC
            record = FaultRecord(fault.kind.value, Target.AGENTS.value, component=name,
                                 target_requests=usage.get(name))
            record.pid = self._signal(name, signal.SIGKILL)
            record.injected_at = self.clock()
            records.append(record)
        records[0].notes.extend(first.notes)
        for record in records:
            child, pid = children[record.component], record.pid
            assert child is not None and pid is not None
            await self._reaped(child, pid, record)
        if not all(r.verified for r in records):
            raise FaultNotApplied("kill -9 of every agent: " + ", ".join(
                f"{r.component} (pid {r.pid})" for r in records if not r.verified) + " not seen to die")
        injected = records[0].injected_at
        assert injected is not None
        await asyncio.sleep(max(0.0, fault_s - (self.clock() - injected)))
        if self.cluster.supervisor is None:
            return records

        def back() -> bool:
            joined = [self.watch.joined_since(r.component, r.injected_at or 0.0) for r in records]
            return all(t is not None for t in joined)

        await self._until(back, self._comeback_s)
        for record in records:
            record.back_at = self.watch.joined_since(record.component, record.injected_at or 0.0)
            record.healed_at = record.back_at
            if record.back_at is None:
                down = self._left_down(record.component)
                record.notes.append(down.reason if down is not None else
                                    f"not ready again within {self._comeback_s:g}s")
        return records

    async def crash_loop(self, fault: FaultSpec, fault_s: float) -> list[FaultRecord]:
        """kill -9 the busiest agent, and again each time the supervisor brings it back (ready, and
        holding a request if one comes within a few seconds), until the supervisor leaves it down."""
        if self.cluster.supervisor is None:
            raise FaultNotApplied("a crash loop needs the cluster's supervision (cluster.supervise)")
        record = FaultRecord(fault.kind.value, fault.target.value if fault.target else "")
        name = record.component = await self._busy(fault, record)
        records: list[FaultRecord] = []
        started = self.clock()
        while True:
            await self._kill_verified(name, record)
            records.append(record)
            if not record.verified:
                raise FaultNotApplied(f"kill -9 of {name} (pid {record.pid}) was not seen to take effect")
            since = record.injected_at or 0.0

            def returned(since: float = since) -> bool:
                return self._left_down(name) is not None or self.watch.joined_since(name, since) is not None

            await self._until(returned, self._comeback_s)
            down = self._left_down(name)
            record.back_at = self.watch.joined_since(name, since)
            if down is not None or record.back_at is None or len(records) >= fault.max_kills:
                break
            record = FaultRecord(fault.kind.value, record.target, component=name)
            await self._holding(name, 3.0)
        last = records[-1]
        last.left_down = down is not None
        last.left_down_reason = down.reason if down is not None else (
            f"still restarted after {len(records)} kills" if last.back_at is not None
            else f"neither back nor left down within {self._comeback_s:g}s")
        last.healed_at = self.clock()
        await asyncio.sleep(max(0.0, fault_s - (self.clock() - started)))
        return records

    async def _holding(self, name: str, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until agent ``name`` holds a request."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            report = await self.watch.stats(name, 1.0)
            if report is not None and report.batch_size + report.num_waiting > 0:
                return
            await asyncio.sleep(0.05)

    async def first_step(self, fault_s: float) -> list[FaultRecord]:
        """The agents of ``cluster.first_step_faults``: verified once each one's process exited
        without its instance ever announcing itself ready."""
        spec = self.cluster.spec
        records = []
        for index, how in sorted(spec.first_step_faults.items()):
            name = f"agent-{index}"
            records.append(FaultRecord(FaultKind.FIRST_STEP.value, how, component=name,
                                       injected_at=self.clock()))

        def exits(name: str) -> list[int]:
            return [c.process.returncode for c in self.cluster.processes.children
                    if c.name == name and c.process.poll() is not None]

        def all_exited() -> bool:
            return all(exits(r.component) for r in records)

        await self._until(all_exited, max(fault_s, 30.0))
        for record in records:
            codes = exits(record.component)
            if codes and record.component not in self.watch.joined:
                record.verified_at = self.clock()
                record.verified_by = (f"{record.component}'s engine ({record.target} at its first step): "
                                      f"exit {codes[0]}, never ready")
        injected = records[0].injected_at or 0.0
        await asyncio.sleep(max(0.0, fault_s - (self.clock() - injected)))
        if self.cluster.supervisor is not None:  # it crash-loops: wait for the supervisor to give up
            await self._until(lambda: all(self._left_down(r.component) for r in records), self._comeback_s)
        for record in records:
            down = self._left_down(record.component)
            record.left_down = down is not None if self.cluster.supervisor is not None else None
            record.left_down_reason = down.reason if down is not None else ""
            record.notes.append(f"{len(exits(record.component))} exits: {exits(record.component)[:8]}")
            record.healed_at = self.clock()
        if not all(r.verified for r in records):
            raise FaultNotApplied("an agent with a first-step fault did not exit, or announced itself ready: "
                                  + ", ".join(r.component for r in records if not r.verified))
        return records

    async def _agents_empty(self, record: FaultRecord, timeout_s: float = 30.0) -> None:
        """How long after the frontend died until no agent holds a request (nothing sends new ones)."""
        assert record.injected_at is not None
        usage = await self._usage()
        record.requests_on_agents = sum(usage.values())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            usage = await self._usage()
            if usage and not any(usage.values()):
                record.agents_empty_after_s = self.clock() - record.injected_at
                return
            await asyncio.sleep(0.25)
        record.notes.append(f"agents still held {sum(usage.values())} requests {timeout_s:g}s later")

    async def _nats_fault(self, fault: FaultSpec, fault_s: float, record: FaultRecord) -> None:
        nats = self.cluster.nats
        record.pid = nats.pid
        port = nats.port
        subjects = self.watch.subjects
        with contextlib.suppress(BusError):  # every event acknowledged so far must survive the fault
            record.events_acked = await self.watch.bus.last_seq(subjects.events_stream)
        record.injected_at = self.clock()
        if fault.kind is FaultKind.STOP:
            self._signal("nats", signal.SIGSTOP)
            pid = record.pid
            assert pid is not None
            if await self._until(lambda: process_state(pid) == "T", 5.0):
                record.verified_at, record.verified_by = self.clock(), f"/proc/{pid}/stat state T"
            await asyncio.sleep(fault_s)
            os.kill(pid, signal.SIGCONT)
            record.healed_at = self.clock()
        else:
            if fault.kind is FaultKind.KILL:
                nats.kill()
            else:
                await asyncio.get_running_loop().run_in_executor(None, nats.stop)
            if process_state(record.pid or 0) is None and port_refuses(nats.host, port):
                record.verified_at = self.clock()
                record.verified_by = f"pid {record.pid} gone, port {port} refuses connections"
            await asyncio.sleep(fault.restart_after_s or 0.0)
            nats.start()
            record.restarted_at = record.healed_at = self.clock()
            record.notes.append(f"nats-server restarted on its file store (pid {nats.pid})")
        if not record.verified:
            raise FaultNotApplied(f"{fault.kind.value} of nats-server was not seen to take effect")

    # ------------------------------------------------------------------ proxy faults

    async def _proxies(self, target: Target, record: FaultRecord) -> list[ChaosProxy]:
        if target is Target.BUS:
            return list(self.cluster.bus_proxies.values())
        if target is Target.AGENT_BUS:
            name = record.component = await self._busiest()
            report = await self.watch.stats(name, 1.0)
            if report is not None:
                record.target_requests = report.batch_size + report.num_waiting
            proxy = self.cluster.bus_proxies.get(name)
            return [] if proxy is None else [proxy]
        return list(self.cluster.kv_proxies.values())

    async def proxy_fault(self, fault: FaultSpec, fault_s: float) -> FaultRecord:
        assert fault.target is not None
        record = FaultRecord(fault.kind.value, fault.target.value, component=f"{fault.target.value} proxy")
        proxies = await self._proxies(fault.target, record)
        if not proxies:
            raise FaultNotApplied(f"the cluster has no {fault.target.value} proxy")

        def counters() -> tuple[int, int, int, int]:
            return (
                sum(p.stats.chunks_delayed for p in proxies),
                sum(p.stats.chunks_held for p in proxies),
                sum(p.stats.connections_held for p in proxies),
                sum(p.stats.connections_reset for p in proxies),
            )

        async def during_migration() -> None:
            if fault.during_migration:
                seen = await self._migration(fault, record)
                record.notes.append(f"during migration {seen.migration_id} ({seen.source_id} -> "
                                    f"{seen.destination_id}, stage {seen.stage})")

        before = counters()
        if fault.kind is FaultKind.BLACKHOLE:  # engaged first: the migration's copy cannot slip past it
            for proxy in proxies:
                proxy.blackhole(True)
            record.injected_at = self.clock()
            await during_migration()
            if await self._until(lambda: counters()[1] + counters()[2] > before[1] + before[2], fault_s):
                record.verified_at = self.clock()
                record.verified_by = "traffic held by the blackhole"
        else:
            await during_migration()
            before = counters()
            record.injected_at = self.clock()
        if fault.kind is FaultKind.LATENCY:
            for proxy in proxies:
                proxy.set_latency(fault.latency_ms / 1000)
            if await self._until(lambda: counters()[0] > before[0], max(2.0, fault_s)):
                record.verified_at = self.clock()
                record.verified_by = f"{counters()[0] - before[0]} chunks delayed by {fault.latency_ms:g} ms"
        elif fault.kind is FaultKind.RESET:
            reset = sum(p.reset_all() for p in proxies)
            if reset:
                record.verified_at = self.clock()
                record.verified_by = f"{reset} connections reset"
        assert record.injected_at is not None
        await asyncio.sleep(max(0.0, fault_s - (self.clock() - record.injected_at)))
        for proxy in proxies:
            proxy.heal()
        record.healed_at = self.clock()
        if fault.kind is FaultKind.BLACKHOLE and record.verified:
            held = counters()
            record.notes.append(
                f"held {held[1] - before[1]} chunks and {held[2] - before[2]} new connections"
            )
        if not record.verified:
            raise FaultNotApplied(
                f"{fault.kind.value} on {fault.target.value} was not seen to take effect "
                "(no traffic passed the proxy meanwhile)"
            )
        return record

    # ------------------------------------------------------------------ handshake faults

    async def migrations(self, fault: FaultSpec, fault_s: float) -> FaultRecord:
        """Keep migrations going for the fault phase; verified by one that ended on a handshake timeout."""
        record = FaultRecord(fault.kind.value, "agents", component="handshake fault plan")
        record.injected_at = self.clock()
        before = set(self.watch.migrations)
        timeouts = ("ack_timeout", "commit_timeout", "suspend_timeout", "idle_timeout")

        def lost_message() -> list[MigrationSeen]:
            return [m for i, m in self.watch.migrations.items() if i not in before and m.outcome
                    and any(t in m.outcome for t in timeouts)]

        deadline = time.monotonic() + max(fault_s, fault.wait_s)
        while time.monotonic() < deadline and not lost_message():
            if not self.watch.in_flight():
                await self._migration(FaultSpec(kind=FaultKind.MIGRATIONS, wait_s=3.0), record)
            await asyncio.sleep(0.1)
        seen = lost_message()
        if seen:
            record.verified_at = self.clock()
            record.verified_by = f"migration {seen[0].migration_id} {seen[0].outcome}"
        await asyncio.sleep(max(0.0, fault_s - (self.clock() - record.injected_at)))
        record.healed_at = self.clock()
        if not record.verified:
            raise FaultNotApplied("no migration ended on a handshake timeout: the fault plan never acted")
        return record

    # ------------------------------------------------------------------ rolling restart

    async def rolling_restart(self) -> list[FaultRecord]:
        records = []
        for name in list(self.cluster.live_agents()):
            await asyncio.sleep(1.0)
            report = await self.watch.stats(name, 1.0)
            if report is not None:
                self.stats_sink(name, report)
            record = FaultRecord(FaultKind.TERM.value, Target.AGENT.value, component=name)
            record.pid = self._signal(name, signal.SIGTERM)
            record.injected_at = self.clock()
            self.watch.terminating.pop(name, None)
            if await self._until(lambda n=name: n in self.watch.terminating, 10.0):  # type: ignore[misc]
                record.verified_at = self.clock()
                record.verified_by = f"{name} announced InstanceTerminating"
            else:
                raise FaultNotApplied(f"SIGTERM of {name} was not seen to take effect")
            exited = await asyncio.get_running_loop().run_in_executor(
                None, self.cluster.wait_exit, name, 90.0
            )
            record.notes.append(
                f"{name} drained in {self.clock() - record.injected_at:.2f}s"
                if exited
                else f"{name} did not exit within 90 s"
            )
            await self.cluster.add_agent(name)
            record.restarted_at = record.healed_at = self.clock()
            await self.cluster.wait_ready(len(self.cluster.agent_ids), self.cluster.agent_start_timeout_s)
            records.append(record)
        return records


async def inject(
    fault: FaultSpec,
    fault_s: float,
    cluster: DrillCluster,
    watch: BusWatch,
    clock: Callable[[], float],
    stats_sink: Callable[[str, Any], None],
) -> list[FaultRecord]:
    """Inject ``fault``, verify it, hold it for ``fault_s`` and undo it; the records of what was done."""
    injector = _Injector(cluster, watch, clock, stats_sink)
    if fault.kind is FaultKind.NONE:
        return []
    if fault.kind is FaultKind.FIRST_STEP:
        return await injector.first_step(fault_s)
    if fault.kind is FaultKind.CRASH_LOOP:
        return await injector.crash_loop(fault, fault_s)
    if fault.target is Target.AGENTS:
        return await injector.kill_agents(fault, fault_s)
    if fault.kind is FaultKind.ROLLING_RESTART:
        return await injector.rolling_restart()
    if fault.kind is FaultKind.MIGRATIONS:
        return [await injector.migrations(fault, fault_s)]
    if fault.kind in (FaultKind.LATENCY, FaultKind.BLACKHOLE, FaultKind.RESET):
        return [await injector.proxy_fault(fault, fault_s)]
    return [await injector.process_fault(fault, fault_s)]

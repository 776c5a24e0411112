"""The cluster a drill runs against: started by the drill (``--up``) or already running (``--against``).

:class:`DrillCluster` starts the components the way ``shoal up`` does — the
same :class:`~frontend.up.ClusterProcesses` (a session per child, death with
the parent, process-group cleanup), each child's command line rendered from
its typed config (:class:`~agents.engines.agent_cli.AgentCliConfig`,
:class:`~scheduler.cli.SchedulerCliConfig`,
:class:`~frontend.cli_serve.ServeCliConfig`) — and puts a :class:`ChaosProxy` in front
of NATS for each component (each connects through its own, so a partition can
isolate one component) and one in front of each agent's KV transport (the
agent listens on ``127.0.0.1:P`` and advertises ``127.0.0.2:P``, where its
proxy listens). It knows each component's pid and
command line, so the drill can signal one and start it again. With
``supervise=True`` it also runs ``shoal up``'s supervisor
(:class:`~frontend.supervisor.Supervisor`): a component that fails (a signal or a
non-zero exit code) is started again with backoff, one that crash-loops is left
down (:attr:`DrillCluster.left_down`, and the frontend's ``/health`` lists it);
off by default, as scenarios that kill a component on purpose restart it
themselves.
:class:`ExternalCluster` is a cluster the drill did not start: the drill only
sends load and reads the log there; process faults need ``--up``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agents.engines.agent_cli import AgentCliConfig, FaultOptions
from bus.cli_config import to_argv
from bus.options import NatsOptions
from bus.server import EmbeddedNats, free_port
from frontend.cli_serve import ServeCliConfig
from frontend.drill.proxy import ChaosProxy
from frontend.drill.scenario import ClusterSpec
from frontend.supervisor import LeftDown, Notice, RestartPolicy, Supervisor, write_status
from frontend.up import Child, ClusterProcesses, vllm_cpu_binds
from scheduler.cli import PolicyOptions, SchedulerCliConfig

__all__ = ["ClusterNotReady", "DrillCluster", "ExternalCluster", "port_refuses", "process_state"]

_KV_PROXY_HOST = "127.0.0.2"
#: vllm agents: each one's KV space (a drill's requests are short; vLLM on CPU would take 1 GiB each)
VLLM_DRILL_KV_BYTES = 64 * 2**20
#: vllm agents: context length and block size (vLLM's CPU attention wants blocks of a multiple of 32)
VLLM_DRILL_MAX_MODEL_LEN = 2048
VLLM_DRILL_BLOCK_SIZE = 32
#: seconds a cluster of vllm agents may take to start (each loads vLLM and warms its model up)
VLLM_READY_TIMEOUT_S = 300.0


class ClusterNotReady(RuntimeError):
    """The cluster did not become ready (a component died, or the deadline passed)."""


def process_state(pid: int) -> str | None:
    """The state letter in ``/proc/<pid>/stat`` (``R``, ``S``, ``T``, ``Z``, ...); None: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2]


def port_refuses(host: str, port: int) -> bool:
    """Whether a TCP connect to ``host:port`` is refused right now."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=0.5):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


async def _ready_instances(http: httpx.AsyncClient, url: str) -> list[str] | None:
    try:
        response = await http.get(f"{url}/health", timeout=1.0)
        body: dict[str, Any] = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    return list(body.get("instances", [])) if body.get("status") == "ok" else []


@dataclass
class ExternalCluster:
    """A running cluster: the frontend's URL and the NATS URL the drill reads the log from."""

    url: str
    nats_url: str
    prefix: str = "shoal"
    model: str = "tiny"
    agent_ids: list[str] = field(default_factory=list)

    async def close(self) -> None:
        return None

    async def instances(self) -> list[str]:
        """The instances the frontend knows and has not seen fail or leave (its ``/health`` states)."""
        try:
            async with httpx.AsyncClient() as http:
                body = (await http.get(f"{self.url}/health", timeout=3.0)).json()
        except (httpx.HTTPError, ValueError):
            return list(self.agent_ids)
        states: dict[str, str] = body.get("states", {})
        known = sorted(i for i, state in states.items() if state not in ("failed", "left"))
        return known or list(self.agent_ids)


class DrillCluster:
    """A cluster the drill started; see the module docstring. ``await start()``, then ``await close()``."""

    def __init__(
        self, spec: ClusterSpec, log_dir: Path, *, prefix: str = "drill", ready_timeout_s: float = 120.0,
        supervise: bool = False, restart_policy: RestartPolicy | None = None,
    ) -> None:
        self.spec = spec
        self.log_dir = log_dir
        self.prefix = prefix
        if spec.engine == "vllm":
            ready_timeout_s = max(ready_timeout_s, VLLM_READY_TIMEOUT_S)
        self.ready_timeout_s = ready_timeout_s
        #: vllm agents' ``--cpu-bind``, by agent index (as ``shoal up`` splits the CPUs); empty otherwise
        self.cpu_binds: list[str] = []
        if spec.engine == "vllm":
            from agents.engines.vllm_engine import vllm_version

            self.cpu_binds = vllm_cpu_binds(spec.instances, vllm_version())
        # the children's temporary files (a vllm agent's own folder) stay in the log folder: what an
        # agent killed by a fault leaves there goes with the folder when the drill removes it
        self.processes = ClusterProcesses(log_dir, env={**os.environ, "TMPDIR": str(log_dir / "tmp")})
        self.nats = EmbeddedNats(
            store_dir=log_dir / "nats-store", log_file=log_dir / "nats.log", die_with_parent=True
        )
        #: one chaos proxy per component in front of NATS (a partition isolates one of them)
        self.bus_proxies: dict[str, ChaosProxy] = {}
        self.kv_proxies: dict[str, ChaosProxy] = {}
        self.commands: dict[str, list[str]] = {}
        self.port = 0
        self.agent_ids: list[str] = []
        self._generation = 0
        #: ``shoal up``'s supervisor over the components (None: the drill alone restarts them)
        self.supervisor: Supervisor | None = None
        if supervise:
            self.supervisor = Supervisor(restart_policy or RestartPolicy(), self._restart, engine=spec.engine)
        #: what the supervisor did, in order (exits, restarts, components left down)
        self.supervision: list[Notice] = []
        self._supervising: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ addresses

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def nats_url(self) -> str:
        """NATS itself (the drill's own reads go around the chaos proxy)."""
        return self.nats.url

    async def _nats(self, name: str) -> NatsOptions:
        """How component ``name`` reaches the cluster (through its own chaos proxy)."""
        return NatsOptions(nats_url=await self.component_nats_url(name), prefix=self.prefix)

    async def component_nats_url(self, name: str) -> str:
        """The NATS URL ``name`` connects to: its own chaos proxy's (NATS itself without proxies)."""
        if not self.spec.proxy_nats:
            return self.nats.url
        proxy = self.bus_proxies.get(name)
        if proxy is None:
            proxy = await ChaosProxy(("127.0.0.1", self.nats.port), name=f"bus-{name}").start()
            self.bus_proxies[name] = proxy
        return f"nats://127.0.0.1:{proxy.listen_port}"

    @property
    def model(self) -> str:
        spec = self.spec
        return spec.resolved_model if spec.engine != "sim" else f"sim:{spec.resolved_model}"

    # ------------------------------------------------------------------ start / stop

    async def start(self) -> None:
        (self.log_dir / "tmp").mkdir(parents=True, exist_ok=True)
        self.nats.start()
        self.processes.nats = self.nats
        spec = self.spec
        if spec.scheduler:
            policy = PolicyOptions()
            if spec.low_freeness is not None:
                policy = dataclasses.replace(policy, low_freeness=spec.low_freeness)
            if spec.high_freeness is not None:
                policy = dataclasses.replace(policy, high_freeness=spec.high_freeness)
            scheduler = SchedulerCliConfig(
                nats=await self._nats("scheduler"), failure_timeout=spec.failure_timeout_s,
                pairing_interval=0.3, policy=policy,
            )
            self._spawn("scheduler", ["scheduler", *to_argv(scheduler)])
            if spec.standby_scheduler:  # follows the log; takes over when the first one's lease expires
                standby = dataclasses.replace(scheduler, nats=await self._nats("standby"), standby=True)
                self._spawn("standby", ["scheduler", *to_argv(standby)])
        for index in range(spec.instances):
            await self.add_agent(f"agent-{index}")
        self.port = free_port()
        status = None
        if self.supervisor is not None:
            status = self.supervisor_status_path
            write_status(status, [])
        serve = ServeCliConfig(nats=await self._nats("frontend"), model=self.model, port=self.port,
                               stall_timeout=spec.stall_timeout_s, instance_stale_after=3.0,
                               supervisor_status=status)
        if spec.rescue_timeout_s is not None:  # the frontend's bound on a request no instance takes
            serve = dataclasses.replace(serve, rescue_timeout=spec.rescue_timeout_s)
        self._spawn("frontend", ["serve", *to_argv(serve)])
        if self.supervisor is not None:
            self._supervising = asyncio.create_task(self._supervise(self.supervisor))
        await self.wait_ready(len(self.agent_ids) - len(spec.first_step_faults))  # those never get ready

    # ------------------------------------------------------------------ supervision

    @property
    def supervisor_status_path(self) -> Path:
        """Where the supervisor lists the components it left down (the frontend's ``/health`` reads it)."""
        return self.log_dir / "supervisor.json"

    @property
    def left_down(self) -> list[LeftDown]:
        """The components the supervisor gave up on (none without supervision)."""
        return self.supervisor.left_down if self.supervisor is not None else []

    def _restart(self, name: str) -> Child:
        return self.processes.spawn(name, self.commands[name])

    async def _supervise(self, supervisor: Supervisor, interval_s: float = 0.2) -> None:
        while True:
            notices = supervisor.poll()
            self.supervision.extend(notices)
            if any(n.left_down is not None for n in notices):
                write_status(self.supervisor_status_path, supervisor.left_down)
            await asyncio.sleep(interval_s)

    @property
    def agent_start_timeout_s(self) -> float:
        """How long a restarted agent may take to be ready again (vLLM loads and warms up first)."""
        return VLLM_READY_TIMEOUT_S if self.spec.engine == "vllm" else 60.0

    @property
    def idle_timeout_s(self) -> float:
        """How long a destination keeps a reservation it hears nothing about (its source died)."""
        return max(3 * self.spec.copy_timeout_s, 6.0)

    def agent_config(self, instance_id: str, transport_port: int, nats_url: str) -> AgentCliConfig:
        """The config of agent ``instance_id``: the engine options ``shoal up`` gives its agents, the
        scenario's migration timeouts and faults, its KV transport on ``transport_port``."""
        spec = self.spec
        num_blocks = spec.num_blocks
        if num_blocks is None and spec.engine == "sim":
            num_blocks = 512
        engine: dict[str, Any] = {"profile": spec.resolved_model, "time_scale": spec.time_scale}
        if spec.engine != "sim":
            engine = {"model": spec.resolved_model, "dtype": spec.dtype or ("float32" if spec.engine == "vllm"
                                                                             else None)}
        if spec.engine == "vllm":
            engine.update(block_size=VLLM_DRILL_BLOCK_SIZE, max_model_len=VLLM_DRILL_MAX_MODEL_LEN,
                          kv_cache_bytes=VLLM_DRILL_KV_BYTES if num_blocks is None else None)
        if self.cpu_binds:
            ids = self.agent_ids
            index = ids.index(instance_id) if instance_id in ids else len(ids)
            engine["cpu_bind"] = self.cpu_binds[index % len(self.cpu_binds)]
        faults = [fault.split(":") for fault in spec.handshake_faults]
        return AgentCliConfig(
            nats=NatsOptions(nats_url=nats_url, prefix=self.prefix),
            instance_id=instance_id,
            engine=spec.engine,
            num_blocks=num_blocks,
            transport_kind="tcp",
            transport_port=transport_port,
            transport_advertise=_KV_PROXY_HOST if spec.proxy_kv else "",
            migration_copy_timeout=spec.copy_timeout_s,
            migration_idle_timeout=self.idle_timeout_s,
            drain_timeout=60.0,
            faults=FaultOptions(
                fault_copy_delay=spec.copy_delay_s,
                fault_min_step=spec.min_step_s,
                fault_drop=tuple(f"{direction}:{kind}" for what, direction, kind in faults if what == "drop"),
                fault_duplicate=tuple(f"{direction}:{kind}" for what, direction, kind in faults
                                      if what == "duplicate"),
                fault_max=spec.handshake_fault_max if faults else None,
                fault_first_step=spec.first_step_fault(instance_id),
            ),
            **engine,
        )

    def agent_args(self, instance_id: str, transport_port: int, nats_url: str) -> list[str]:
        """The ``shoal agent`` command line of :meth:`agent_config`."""
        return ["agent", *to_argv(self.agent_config(instance_id, transport_port, nats_url))]

    async def add_agent(self, instance_id: str) -> Child:
        """Start an agent (a replacement reuses the instance id)."""
        proxy = self.kv_proxies.get(instance_id)
        port = proxy.upstream[1] if proxy is not None else free_port()
        if self.spec.proxy_kv and proxy is None:
            proxy, port = await self._kv_proxy(instance_id, port)
            self.kv_proxies[instance_id] = proxy
        if instance_id not in self.agent_ids:
            self.agent_ids.append(instance_id)
        nats_url = await self.component_nats_url(instance_id)
        return self._spawn(instance_id, self.agent_args(instance_id, port, nats_url))

    async def _kv_proxy(self, instance_id: str, port: int, attempts: int = 8) -> tuple[ChaosProxy, int]:
        """The KV proxy of ``instance_id`` on ``127.0.0.2:port``, for an agent on ``127.0.0.1:port``.

        A port that was free when picked can be taken before the proxy binds it (another
        process's listener on an ephemeral port): then another port is picked, ``attempts`` times.
        """
        for attempt in range(attempts):
            try:
                proxy = ChaosProxy(("127.0.0.1", port), listen_host=_KV_PROXY_HOST, listen_port=port,
                                   name=f"kv-{instance_id}")
                return await proxy.start(), port
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or attempt == attempts - 1:
                    raise
                port = free_port()
        raise AssertionError("unreachable")

    def _spawn(self, name: str, args: list[str]) -> Child:
        self.commands[name] = args
        child = self.processes.spawn(name, args)
        if self.supervisor is not None:
            self.supervisor.watch(child)
        return child

    def respawn(self, name: str) -> Child:
        """Start ``name`` again with the command line it had."""
        child = self._restart(name)
        if self.supervisor is not None:
            self.supervisor.watch(child)
        return child

    async def wait_ready(self, num_instances: int, timeout_s: float | None = None) -> float:
        """Wait until ``/health`` lists ``num_instances`` ready instances; the seconds it took."""
        started = time.monotonic()
        deadline = started + (timeout_s or self.ready_timeout_s)
        async with httpx.AsyncClient() as http:
            while True:
                ready = await _ready_instances(http, self.url)
                if ready is not None and len(ready) >= num_instances:
                    return time.monotonic() - started
                for dead in self.processes.newly_dead():
                    if self.child(dead.name) is not dead or self.supervisor is not None:
                        continue  # replaced (a drained agent), or the supervisor restarts it: expected
                    raise ClusterNotReady(
                        f"{dead.name} exited with code {dead.process.returncode}: see {dead.log_path}"
                    )
                down = {d.name for d in self.left_down}
                if "frontend" in down or (self.agent_ids and set(self.agent_ids) <= down):
                    raise ClusterNotReady("left down by the supervisor: "
                                          + "; ".join(d.reason for d in self.left_down))
                if time.monotonic() > deadline:
                    raise ClusterNotReady(
                        f"not ready within {timeout_s or self.ready_timeout_s}s "
                        f"(ready: {ready}); logs in {self.log_dir}"
                    )
                await asyncio.sleep(0.2)

    async def close(self, *, keep_store: bool = False) -> None:
        """Stop every process (SIGTERM, then SIGKILL), the proxies and NATS; remove the NATS store."""
        if self._supervising is not None:
            self._supervising.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervising
            self._supervising = None
        for child in self.processes.children:  # a stopped child would not see SIGTERM
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if child.alive():
                    os.killpg(child.pid, signal.SIGCONT)
        if self.nats.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.nats.pid, signal.SIGCONT)
        await asyncio.get_running_loop().run_in_executor(None, self.processes.stop_all, 5.0)
        self.nats.stop()
        for proxy in [*self.bus_proxies.values(), *self.kv_proxies.values()]:
            await proxy.close()
        if not keep_store:
            shutil.rmtree(self.log_dir / "nats-store", ignore_errors=True)

    # ------------------------------------------------------------------ processes

    def child(self, name: str) -> Child | None:
        """The newest process of ``name`` (None: never started)."""
        found = [c for c in self.processes.children if c.name == name]
        return found[-1] if found else None

    def live_agents(self) -> list[str]:
        return [a for a in self.agent_ids if (c := self.child(a)) is not None and c.alive()]

    def pid(self, name: str) -> int | None:
        if name == "nats":
            return self.nats.pid
        child = self.child(name)
        return child.pid if child is not None and child.alive() else None

    def wait_exit(self, name: str, timeout_s: float) -> bool:
        child = self.child(name)
        if child is None:
            return True
        try:
            child.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

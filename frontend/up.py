"""``shoal up``: a whole local cluster in one command — NATS, scheduler, agents and the frontend.

Starts an embedded ``nats-server`` (unless ``--nats URL`` names an existing
deployment), then ``shoal scheduler``, ``--instances N`` times ``shoal agent`` and
``shoal serve`` as child processes, waits until the frontend's ``/health``
answers 200 with every instance *ready* (a request would be placed on it:
``shoal is serving`` means a completion sent at once succeeds), prints where
the API, ``/health`` and ``/metrics`` are (the frontend's, and each scheduler's
and agent's own Prometheus endpoint on a port ``shoal up`` picks) and a curl
example, and supervises. Each child runs in a session of its own (so a terminal's Ctrl-C
reaches only ``shoal up``) and is told by the kernel to exit if
``shoal up`` itself dies (``PR_SET_PDEATHSIG``); on Ctrl-C or SIGTERM every
child's process group gets SIGINT, then SIGKILL after a grace period, and the
embedded server stops last: no orphans. A child that fails (a signal or a
non-zero exit code) is started again by :class:`~frontend.supervisor.Supervisor`
after ``--restart-delay`` (1 s), doubling per failure within
``--restart-window`` up to ``--restart-max-delay``; meanwhile rescue and bypass
cover agents and the scheduler. A restarted scheduler recovers from the log as
a standby does; a restarted agent rejoins under its own id. One that fails
``--restart-limit`` times within the window is left down: ``shoal up`` prints its
exit signal by name, the last lines of its log and what to try, and the
frontend's ``/health`` lists it (``shoal serve --supervisor-status``). If no
instance becomes ready within ``--ready-timeout`` (or every agent is left
down first), ``shoal up`` says why and exits non-zero. With ``--autoscale`` the scheduler's
:class:`~scheduler.instances.LocalProcessManager` starts more agents like
these (ids ``inst-N``, logging into the scheduler's log) when the average
freeness stays below the band, and drains one when it stays above.
Stopping ``shoal up`` sends the children SIGINT (a stop), not SIGTERM (which
makes an agent drain its requests to others first: maintenance, not shutdown). The
children inherit the ``OTEL_*`` variables; ``--otlp-endpoint URL`` sets
``OTEL_EXPORTER_OTLP_ENDPOINT`` for them (:mod:`bus.telemetry`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import click

from agents.engines.agent_cli import AgentCliConfig, EngineName, FaultOptions
from bus.auth import redact_url
from bus.cli_config import (
    CliConfig,
    ConfigError,
    click_options,
    from_options,
    nested,
    option,
    option_like,
    to_argv,
)
from bus.extras import require_engine
from bus.options import MetricsOptions, NatsAuthOptions, NatsOptions, nats_url_option
from bus.server import die_with_parent, free_port
from frontend.cli_serve import ServeCliConfig
from frontend.supervisor import Notice, RestartPolicy, Supervisor, write_status
from scheduler.cli import PolicyOptions, ScaleBandOptions, SchedulerCliConfig
from scheduler.config import DISPATCH_MENU, DispatchPolicy

__all__ = [
    "Child",
    "ClusterProcesses",
    "UpConfig",
    "agent_config",
    "child_environment",
    "up",
    "vllm_cpu_binds",
]

_SHOAL = [sys.executable, "-c", "from frontend.cli import main; main()"]


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_code(self) -> int | None:
        """The exit status (negative: the signal that ended it); None while it runs."""
        return self.process.poll()


@dataclass
class ClusterProcesses:
    """The children of one ``shoal up``; :meth:`stop_all` ends every one of them."""

    log_dir: Path
    #: the children's environment (None: this process's, ``OTEL_*`` included)
    env: dict[str, str] | None = None
    children: list[Child] = field(default_factory=list)
    nats: Any = None
    reported_dead: set[str] = field(default_factory=set)
    #: each child's command line (after ``shoal``), by name: what :meth:`respawn` runs again
    commands: dict[str, list[str]] = field(default_factory=dict)

    def spawn(self, name: str, args: Sequence[str]) -> Child:
        log_path = self.log_dir / f"{name}.log"
        log: IO[bytes] = open(log_path, "ab")
        try:
            process = subprocess.Popen(
                [*_SHOAL, *args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
                preexec_fn=_child_setup if sys.platform == "linux" else None,
            )
        finally:
            log.close()
        child = Child(name, process, log_path)
        self.children.append(child)
        self.commands[name] = list(args)
        return child

    def respawn(self, name: str) -> Child:
        """Start ``name`` again with the command line it had (it logs on into the same file)."""
        return self.spawn(name, self.commands[name])

    def newest(self, name: str) -> Child:
        """The latest process of ``name``."""
        return [c for c in self.children if c.name == name][-1]

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGINT to every child's group (a stop, not an agent's SIGTERM drain), SIGKILL after ``grace_s``."""
        for child in reversed(self.children):
            if child.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                child.process.wait(remaining)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.process.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)  # anything the child left in its group
        if self.nats is not None:
            self.nats.stop()

    def newly_dead(self) -> list[Child]:
        dead = [c for c in self.children if not c.alive() and c.name not in self.reported_dead]
        self.reported_dead.update(c.name for c in dead)
        return dead


def _child_setup() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Die with the parent, and take SIGINT (the stop signal) even if we were started with it ignored."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def child_environment(environ: Mapping[str, str], otlp_endpoint: str | None) -> dict[str, str] | None:
    """The children's environment: ours (``OTEL_*`` pass through) plus ``--otlp-endpoint``.

    The endpoint goes in as the standard variable; None (inherit as is) when there is nothing to add.
    """
    if not otlp_endpoint:
        return None
    return {**environ, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint}


def agent_config(up: UpConfig, nats: NatsOptions, instance_id: str, **more: Any) -> AgentCliConfig:
    """The ``shoal agent`` config of one agent of the cluster ``up`` describes (``more``: other fields).

    The sim engine takes ``--model`` as its profile; a vllm agent gets the cluster's block size,
    context length and KV space; the KV transport is TCP (the agents share this host).
    """
    engine = up.engine
    model = up.model or ("small" if engine == "torch" else "tiny-test")
    fields: dict[str, Any] = {"nats": nats, "instance_id": instance_id, "engine": engine,
                              "threads": up.threads, "transport_kind": "tcp", "num_blocks": up.num_blocks,
                              "prefix_cache": up.prefix_cache}
    if engine == "sim":
        fields.update(profile=model, time_scale=up.time_scale)
    else:
        fields.update(model=model, dtype=up.dtype)
    if engine == "vllm":
        fields.update(block_size=up.block_size, max_model_len=up.max_model_len,
                      kv_cache_bytes=up.kv_cache_bytes)
    if engine == "torch":
        fields.update(engine_core=up.engine_core)
    if up.fault_first_step is not None:
        fields.update(faults=FaultOptions(fault_first_step=up.fault_first_step))
    return AgentCliConfig(**{**fields, **more})


def _health(url: str) -> dict[str, Any] | None:
    """The frontend's ``/health`` body (a 503's too: it says why not ready); None while it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as response:
            data: dict[str, Any] = json.loads(response.read())
            return data
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(Exception):
            body: dict[str, Any] = json.loads(exc.read())
            return body
        return None
    except Exception:
        return None


@dataclass(frozen=True)
class UpConfig(CliConfig):
    """Everything ``shoal up`` is told. Options it passes on to a child keep that child's flag."""

    instances: int = option("--instances", default=2, min=0, help="Agents to start.")
    engine: EngineName = option_like(AgentCliConfig, "engine")
    model: str | None = option_like(
        AgentCliConfig, "model", default=None,
        help="torch: preset (default small) or a Hugging Face checkpoint folder; sim: a profile.")
    port: int = option_like(ServeCliConfig, "port", help="Frontend HTTP port.")
    host: str = option_like(ServeCliConfig, "host")
    nats_url: str | None = nats_url_option(None, help="Use this NATS deployment instead of an embedded one.")
    prefix: str = option_like(NatsOptions, "prefix")
    threads: int = option_like(AgentCliConfig, "threads", help="Torch threads per agent.")
    num_blocks: int | None = option_like(AgentCliConfig, "num_blocks",
                                         help="KV blocks per agent (engine default if unset).")
    time_scale: float = option_like(AgentCliConfig, "time_scale")
    block_size: int = option_like(AgentCliConfig, "block_size", default=32,
                                  help="vllm: KV block size (CPU: x32).")
    max_model_len: int | None = option_like(AgentCliConfig, "max_model_len", help="vllm: context length.")
    dtype: str | None = option_like(AgentCliConfig, "dtype",
                                    help="Model dtype of every agent (torch and vllm).")
    engine_core: Literal["thread", "process"] = option_like(
        AgentCliConfig, "engine_core",
        help="torch: where each agent's model step computes (see shoal agent --engine-core).")
    prefix_cache: bool = option_like(
        AgentCliConfig, "prefix_cache",
        help="Automatic prefix caching in every agent (see shoal agent --prefix-cache).")
    kv_cache_bytes: int | None = option_like(
        AgentCliConfig, "kv_cache_bytes",
        help="vllm: KV space per agent in bytes (on CPU 1 GiB unless VLLM_CPU_KVCACHE_SPACE is set).")
    policy: str = option("--policy", default=DispatchPolicy.PREFILL_AHEAD.value,
                         type=click.Choice([p.value for p in DISPATCH_MENU]),
                         help="Scheduler: the dispatch policy (see shoal scheduler --policy).")
    no_scheduler: bool = option("--no-scheduler", default=False,
                                help="Run without a scheduler (the frontend places requests).")
    requeue_after_s: float | None = option_like(
        SchedulerCliConfig, "requeue_after_s",
        help="Scheduler: move a queued request (no KV) off a queue stalled this long "
             "(default: the scheduler's, 0.5 s; 0: off).")
    autoscale: bool = option(
        "--autoscale", default=False,
        help="Let the scheduler start and stop agents (between --min-instances and --max-instances).")
    min_instances: int | None = option_like(SchedulerCliConfig, "min_instances", default=None,
                                            help="Auto-scaling floor (default: --instances).")
    max_instances: int = option_like(SchedulerCliConfig, "max_instances", default=8,
                                     help="Auto-scaling ceiling.")
    scale: ScaleBandOptions = nested(ScaleBandOptions)
    stall_timeout: float = option_like(ServeCliConfig, "stall_timeout")
    rescue_timeout: float = option_like(ServeCliConfig, "rescue_timeout")
    max_tokens_cap: int | None = option_like(ServeCliConfig, "max_tokens_cap")
    tool_call_parser: str | None = option_like(ServeCliConfig, "tool_call_parser")
    responses_ttl: float = option_like(ServeCliConfig, "responses_ttl")
    log_dir: Path | None = option("--log-dir", default=None, type=click.Path(file_okay=False, path_type=Path),
                                  help="Where each process logs (default: a temporary folder).")
    ready_timeout: float = option("--ready-timeout", default=180.0, min=0, min_open=True,
                                  help="Seconds the cluster may take to serve.")
    secure: bool = option(
        "--secure", default=False,
        help="Embedded NATS with a user per component (nkeys), permissions by role and mutual TLS "
             "(a dev CA); see docs/deploying.md.")
    nats_cluster: int = option("--nats-cluster", default=1, min=1, max=5,
                               help="Embedded NATS nodes (a cluster on loopback ports when > 1).")
    nats_replicas: int | None = option_like(
        NatsOptions, "nats_replicas", default=None, envvar=None,
        help="Replicas of the streams and the KV bucket (default: min(3, --nats-cluster)).")
    otlp_endpoint: str | None = option_like(
        AgentCliConfig, "otlp_endpoint", metavar="URL",
        help="Send every component's spans here (sets OTEL_EXPORTER_OTLP_ENDPOINT for the children; "
             "other OTEL_* variables pass through).")
    restart_delay: float = option("--restart-delay", default=1.0, min=0,
                                  help="Seconds before a child that exited is started again (doubles with "
                                       "each exit within --restart-window).")
    restart_max_delay: float = option("--restart-max-delay", default=30.0, min=0,
                                      help="Longest wait before a restart.")
    restart_limit: int = option("--restart-limit", default=5, min=1,
                                help="A child that exits this many times within --restart-window is left "
                                     "down (its reason shows on /health).")
    restart_window: float = option("--restart-window", default=60.0, min=0, min_open=True,
                                   help="Seconds over which --restart-limit counts exits.")
    fault_first_step: Literal["raise", "exit"] | None = option_like(FaultOptions, "fault_first_step",
                                                                    hidden=True)

    def validate(self) -> None:
        if self.engine == "vllm" and self.model is None:
            raise ConfigError("model", "--engine vllm needs --model CHECKPOINT_FOLDER")
        if self.autoscale and self.no_scheduler:
            raise ConfigError("autoscale", "--autoscale needs the scheduler (drop --no-scheduler)")
        if self.nats_url is not None and (self.secure or self.nats_cluster > 1):
            raise ConfigError("nats_url", "--secure and --nats-cluster configure the embedded NATS; with "
                              "--nats URL pass that deployment's credentials (--nats-creds, SHOAL_NATS_* "
                              "variables)")
        if self.secure and self.autoscale:
            raise ConfigError("secure", "--secure has no users for agents the auto-scaler starts: "
                              "drop --autoscale")
        if self.nats_url is None and self.replicas > self.nats_cluster:
            raise ConfigError("nats_replicas",
                              f"--nats-replicas {self.replicas} needs --nats-cluster {self.replicas} or more")
        if self.restart_max_delay < self.restart_delay:
            raise ConfigError("restart_max_delay", "--restart-max-delay must be at least --restart-delay")

    @property
    def restart_policy(self) -> RestartPolicy:
        """When a child that exited is started again, and when it is left down."""
        return RestartPolicy(initial_delay_s=self.restart_delay, max_delay_s=self.restart_max_delay,
                             max_restarts=self.restart_limit, window_s=self.restart_window)

    @property
    def replicas(self) -> int:
        """Replicas of the streams and the KV bucket."""
        return self.nats_replicas or min(3, self.nats_cluster)

    @property
    def tokenizer(self) -> str:
        """The frontend's ``--model``: the agents' model (``sim:<profile>`` for the sim engine)."""
        model = self.model or ("small" if self.engine == "torch" else "tiny-test")
        return model if self.engine != "sim" else f"sim:{model}"


@click.command("up")
@click_options(UpConfig)
def up(**options: Any) -> None:
    """Run a whole local cluster: NATS, scheduler, agents, frontend. Ctrl-C stops everything."""
    config = from_options(UpConfig, options)
    log_dir: Path = config.log_dir or Path(tempfile.mkdtemp(prefix="shoal-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = ClusterProcesses(log_dir, env=child_environment(os.environ, config.otlp_endpoint))
    stop_requested = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    supervisor = Supervisor(config.restart_policy, cluster.respawn, engine=config.engine)
    try:
        if _start(cluster, config, log_dir, supervisor, lambda: stop_requested):
            _supervise(supervisor, log_dir, lambda: stop_requested)
    finally:
        click.echo("stopping shoal ...", err=True)
        cluster.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        click.echo("stopped", err=True)


def vllm_cpu_binds(instances: int, version: str | None) -> list[str]:
    """Each vllm agent's ``--cpu-bind`` (vLLM's CPU build only: own cores when there are enough).

    ValueError for a malformed ``VLLM_CPU_OMP_THREADS_BIND``; also how ``shoal drill`` splits them.
    """
    from agents.engines.vllm_engine.cpu_binding import physical_cores, split_for_instances

    if not (version or "").endswith("+cpu"):
        return []
    allowed = sorted(os.sched_getaffinity(0))
    return split_for_instances(allowed, instances, os.environ, physical_cores(allowed))


def _vllm_cpu_binds(instances: int, version: str | None) -> list[str]:
    """:func:`vllm_cpu_binds`, echoed; a bad ``VLLM_CPU_OMP_THREADS_BIND`` is a usage error."""
    try:
        binds = vllm_cpu_binds(instances, version)
    except ValueError as exc:
        raise click.UsageError(f"VLLM_CPU_OMP_THREADS_BIND: {exc}") from None
    if binds:
        click.echo(f"cpu binding     vllm model thread CPUs per agent: {' / '.join(binds)}")
    return binds


def _check_port_free(host: str, port: int) -> None:
    """A clear error now, rather than a frontend that cannot bind (and another server's ``/health``)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            why = f"cannot serve on {host}:{port}: {exc.strerror} (--port picks another)"
            raise click.ClickException(why) from None


def _status_path(log_dir: Path) -> Path:
    """The file where ``shoal up`` keeps the children it left down, for the frontend's ``/health``."""
    return log_dir / "supervisor.json"


def _report(supervisor: Supervisor, notices: list[Notice], log_dir: Path) -> None:
    """Print what the supervisor did; a child left down also goes to the frontend's status file."""
    for notice in notices:
        if notice.left_down is not None:
            click.echo(notice.left_down.message(), err=True)
            write_status(_status_path(log_dir), supervisor.left_down)
        else:
            click.echo(notice.detail, err=True)
    if notices:
        sys.stderr.flush()


def _left_down_text(supervisor: Supervisor) -> str:
    """Why each child left down is (their log tails were printed when they were left down)."""
    return "\n".join(f"{d.reason}; log: {d.log_path}" for d in supervisor.left_down)


def _start(cluster: ClusterProcesses, config: UpConfig, log_dir: Path, supervisor: Supervisor,
           stopping: Callable[[], bool]) -> bool:
    """Start everything and wait until the frontend sees every instance not left down (one at least);
    False if stopped meanwhile. Children that exit meanwhile are restarted (``supervisor``)."""
    require_engine(config.engine)  # exit 2 naming the extra, before anything starts
    _check_port_free(config.host, config.port)
    nats_url = config.nats_url
    from bus.launch import SecureSetup, start_embedded

    secure = None
    if config.secure:
        secure = SecureSetup.create(log_dir, config.prefix, config.instances)
    if nats_url is None:
        cluster.nats, nats_url = start_embedded(log_dir, config.nats_cluster, config.replicas, config.prefix,
                                                secure)
        nodes = getattr(cluster.nats, "nodes", [cluster.nats])
        pids = ",".join(str(node.pid) for node in nodes)
        click.echo(f"nats-server     {redact_url(nats_url)} (embedded, pid {pids}, {len(nodes)} node(s), "
                   f"{config.replicas} replica(s))")
    else:
        click.echo(f"nats            {redact_url(nats_url)}")
    url: str = nats_url
    if secure is not None:
        click.echo(f"security        nkey user per component, permissions by role, mutual TLS; "
                   f"credentials in {secure.deployment.directory}")

    def nats(user: str) -> NatsOptions:
        """How the component of ``user`` reaches the cluster (with its own credentials when secure)."""
        auth = NatsAuthOptions() if secure is None else NatsAuthOptions.from_auth(
            secure.deployment.auth(user))
        return NatsOptions(nats_url=url, auth=auth, nats_replicas=config.replicas, prefix=config.prefix)

    cpu_binds: list[str] = []
    if config.engine == "vllm":  # vLLM on CPU would size each agent's KV to 90% of RAM: 1 GiB unless told
        from agents.engines.vllm_engine import vllm_version
        from agents.engines.vllm_engine.config import default_kv_cache_bytes

        kv_cache_bytes = default_kv_cache_bytes(config.kv_cache_bytes, vllm_version(), os.environ)
        if kv_cache_bytes != config.kv_cache_bytes:
            config = dataclasses.replace(config, kv_cache_bytes=kv_cache_bytes)
            click.echo(f"kv cache        {(kv_cache_bytes or 0) / 2**30:g} GiB per agent "
                       "(vLLM on CPU; --kv-cache-bytes)")
        cpu_binds = _vllm_cpu_binds(config.instances, vllm_version())

    if config.no_scheduler:
        click.echo("scheduler       (none: the frontend places requests itself)")
    else:
        metrics_port = free_port()
        scheduler = SchedulerCliConfig(
            nats=nats("scheduler"), requeue_after_s=config.requeue_after_s,
            policy=PolicyOptions(policy=config.policy), metrics=MetricsOptions(metrics_port=metrics_port),
        )
        if config.autoscale:
            # the scheduler's instance manager runs more agents like ours, as its own children (their
            # metrics on any free port, printed in the scheduler's log)
            template = agent_config(config, nats("scheduler"), "{instance_id}",
                                    metrics=MetricsOptions(metrics_port=0))
            scheduler = dataclasses.replace(
                scheduler,
                autoscale_command=shlex.join([*_SHOAL, "agent", *to_argv(template)]),
                min_instances=config.instances if config.min_instances is None else config.min_instances,
                max_instances=config.max_instances,
                scale=config.scale,
            )
        child = cluster.spawn("scheduler", ["scheduler", *to_argv(scheduler)])
        supervisor.watch(child)
        click.echo(f"scheduler       pid {child.pid}  metrics http://127.0.0.1:{metrics_port}/metrics"
                   + ("  (auto-scaling)" if config.autoscale else ""))
    for index in range(config.instances):
        instance_id = f"agent-{index}"
        metrics_port = free_port()
        agent = agent_config(config, nats(instance_id), instance_id,
                             cpu_bind=cpu_binds[index] if cpu_binds else None,
                             metrics=MetricsOptions(metrics_port=metrics_port))
        child = cluster.spawn(instance_id, ["agent", *to_argv(agent)])
        supervisor.watch(child)
        click.echo(f"agent           {instance_id} pid {child.pid}  metrics http://127.0.0.1:{metrics_port}/metrics")
    write_status(_status_path(log_dir), [])
    serve = ServeCliConfig(nats=nats("frontend"), model=config.tokenizer, host=config.host, port=config.port,
                           stall_timeout=config.stall_timeout, rescue_timeout=config.rescue_timeout,
                           max_tokens_cap=config.max_tokens_cap, supervisor_status=_status_path(log_dir),
                           tool_call_parser=config.tool_call_parser, responses_ttl=config.responses_ttl)
    child = cluster.spawn("frontend", ["serve", *to_argv(serve)])
    supervisor.watch(child)
    click.echo(f"frontend        pid {child.pid}")
    click.echo(f"logs            {log_dir}")
    url = f"http://{config.host}:{config.port}"
    agents = {f"agent-{index}" for index in range(config.instances)}
    deadline = time.monotonic() + config.ready_timeout
    while not stopping():
        frontend = supervisor.child("frontend")
        health = _health(url)
        if health is not None and (frontend is None or health.get("pid") != frontend.pid):
            health = None  # another server answers on that port, not this frontend (it may fail to bind)
        ready = health.get("instances", []) if health is not None and health.get("status") == "ok" else []
        down = {d.name for d in supervisor.left_down}
        if ready and len(ready) >= max(1, len(agents - down)):  # ready: a request would be placed on each
            break
        _report(supervisor, supervisor.poll(), log_dir)
        down = {d.name for d in supervisor.left_down}
        if supervisor.child("frontend") is None:
            raise click.ClickException("the frontend stopped")
        if "frontend" in down or (agents and agents <= down) or (down and not agents):
            raise click.ClickException(f"no instance became ready:\n{_left_down_text(supervisor)}")
        if time.monotonic() > deadline:
            why = "the frontend does not answer" if health is None else json.dumps(health)
            raise click.ClickException("\n".join(filter(None, [
                f"the cluster was not ready within {config.ready_timeout}s: {why}",
                _left_down_text(supervisor),
            ])))
        time.sleep(0.2)
    else:
        return False
    for left in supervisor.left_down:
        click.echo(f"warning         {left.name} is left down: {left.reason}", err=True)
    name = config.tokenizer
    click.echo("")
    click.echo(f"API             {url}/v1")
    click.echo(f"health          {url}/health")
    click.echo(f"metrics         {url}/metrics  (frontend)")
    click.echo(f"shoal is serving {name} at {url}/v1  (Ctrl-C stops everything)")
    click.echo("try:")
    click.echo(
        f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'"
    )
    sys.stdout.flush()
    return True


def _supervise(supervisor: Supervisor, log_dir: Path, stopping: Callable[[], bool]) -> None:
    """Restart children that exit, per the supervisor's policy, until stopped; give up with the
    frontend."""
    while not stopping():
        _report(supervisor, supervisor.poll(), log_dir)
        if any(d.name == "frontend" for d in supervisor.left_down):
            raise click.ClickException(f"the frontend is left down:\n{_left_down_text(supervisor)}")
        if supervisor.child("frontend") is None:
            raise click.ClickException("the frontend stopped")
        time.sleep(0.2)

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
embedded server stops last: no orphans. A child that dies is reported; the
cluster keeps serving while the frontend lives (rescue and bypass cover
agents and the scheduler). With ``--autoscale`` the scheduler's
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
import importlib.util
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
from typing import IO, Any

import click

from bus.auth import redact_url
from bus.extras import require_engine
from bus.options import auth_file_flags, nats_option
from bus.server import die_with_parent, free_port
from scheduler.cli import scale_band_options

__all__ = ["Child", "ClusterProcesses", "agent_command", "child_environment", "up", "vllm_cpu_binds"]

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


@dataclass
class ClusterProcesses:
    """The children of one ``shoal up``; :meth:`stop_all` ends every one of them."""

    log_dir: Path
    #: the children's environment (None: this process's, ``OTEL_*`` included)
    env: dict[str, str] | None = None
    children: list[Child] = field(default_factory=list)
    nats: Any = None
    reported_dead: set[str] = field(default_factory=set)

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
        return child

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


def agent_command(
    options: Mapping[str, Any], common: Sequence[str], model: str, instance_id: str
) -> list[str]:
    """``shoal agent`` arguments for one agent of the cluster ``options`` describe (also ``shoal drill``)."""
    engine = options["engine"]
    args = ["agent", *common, "--instance-id", instance_id, "--engine", engine,
            "--threads", str(options["threads"]), "--transport", "tcp"]
    args += ["--model", model] if engine != "sim" else ["--profile", model,
                                                        "--time-scale", str(options["time_scale"])]
    if engine == "vllm":
        args += ["--block-size", str(options["block_size"])]
        args += [a for k in ("max_model_len", "kv_cache_bytes") if options[k] is not None
                 for a in (f"--{k.replace('_', '-')}", str(options[k]))]
    if engine != "sim" and options.get("dtype") is not None:
        args += ["--dtype", str(options["dtype"])]
    if engine == "torch" and options.get("engine_core", "thread") != "thread":
        args += ["--engine-core", str(options["engine_core"])]
    if options["num_blocks"] is not None:
        args += ["--num-blocks", str(options["num_blocks"])]
    return args


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


def _tail(path: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


@click.command("up")
@click.option("--instances", type=int, default=2, show_default=True, help="Agents to start.")
@click.option("--engine", type=click.Choice(["torch", "sim", "vllm"]), default="torch", show_default=True)
@click.option("--model", default=None,
              help="torch: preset (default small) or a Hugging Face checkpoint folder; sim: a profile.")
@click.option("--port", type=int, default=8000, show_default=True, help="Frontend HTTP port.")
@click.option("--host", default="127.0.0.1", show_default=True)
@nats_option(None, help="Use this NATS deployment instead of an embedded one.")
@click.option("--prefix", default="shoal", show_default=True, help="Subject prefix of the cluster.")
@click.option("--threads", type=int, default=1, show_default=True, help="Torch threads per agent.")
@click.option("--num-blocks", type=int, default=None, help="KV blocks per agent (engine default if unset).")
@click.option("--time-scale", type=float, default=1.0, show_default=True, help="sim: step time multiplier.")
@click.option("--block-size", type=int, default=32, show_default=True, help="vllm: KV block size (CPU: x32).")
@click.option("--max-model-len", type=int, default=None, help="vllm: context length.")
@click.option("--dtype", default=None, help="Model dtype of every agent (torch and vllm).")
@click.option("--engine-core", type=click.Choice(["thread", "process"]), default="thread", show_default=True,
              help="torch: where each agent's model step computes (see shoal agent --engine-core).")
@click.option("--kv-cache-bytes", type=int, default=None,
              help="vllm: KV space per agent in bytes (on CPU 1 GiB unless VLLM_CPU_KVCACHE_SPACE is set).")
@click.option("--no-scheduler", is_flag=True, help="Run without a scheduler (the frontend places requests).")
@click.option("--requeue-after-s", type=click.FloatRange(min=0), default=None,
              help="Scheduler: move a queued request (no KV) off a queue stalled this long "
              "(default: the scheduler's, 0.5 s; 0: off).")
@click.option("--autoscale", is_flag=True,
              help="Let the scheduler start and stop agents (between --min-instances and --max-instances).")
@click.option("--min-instances", type=int, default=None, help="Auto-scaling floor (default: --instances).")
@click.option("--max-instances", type=int, default=8, show_default=True, help="Auto-scaling ceiling.")
@scale_band_options
@click.option("--stall-timeout", type=float, default=30.0, show_default=True)
@click.option("--max-tokens-cap", type=int, default=None, help="Clamp every request's max_tokens.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where each process logs (default: a temporary folder).")
@click.option("--ready-timeout", type=float, default=180.0, show_default=True)
@click.option("--secure", is_flag=True,
              help="Embedded NATS with a user per component (nkeys), permissions by role and mutual TLS "
                   "(a dev CA); see README 'Security'.")
@click.option("--nats-cluster", type=click.IntRange(1, 5), default=1, show_default=True,
              help="Embedded NATS nodes (a cluster on loopback ports when > 1).")
@click.option("--nats-replicas", type=click.IntRange(1, 5), default=None,
              help="Replicas of the streams and the KV bucket (default: min(3, --nats-cluster)).")
@click.option("--otlp-endpoint", default=None, metavar="URL",
              help="Send every component's spans here (sets OTEL_EXPORTER_OTLP_ENDPOINT for the children; "
                   "other OTEL_* variables pass through).")
def up(**options: Any) -> None:
    """Run a whole local cluster: NATS, scheduler, agents, frontend. Ctrl-C stops everything."""
    log_dir: Path = options["log_dir"] or Path(tempfile.mkdtemp(prefix="shoal-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = ClusterProcesses(log_dir, env=child_environment(os.environ, options["otlp_endpoint"]))
    stop_requested = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if _start(cluster, options, log_dir, lambda: stop_requested):
            _supervise(cluster, options, lambda: stop_requested)
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


def _start(
    cluster: ClusterProcesses, options: dict[str, Any], log_dir: Path, stopping: Callable[[], bool]
) -> bool:
    """Start everything and wait until the frontend sees every instance; False if stopped meanwhile."""
    if options["engine"] == "vllm" and options["model"] is None:
        raise click.UsageError("--engine vllm needs --model CHECKPOINT_FOLDER")
    require_engine(options["engine"])  # exit 2 naming the extra, before anything starts
    if options["autoscale"] and options["no_scheduler"]:
        raise click.UsageError("--autoscale needs the scheduler (drop --no-scheduler)")
    _check_port_free(options["host"], options["port"])
    nats_url = options["nats_url"]
    replicas = options["nats_replicas"] or min(3, options["nats_cluster"])
    if nats_url is not None and (options["secure"] or options["nats_cluster"] > 1):
        raise click.UsageError("--secure and --nats-cluster configure the embedded NATS; with --nats URL "
                               "pass that deployment's credentials (--nats-creds, SHOAL_NATS_* variables)")
    if options["secure"] and options["autoscale"]:
        raise click.UsageError("--secure has no users for agents the auto-scaler starts: drop --autoscale")
    if replicas > options["nats_cluster"] and nats_url is None:
        raise click.UsageError(f"--nats-replicas {replicas} needs --nats-cluster {replicas} or more")
    from bus.launch import SecureSetup, start_embedded

    secure = None
    if options["secure"]:
        secure = SecureSetup.create(log_dir, options["prefix"], options["instances"])
    if nats_url is None:
        cluster.nats, nats_url = start_embedded(log_dir, options["nats_cluster"], replicas, options["prefix"],
                                                secure)
        nodes = getattr(cluster.nats, "nodes", [cluster.nats])
        pids = ",".join(str(node.pid) for node in nodes)
        click.echo(f"nats-server     {redact_url(nats_url)} (embedded, pid {pids}, {len(nodes)} node(s), "
                   f"{replicas} replica(s))")
    else:
        click.echo(f"nats            {redact_url(nats_url)}")
    if secure is not None:
        click.echo(f"security        nkey user per component, permissions by role, mutual TLS; "
                   f"credentials in {secure.deployment.directory}")

    def auth_args(user: str) -> list[str]:
        return auth_file_flags(secure.deployment.auth(user)) if secure is not None else []

    common = ["--nats", nats_url, "--prefix", options["prefix"], "--nats-replicas", str(replicas)]
    engine = options["engine"]
    cpu_binds: list[str] = []
    if engine == "vllm":  # vLLM on CPU would size each agent's KV to 90% of RAM: 1 GiB unless told
        from agents.engines.vllm_engine import vllm_version
        from agents.engines.vllm_engine.config import default_kv_cache_bytes

        kv_cache_bytes = default_kv_cache_bytes(options["kv_cache_bytes"], vllm_version(), os.environ)
        if kv_cache_bytes != options["kv_cache_bytes"]:
            options = {**options, "kv_cache_bytes": kv_cache_bytes}
            click.echo(f"kv cache        {(kv_cache_bytes or 0) / 2**30:g} GiB per agent "
                       "(vLLM on CPU; --kv-cache-bytes)")
        cpu_binds = _vllm_cpu_binds(options["instances"], vllm_version())
    model = options["model"] or ("small" if engine == "torch" else "tiny-test")

    def agent_args(instance_id: str) -> list[str]:
        return agent_command(options, [*common, *auth_args(instance_id)], model, instance_id)

    if options["no_scheduler"]:
        click.echo("scheduler       (none: the frontend places requests itself)")
    elif importlib.util.find_spec("scheduler.cli") is None:
        click.echo("scheduler       (not built yet: the frontend places requests itself)")
    else:
        scheduler_args = ["scheduler", *common, *auth_args("scheduler")]
        if options["autoscale"]:
            # the scheduler's instance manager runs more agents like ours, as its own children
            low, high = options["scale_band"]
            scheduler_args += [
                "--autoscale-command",
                shlex.join([*_SHOAL, *agent_args("{instance_id}"), "--metrics-port", "0"]),  # port: its log
                "--min-instances", str(options["instances"] if options["min_instances"] is None
                                       else options["min_instances"]),
                "--max-instances", str(options["max_instances"]),
                "--scale-band", str(low), str(high), "--scale-sustain", str(options["scale_sustain"]),
            ]
        if options["requeue_after_s"] is not None:
            scheduler_args += ["--requeue-after-s", str(options["requeue_after_s"])]
        metrics_port = free_port()
        scheduler_args += ["--metrics-port", str(metrics_port)]
        child = cluster.spawn("scheduler", scheduler_args)
        click.echo(f"scheduler       pid {child.pid}  metrics http://127.0.0.1:{metrics_port}/metrics"
                   + ("  (auto-scaling)" if options["autoscale"] else ""))
    for index in range(options["instances"]):
        instance_id = f"agent-{index}"
        metrics_port = free_port()
        bind = ["--cpu-bind", cpu_binds[index]] if cpu_binds else []
        child = cluster.spawn(instance_id, [*agent_args(instance_id), *bind, "--metrics-port",
                                            str(metrics_port)])
        click.echo(f"agent           {instance_id} pid {child.pid}  metrics http://127.0.0.1:{metrics_port}/metrics")
    tokenizer = model if engine != "sim" else f"sim:{model}"
    serve_args = ["serve", *common, *auth_args("frontend"), "--model", tokenizer, "--host", options["host"],
                  "--port", str(options["port"]), "--stall-timeout", str(options["stall_timeout"])]
    if options["max_tokens_cap"] is not None:
        serve_args += ["--max-tokens-cap", str(options["max_tokens_cap"])]
    child = cluster.spawn("frontend", serve_args)
    click.echo(f"frontend        pid {child.pid}")
    click.echo(f"logs            {log_dir}")
    url = f"http://{options['host']}:{options['port']}"
    deadline = time.monotonic() + options["ready_timeout"]
    while not stopping():
        health = _health(url)
        if health is not None and health.get("pid") != child.pid:
            health = None  # another server answers on that port, not this frontend (it may fail to bind)
        ready = health.get("instances", []) if health is not None and health.get("status") == "ok" else []
        if len(ready) >= max(1, options["instances"]):  # ready: a request would be placed on each
            break
        for dead in cluster.newly_dead():
            raise click.ClickException(
                f"{dead.name} exited with code {dead.process.returncode}:\n{_tail(dead.log_path)}"
            )
        if time.monotonic() > deadline:
            why = "the frontend does not answer" if health is None else json.dumps(health)
            raise click.ClickException(f"the cluster was not ready within {options['ready_timeout']}s: {why}")
        time.sleep(0.2)
    else:
        return False
    name = tokenizer
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


def _supervise(cluster: ClusterProcesses, options: dict[str, Any], stopping: Callable[[], bool]) -> None:
    frontend = next(c for c in cluster.children if c.name == "frontend")
    while not stopping():
        for dead in cluster.newly_dead():
            click.echo(f"{dead.name} (pid {dead.pid}) exited with code {dead.process.returncode}", err=True)
        if not frontend.alive():
            raise click.ClickException(f"the frontend exited:\n{_tail(frontend.log_path)}")
        time.sleep(0.2)

"""``shoal agent``: run one instance agent driving one engine until stopped or drained.

Parses its options into one frozen
:class:`~agents.engines.agent_cli.AgentCliConfig` (which declares them), turns
it into the engine, transport, migration and agent configs, sets
torch's thread count before the engine is built, connects to NATS, starts the
:class:`~agents.service.Agent` and runs until SIGINT (a clean stop with
``InstanceLeft``) or until a drain completes. SIGTERM *drains*: the instance
reports terminating, refuses new requests, the scheduler migrates its requests
away live (those it cannot move finish here), then it leaves; a second SIGTERM,
SIGINT or ``--drain-timeout`` seconds end it with a clean stop at once, and so
does a SIGTERM that comes because the process that started the agent died
(``--no-drain-on-term``: SIGTERM stops at once, as SIGINT). ``--fault-*``
options set the agent's :class:`~agents.config.FaultPlan` (drills and tests:
lose or repeat handshake messages, slow each stage copy down, make the engine's first
step raise or kill the process). The agent is serving once its engine has served a
warm-up request (:mod:`agents.warm_up`); one that cannot exits 1 (``Error: agent … never
became ready: …``) without having announced itself. ``--ready-file`` writes
a small JSON (instance id, transport address) once the agent is serving, for
scripts and benchmarks that start agents as subprocesses. Tracing follows the
standard ``OTEL_*`` variables (:mod:`bus.telemetry`), read here and nowhere below.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import logging
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import click

from agents.config import AgentConfig, FaultPlan, FirstStepFault, StepPace
from agents.engines.agent_cli import AgentCliConfig, FaultOptions
from bus import event_loop
from bus.cli_config import click_options, from_options
from bus.extras import require_engine

__all__ = ["agent", "agent_config", "build_engine", "fault_plan"]

log = logging.getLogger(__name__)


def build_engine(
    engine: str,
    *,
    model: str,
    profile: str,
    num_blocks: int | None,
    kv_cache_bytes: int | None,
    block_size: int | None,
    max_batch_size: int,
    max_model_len: int | None,
    seed: int,
    device: str,
    time_scale: float,
    vllm_options: dict[str, Any] | None = None,
    max_step_tokens: int | None = 2048,
    dtype: str | None = None,
    engine_core: str = "thread",
    threads: int | None = None,
    prefix_cache: bool = True,
) -> Any:
    """The engine the options describe (torch is imported only when chosen).

    ``block_size`` None: the engine's default (torch 16, vllm 32). ``dtype``
    (torch; vLLM's comes in ``vllm_options``) None or ``"auto"``: the engine's
    default (float32 on CPU). ``prefix_cache``: automatic prefix caching (sim and torch; vllm's
    comes in ``vllm_options``). Bad vllm options (tensor parallelism with
    migration, say) are a usage error.
    """
    if engine == "sim":
        from agents.engines.sim import SimEngine

        return SimEngine(profile, num_blocks=num_blocks, max_batch_size=max_batch_size, time_scale=time_scale,
                         prefix_cache=prefix_cache)
    if engine == "torch":
        from agents.engines.torch_engine import TorchEngine, TorchEngineConfig

        return TorchEngine(
            TorchEngineConfig(
                model=model,
                seed=seed,
                device=device,
                block_size=16 if block_size is None else block_size,
                num_blocks=num_blocks,
                kv_cache_bytes=kv_cache_bytes,
                max_model_len=max_model_len,
                max_batch_size=max_batch_size,
                max_step_tokens=max_step_tokens,
                dtype=None if dtype in (None, "auto") else dtype,
                core=engine_core,
                core_threads=threads,
                prefix_cache=prefix_cache,
            )
        )
    if engine == "vllm":
        from agents.engines.vllm_engine.config import DEFAULT_BLOCK_SIZE, VllmEngineConfig

        extra = vllm_options or {}
        try:
            config = VllmEngineConfig(
                model=model,
                block_size=DEFAULT_BLOCK_SIZE if block_size is None else block_size,
                num_blocks=num_blocks,
                kv_cache_bytes=kv_cache_bytes,
                max_model_len=max_model_len,
                max_batch_size=max_batch_size,
                seed=seed,
                **{k: v for k, v in extra.items() if v is not None},
            )
        except ValueError as exc:
            raise click.UsageError(f"--engine vllm: {exc}") from exc
        from agents.engines.vllm_engine.amx import AmxUnavailable
        from agents.engines.vllm_engine.engine import VllmEngine

        try:
            return VllmEngine(config)
        except AmxUnavailable as exc:
            raise click.ClickException(f"--engine vllm: {exc}") from None
    raise click.BadParameter(f"unknown engine {engine!r}", param_hint="--engine")


@click.command("agent")
@click_options(AgentCliConfig)
def agent(**options: Any) -> None:
    """Run one instance agent driving an engine."""
    config = from_options(AgentCliConfig, options)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    require_engine(config.engine)  # exit 2 naming the extra, before anything starts
    if config.engine == "torch":
        import torch

        torch.set_num_threads(config.threads)
    faults = fault_plan(config.faults)
    with _own_temp_folder(config.engine == "vllm"):
        event_loop.run(_run(config, faults))


@contextlib.contextmanager
def _own_temp_folder(wanted: bool) -> Iterator[None]:
    """The process's temporary files in a folder of its own, removed when the agent ends.

    vLLM leaves files in the temporary folder when it shuts down (its rendezvous store
    ``vllm_dist_*``, ZeroMQ socket paths): a vllm agent takes them with it (a ``kill -9``
    leaves that one folder). torch's compile cache is not temporary and stays where it was.
    """
    if not wanted:
        yield
        return
    # torch's compile cache stays where it was (torch's default), to be found by the next start
    cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
    path = tempfile.mkdtemp(prefix="shoal-agent-")
    before = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = path
    try:
        yield
    finally:  # as it was (the agent may run inside another program: a test, a CliRunner)
        if before[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before[0]
        tempfile.tempdir = before[1]
        shutil.rmtree(path, ignore_errors=True)


def _vllm_cpus(requested: str | None, on_cpu: bool) -> tuple[int, ...]:
    """The vllm model thread's CPUs (see :mod:`~agents.engines.vllm_engine.cpu_binding`), logged.

    Only vLLM's CPU build binds (as vLLM itself); elsewhere only an explicit ``--cpu-bind`` does.
    Bad input is a usage error.
    """
    from agents.engines.vllm_engine.cpu_binding import physical_cores, plan_cpu_binding

    if not on_cpu and not requested:
        return ()
    allowed = sorted(os.sched_getaffinity(0))
    try:
        binding = plan_cpu_binding(allowed, os.environ, requested, physical_cores(allowed))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--cpu-bind") from None
    log.info("%s", binding.describe())
    return binding.cpus


def fault_plan(options: FaultOptions) -> FaultPlan:
    """The :class:`~agents.config.FaultPlan` the ``--fault-*`` options describe (bad ones: a usage error)."""
    try:
        return FaultPlan(drop_outgoing=options.messages("drop", "out"),
                         drop_incoming=options.messages("drop", "in"),
                         duplicate_outgoing=options.messages("duplicate", "out"),
                         duplicate_incoming=options.messages("duplicate", "in"),
                         max_faults=options.fault_max,
                         copy_delay_s=options.fault_copy_delay,
                         pace=StepPace(options.fault_min_step) if options.fault_min_step else None,
                         first_step=None if options.fault_first_step is None
                         else FirstStepFault(options.fault_first_step))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--fault-*") from None


def agent_config(options: AgentCliConfig, instance_id: str, faults: FaultPlan) -> AgentConfig:
    """The :class:`~agents.config.AgentConfig` of an agent started with ``options``."""
    from agents.migration.fsm.config import MigrationConfig
    from transport import TransportConfig

    return AgentConfig(
        instance_id=instance_id,
        report_interval_s=options.report_interval,
        heartbeat_interval_s=options.heartbeat_interval,
        orphan_check_interval_s=options.orphan_check_interval,
        migration=MigrationConfig(
            last_stage_max_blocks=options.last_stage_max_blocks,
            max_stages=options.max_stages,
            max_concurrent_per_instance=options.max_concurrent_migrations,
            copy_timeout_s=options.migration_copy_timeout,
            copy_step_share=options.migration_copy_share,
            destination_idle_timeout_s=options.migration_idle_timeout,
        ),
        faults=faults,
        transport=TransportConfig(
            kind=options.transport_kind,
            host=options.transport_host,
            advertise_host=options.transport_advertise,
            port=options.transport_port,
            ucx_tls=options.ucx_tls,
        ),
    )


def _engine(options: AgentCliConfig) -> Any:
    """The engine ``options`` describe; vllm on CPU: the KV space and the model thread's CPUs decided here."""
    kv_cache_bytes, cpus = options.kv_cache_bytes, None
    if options.engine == "vllm":
        from agents.engines.vllm_engine import vllm_version
        from agents.engines.vllm_engine.config import default_kv_cache_bytes

        kv_cache_bytes = default_kv_cache_bytes(options.kv_cache_bytes, vllm_version(), os.environ)
        if kv_cache_bytes != options.kv_cache_bytes:
            log.info(
                "vllm on CPU: %g GiB of KV space (--kv-cache-bytes; vLLM's own default is 90%% of RAM)",
                (kv_cache_bytes or 0) / 2**30,
            )
        cpus = _vllm_cpus(options.cpu_bind, (vllm_version() or "").endswith("+cpu"))
    return build_engine(
        options.engine,
        model=options.model,
        profile=options.profile,
        num_blocks=options.num_blocks,
        kv_cache_bytes=kv_cache_bytes,
        block_size=options.block_size,
        max_batch_size=options.max_batch_size,
        max_model_len=options.max_model_len,
        seed=options.seed,
        device=options.device,
        time_scale=options.time_scale,
        max_step_tokens=options.max_step_tokens or None,
        dtype=options.dtype,
        engine_core=options.engine_core,
        threads=options.threads,
        prefix_cache=options.prefix_cache,
        vllm_options={
            "dtype": options.dtype,
            "gpu_memory_utilization": options.gpu_memory_utilization,
            "tensor_parallel_size": options.tensor_parallel_size,
            "cpus": cpus,
            "prefix_cache": options.prefix_cache,
        },
    )


async def _run(options: AgentCliConfig, faults: FaultPlan) -> None:
    from agents.agent import Agent
    from agents.warm_up import WarmUpFailed
    from bus import BusConfig, JetStreamBus, StreamConfig
    from bus.heap import freeze_startup_heap
    from bus.metrics import BusCollector
    from bus.telemetry import TelemetryConfig, tracer_provider
    from schemas import Subjects

    instance_id = options.instance_id or f"agent-{uuid.uuid4().hex[:8]}"
    engine = _engine(options)
    config = agent_config(options, instance_id, faults)
    environ = dict(os.environ)
    if options.otlp_endpoint:
        environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = options.otlp_endpoint
    provider = tracer_provider(TelemetryConfig.from_env(environ), "shoal-agent", instance_id=instance_id)
    nats = options.nats
    bus = JetStreamBus(
        BusConfig(url=nats.nats_url, auth=nats.auth.auth, subjects=Subjects(nats.prefix),
                  streams=StreamConfig(replicas=nats.nats_replicas), name=instance_id)
    )
    await bus.connect()
    runner = Agent(engine, bus, config, tracer_provider=provider)
    runner.metrics.registry.register(BusCollector(lambda: bus))
    try:
        await runner.start()
    except WarmUpFailed as exc:
        log.error("agent %s is not ready: %s", instance_id, exc)
        if callable(close := getattr(engine, "close", None)):
            close()
        await bus.close()
        raise click.ClickException(f"agent {instance_id} never became ready: {exc}") from None
    freeze_startup_heap()  # the model, the engine and every import: out of later full collections
    log.info(
        "agent %s serving (%s engine, transport %s)",
        instance_id,
        engine.info.engine,
        runner.transport.address,
    )
    metrics_url = None
    metrics = options.metrics
    if metrics.metrics_port is not None:
        from prometheus_client import start_http_server

        server, _ = start_http_server(metrics.metrics_port, addr=metrics.metrics_host,
                                      registry=runner.metrics.registry)
        metrics_url = f"http://{metrics.metrics_host}:{server.server_port}/metrics"
        click.echo(f"agent {instance_id} metrics {metrics_url}")
    ready_file = options.ready_file

    def announce_ready() -> None:
        """Write the ready file (once the signal handlers are in place: whoever reads it may signal at
        once), whole or not at all."""
        if ready_file is None:
            return
        ready = {"instance_id": instance_id, "transport_address": runner.transport.address,
                 "metrics_url": metrics_url}
        partial = ready_file.with_name(ready_file.name + ".partial")
        partial.write_text(json.dumps(ready))
        partial.replace(ready_file)

    try:
        await _serve_until_stopped(runner, drain_on_term=options.drain_on_term,
                                   drain_timeout_s=options.drain_timeout, on_ready=announce_ready)
    finally:
        if callable(close := getattr(engine, "close", None)):
            close()  # the torch engine's core process
    await bus.close()
    if provider is not None:
        provider.shutdown()


async def _serve_until_stopped(
    runner: Any, *, drain_on_term: bool, drain_timeout_s: float, on_ready: Callable[[], None] | None = None
) -> None:
    """Run until SIGINT, a drain that completes, or SIGTERM (a drain, bounded; a second one stops).

    ``on_ready`` runs once the signal handlers are installed."""
    from schemas import TerminateReason

    stop = asyncio.Event()
    drain = asyncio.Event()
    parent = os.getppid()

    def on_term() -> None:
        orphaned = os.getppid() != parent  # the launcher died (PR_SET_PDEATHSIG sends SIGTERM): stop now
        if drain_on_term and not orphaned and not drain.is_set() and not runner.terminating:
            log.info("agent %s: SIGTERM, draining (a second SIGTERM stops at once)", runner.instance_id)
            drain.set()
        else:
            stop.set()

    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, on_term)
    if on_ready is not None:
        on_ready()
    stop_wait = asyncio.ensure_future(stop.wait())
    drain_wait = asyncio.ensure_future(drain.wait())
    drained = asyncio.ensure_future(runner.stopped.wait())
    try:
        await asyncio.wait({stop_wait, drained, drain_wait}, return_when=asyncio.FIRST_COMPLETED)
        if drain.is_set() and not stop.is_set() and not runner.stopped.is_set():
            await runner.drain(TerminateReason.STOP_SIGNAL)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_timeout_s):
                    await asyncio.wait({stop_wait, drained}, return_when=asyncio.FIRST_COMPLETED)
            if not runner.stopped.is_set():
                log.warning("agent %s: stopping before the drain completed", runner.instance_id)
    finally:
        for task in (stop_wait, drain_wait, drained):
            task.cancel()
    if not runner.stopped.is_set():
        await runner.stop()

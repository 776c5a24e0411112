"""``shoal scheduler``: run the global scheduler (or a standby) against a NATS server.

Parses options into a frozen :class:`~scheduler.service.SchedulerConfig` and
runs :class:`~scheduler.service.SchedulerService` until SIGINT/SIGTERM (a
clean stop releases the lease so a standby takes over at once). With
``--autoscale-command`` scale decisions start and stop local agent processes
through :class:`~scheduler.instances.LocalProcessManager`. Tracing follows the
standard ``OTEL_*`` variables (:mod:`bus.telemetry`), read here and nowhere below.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import msgspec
from opentelemetry.sdk.trace import TracerProvider

from bus import BusConfig, JetStreamBus, StreamConfig, event_loop
from bus.metrics import BusCollector
from bus.options import metrics_options, nats_auth_options, nats_option, nats_replicas_option
from bus.telemetry import TelemetryConfig, tracer_provider
from scheduler.config import (
    DISPATCH_MENU,
    SHOAL_HIGH_FREENESS,
    SHOAL_REQUEUE_AFTER_S,
    DispatchPolicy,
    PairingConfig,
    PolicyConfig,
    ScalingConfig,
    shoal_pairing,
)
from scheduler.instances import InstanceManager, LocalProcessManager
from scheduler.service import SchedulerConfig, SchedulerService, default_scheduler_id
from schemas import Subjects

__all__ = ["policy_from_options", "policy_options", "scale_band_options", "scheduler"]

F = Callable[..., Any]


def policy_options(function: F) -> F:
    """``--policy``, ``--low-freeness``, ``--high-freeness``, ``--target-freeness``."""
    for option in reversed(
        [
            click.option(
                "--policy",
                type=click.Choice([p.value for p in DISPATCH_MENU]),
                default=DispatchPolicy.PREFILL_AHEAD.value,
                show_default=True,
                help="Dispatch policy. prefill_ahead: shoal's, the instance where the request would start "
                "soonest (the prompts queued or not yet prefilled ahead of it, or the memory it would wait "
                "for), with shoal's migration rules (room-checked pairs, no retry of an aborted request for "
                "2 s, at most 3 moves per request) and the move of queued requests; freeness: the Llumnix "
                "paper's (highest freeness, the paper's migration); infaas++: least memory load counting the "
                "queue, no migration; round_robin: no migration.",
            ),
            click.option(
                "--low-freeness",
                type=float,
                default=PairingConfig().low_freeness,
                show_default=True,
                help="Migration sources are below this freeness.",
            ),
            click.option(
                "--high-freeness",
                type=float,
                default=None,
                help="Migration destinations are above this freeness "
                f"[default: {SHOAL_HIGH_FREENESS:g} for prefill_ahead, "
                f"{PairingConfig().high_freeness:g} for the others].",
            ),
            click.option(
                "--target-freeness",
                type=float,
                default=None,
                help="Freeness a source is asked to reach (default: the low threshold).",
            ),
        ]
    ):
        function = option(function)
    return function


def scale_band_options(function: F) -> F:
    """``--scale-band LOW HIGH`` and ``--scale-sustain``, for ``shoal scheduler`` and ``shoal up``."""
    defaults = ScalingConfig()
    function = click.option(
        "--scale-sustain",
        type=float,
        default=defaults.sustain_s,
        show_default=True,
        help="Auto-scaling: seconds the average freeness must stay outside the band before acting.",
    )(function)
    return click.option(
        "--scale-band",
        type=(float, float),
        default=(defaults.min_freeness, defaults.max_freeness),
        show_default=True,
        help="Auto-scaling: scale out below the first average freeness, in above the second.",
    )(function)


def _scaling_from_options(options: dict[str, Any]) -> ScalingConfig:
    low, high = options["scale_band"]
    return ScalingConfig(
        min_freeness=low,
        max_freeness=high,
        sustain_s=options["scale_sustain"],
        min_instances=options["min_instances"],
        max_instances=options["max_instances"],
        startup_grace_s=options.get("scale_startup_grace", ScalingConfig().startup_grace_s),
    )


def policy_from_options(
    policy: str,
    low_freeness: float,
    high_freeness: float | None,
    target_freeness: float | None,
    scaling: ScalingConfig | None = None,
) -> PolicyConfig:
    dispatch = DispatchPolicy(policy)
    if dispatch.is_shoal:
        high = SHOAL_HIGH_FREENESS if high_freeness is None else high_freeness
        pairing = shoal_pairing(low_freeness, high, target_freeness)
    else:
        high = PairingConfig().high_freeness if high_freeness is None else high_freeness
        pairing = PairingConfig(
            low_freeness=low_freeness, high_freeness=high, target_freeness=target_freeness
        )
    return PolicyConfig(
        dispatch_policy=dispatch,
        pairing=pairing,
        scaling=scaling or ScalingConfig(),
    )


@click.command("scheduler")
@nats_option()
@nats_auth_options
@nats_replicas_option
@click.option("--prefix", default="shoal", show_default=True, help="Subject prefix of the cluster.")
@click.option("--id", "scheduler_id", default=None, help="Lease holder id (default: host-pid-random).")
@click.option(
    "--standby", is_flag=True, help="Start as a standby: follow the log, take over when the lease expires."
)
@policy_options
@click.option(
    "--pairing-interval", type=float, default=0.5, show_default=True, help="Seconds between pairing rounds."
)
@click.option(
    "--failure-timeout",
    type=float,
    default=3.0,
    show_default=True,
    help="Seconds without a load report before a silent instance is probed (failed unless still reporting).",
)
@click.option(
    "--failure-probe-timeout",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds a silent instance has to answer its liveness probe (0: no probe, silence decides).",
)
@click.option(
    "--lease-ttl", type=float, default=3.0, show_default=True, help="Lease time-to-live in seconds."
)
@click.option(
    "--snapshot-every", type=int, default=20_000, show_default=True, help="Snapshot every N folded events."
)
@click.option(
    "--snapshot-interval", type=float, default=10.0, show_default=True, help="... or every T seconds."
)
@click.option("--no-snapshot", is_flag=True, help="Recover by replaying the whole log (no snapshot read).")
@click.option(
    "--requeue-after-s",
    type=click.FloatRange(min=0),
    default=None,
    help="Move a queued request (no KV) off an instance whose head of line waited this long, "
    f"to where it would start at once (--policy prefill_ahead only; default {SHOAL_REQUEUE_AFTER_S} s with "
    "it, off otherwise; 0: off).",
)
@click.option(
    "--autoscale-command",
    default=None,
    help="Agent command line with {instance_id}; enables auto-scaling with local processes.",
)
@click.option("--min-instances", type=int, default=1, show_default=True)
@click.option("--max-instances", type=int, default=16, show_default=True)
@click.option("--scale-startup-grace", type=click.FloatRange(min=0), default=ScalingConfig().startup_grace_s,
              show_default=True,
              help="Auto-scaling: seconds to wait, once active, for --min-instances to join before starting "
                   "any (the agents started beside the scheduler); 0: start them at once.")
@scale_band_options
@click.option(
    "--loads-per-instance",
    type=int,
    default=StreamConfig().loads_max_msgs_per_subject,
    show_default=True,
    help="Load reports the loads stream keeps per instance (replay's window).",
)
@click.option(
    "--stats-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="On exit, write counters and per-dispatch decision times (JSON) here.",
)
@metrics_options
@click.option("--log-level", default="INFO", show_default=True)
def scheduler(**options: Any) -> None:
    """Run the global scheduler: dispatch, pairing, failure detection, scaling, snapshots."""
    logging.basicConfig(level=options["log_level"].upper(), format="%(asctime)s %(name)s %(message)s")
    scaling = _scaling_from_options(options)
    requeue = options["requeue_after_s"]
    if requeue is None:  # the default policy's own (as in the simulator)
        requeue = SHOAL_REQUEUE_AFTER_S if DispatchPolicy(options["policy"]).moves_queued else 0.0
    if requeue and not DispatchPolicy(options["policy"]).moves_queued:
        raise click.BadParameter(
            f"moving queued requests needs --policy {DispatchPolicy.PREFILL_AHEAD.value}",
            param_hint="--requeue-after-s",
        )
    config = SchedulerConfig(
        policy=policy_from_options(
            options["policy"],
            options["low_freeness"],
            options["high_freeness"],
            options["target_freeness"],
            scaling,
        ),
        scheduler_id=options["scheduler_id"] or default_scheduler_id(),
        standby=options["standby"],
        pairing_interval_s=options["pairing_interval"],
        failure_timeout_s=options["failure_timeout"],
        failure_probe_timeout_s=options["failure_probe_timeout"],
        lease_ttl_s=options["lease_ttl"],
        snapshot_every_events=options["snapshot_every"],
        snapshot_every_s=options["snapshot_interval"],
        use_snapshot=not options["no_snapshot"],
        record_decision_times=options["stats_file"] is not None,
        requeue_after_s=requeue or None,
    )
    manager: InstanceManager | None = None
    if options["autoscale_command"]:
        manager = LocalProcessManager(shlex.split(options["autoscale_command"]))
    bus_config = BusConfig(
        url=options["nats_url"],
        auth=options["nats_auth"],
        subjects=Subjects(options["prefix"]),
        name="shoal-scheduler",
        streams=StreamConfig(
            loads_max_msgs_per_subject=options["loads_per_instance"], replicas=options["nats_replicas"]
        ),
    )
    metrics = None if options["metrics_port"] is None else (options["metrics_host"], options["metrics_port"])
    provider = tracer_provider(
        TelemetryConfig.from_env(os.environ), "shoal-scheduler", instance_id=config.scheduler_id
    )
    try:
        event_loop.run(run_scheduler(
            bus_config, config, manager, stats_file=options["stats_file"], metrics=metrics,
            tracer_provider=provider,
        ))
    finally:
        if provider is not None:
            provider.shutdown()


async def run_scheduler(
    bus_config: BusConfig,
    config: SchedulerConfig,
    manager: InstanceManager | None = None,
    *,
    stats_file: Path | None = None,
    metrics: tuple[str, int] | None = None,
    tracer_provider: TracerProvider | None = None,
) -> None:
    """Connect, run the service until a signal, clean up; ``metrics``: (host, port) to serve /metrics on."""
    async with JetStreamBus(bus_config) as bus:
        service = SchedulerService(bus, config, instance_manager=manager, tracer_provider=tracer_provider)
        service.metrics.registry.register(BusCollector(lambda: bus))
        if metrics is not None:
            from prometheus_client import start_http_server

            host, port = metrics
            server, _ = start_http_server(port, addr=host, registry=service.metrics.registry)
            click.echo(f"scheduler metrics http://{host}:{server.server_port}/metrics")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, lambda: asyncio.ensure_future(service.stop()))
        try:
            await service.run()
        finally:
            if manager is not None:
                await manager.close()
            if stats_file is not None:
                stats = msgspec.to_builtins(service.stats)
                stats["appended"] = service.outbox.total_acked
                stats["append_failures"] = service.outbox.total_failed
                stats["decision_times"] = list(service.decision_times)
                stats_file.write_text(json.dumps(stats))

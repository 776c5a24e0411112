"""``shoal scheduler``: run the global scheduler (or a standby) against a NATS server.

Parses its options into one frozen :class:`SchedulerCliConfig` (which
declares them; ``--policy`` and the freeness thresholds come from
:func:`policy_options`), turns it into a
:class:`~scheduler.service.SchedulerConfig` and
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import msgspec
from opentelemetry.sdk.trace import TracerProvider

from bus import BusConfig, JetStreamBus, StreamConfig, event_loop
from bus.cli_config import CliConfig, ConfigError, click_options, from_options, nested
from bus.cli_config import option as flag
from bus.metrics import BusCollector
from bus.options import MetricsOptions, NatsOptions
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

__all__ = [
    "PolicyOptions",
    "ScaleBandOptions",
    "SchedulerCliConfig",
    "policy_from_options",
    "policy_options",
    "scheduler",
]

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
                "queue, no migration; round_robin: no migration; predicted_ttft: shoal's cost model, the "
                "least predicted time to first token counting the prompt blocks each instance caches (the "
                "prefix index) plus the decode cost of the prefill it adds, with shoal's migration rules; "
                "kv: NVIDIA Dynamo's KV router (prefill blocks + decode blocks), no migration; prefix: "
                "llm-d's scorers (prefix share, queue, KV utilisation), no migration.",
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


@dataclass(frozen=True)
class PolicyOptions:
    """The values of :func:`policy_options` (which declares their flags and defaults)."""

    policy: str = DispatchPolicy.PREFILL_AHEAD.value
    low_freeness: float = PairingConfig().low_freeness
    high_freeness: float | None = None
    target_freeness: float | None = None

    def policy_config(self, scaling: ScalingConfig | None = None) -> PolicyConfig:
        return policy_from_options(self.policy, self.low_freeness, self.high_freeness, self.target_freeness,
                                   scaling)


@dataclass(frozen=True)
class ScaleBandOptions(CliConfig):
    """The auto-scaler's band, for ``shoal scheduler`` and ``shoal up``."""

    scale_band: tuple[float, float] = flag(
        "--scale-band", default=(ScalingConfig().min_freeness, ScalingConfig().max_freeness),
        help="Auto-scaling: scale out below the first average freeness, in above the second.")
    scale_sustain: float = flag(
        "--scale-sustain", default=ScalingConfig().sustain_s, min=0,
        help="Auto-scaling: seconds the average freeness must stay outside the band before acting.")

    def validate(self) -> None:
        low, high = self.scale_band
        if not 0 <= low < high:
            raise ConfigError("scale_band", f"{low:g} {high:g}: expected 0 <= LOW < HIGH")


@dataclass(frozen=True)
class SchedulerCliConfig(CliConfig):
    """Everything ``shoal scheduler`` is told; :meth:`scheduler_config` is the service's config."""

    nats: NatsOptions = nested(NatsOptions)
    scheduler_id: str | None = flag("--id", default=None,
                                    help="Lease holder id (default: host-pid-random).")
    standby: bool = flag("--standby", default=False,
                           help="Start as a standby: follow the log, take over when the lease expires.")
    policy: PolicyOptions = nested(PolicyOptions, declared_by=policy_options)
    pairing_interval: float = flag("--pairing-interval", default=0.5, min=0, min_open=True,
                                     help="Seconds between pairing passes.")
    failure_timeout: float = flag(
        "--failure-timeout", default=3.0, min=0, min_open=True,
        help="Seconds without a load report before a silent instance is probed "
             "(failed unless still reporting).")
    failure_probe_timeout: float = flag(
        "--failure-probe-timeout", default=1.0, min=0,
        help="Seconds a silent instance has to answer its liveness probe (0: no probe, silence decides).")
    lease_ttl: float = flag("--lease-ttl", default=3.0, min=0, min_open=True,
                              help="Lease time-to-live in seconds.")
    snapshot_every: int = flag("--snapshot-every", default=20_000, min=1,
                               help="Snapshot every N folded events.")
    snapshot_interval: float = flag("--snapshot-interval", default=10.0, min=0, min_open=True,
                                      help="... or every T seconds.")
    no_snapshot: bool = flag("--no-snapshot", default=False,
                               help="Recover by replaying the whole log (no snapshot read).")
    requeue_after_s: float | None = flag(
        "--requeue-after-s", default=None, min=0,
        help="Move a queued request (no KV) off an instance whose head of line waited this long, "
        "to where it would start at once (--policy prefill_ahead only; "
        f"default {SHOAL_REQUEUE_AFTER_S} s with it, off otherwise; 0: off).")
    autoscale_command: str | None = flag(
        "--autoscale-command", default=None,
        help="Agent command line with {instance_id}; enables auto-scaling with local processes.")
    min_instances: int = flag("--min-instances", default=1, min=0)
    max_instances: int = flag("--max-instances", default=16, min=1)
    scale_startup_grace: float = flag(
        "--scale-startup-grace", default=ScalingConfig().startup_grace_s, min=0,
        help="Auto-scaling: seconds to wait, once active, for --min-instances to join before starting "
             "any (the agents started beside the scheduler); 0: start them at once.")
    scale: ScaleBandOptions = nested(ScaleBandOptions)
    loads_per_instance: int = flag(
        "--loads-per-instance", default=StreamConfig().loads_max_msgs_per_subject, min=1,
        help="Load reports the loads stream keeps per instance (replay's window).")
    stats_file: Path | None = flag(
        "--stats-file", default=None,
        help="On exit, write counters and per-dispatch decision times (JSON) here.")
    metrics: MetricsOptions = nested(MetricsOptions)
    log_level: str = flag("--log-level", default="INFO")

    def validate(self) -> None:
        if self.requeue_after_s and not DispatchPolicy(self.policy.policy).moves_queued:
            raise ConfigError("requeue_after_s",
                              f"moving queued requests needs --policy {DispatchPolicy.PREFILL_AHEAD.value}")
        if self.min_instances > self.max_instances:
            raise ConfigError("min_instances", f"{self.min_instances} is above --max-instances "
                              f"{self.max_instances}")

    @property
    def requeue_s(self) -> float | None:
        """Seconds before a stalled queued request moves (None: never): the policy's own by default."""
        requeue = self.requeue_after_s
        if requeue is None:  # the default policy's own (as in the simulator)
            requeue = SHOAL_REQUEUE_AFTER_S if DispatchPolicy(self.policy.policy).moves_queued else 0.0
        return requeue or None

    def scaling_config(self) -> ScalingConfig:
        low, high = self.scale.scale_band
        return ScalingConfig(min_freeness=low, max_freeness=high, sustain_s=self.scale.scale_sustain,
                             min_instances=self.min_instances, max_instances=self.max_instances,
                             startup_grace_s=self.scale_startup_grace)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            policy=self.policy.policy_config(self.scaling_config()),
            scheduler_id=self.scheduler_id or default_scheduler_id(),
            standby=self.standby,
            pairing_interval_s=self.pairing_interval,
            failure_timeout_s=self.failure_timeout,
            failure_probe_timeout_s=self.failure_probe_timeout,
            lease_ttl_s=self.lease_ttl,
            snapshot_every_events=self.snapshot_every,
            snapshot_every_s=self.snapshot_interval,
            use_snapshot=not self.no_snapshot,
            record_decision_times=self.stats_file is not None,
            requeue_after_s=self.requeue_s,
        )

    def bus_config(self) -> BusConfig:
        nats = self.nats
        return BusConfig(
            url=nats.nats_url, auth=nats.auth.auth, subjects=Subjects(nats.prefix), name="shoal-scheduler",
            streams=StreamConfig(loads_max_msgs_per_subject=self.loads_per_instance,
                                 replicas=nats.nats_replicas),
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
@click_options(SchedulerCliConfig)
def scheduler(**options: Any) -> None:
    """Run the global scheduler: dispatch, pairing, failure detection, scaling, snapshots."""
    cli = from_options(SchedulerCliConfig, options)
    logging.basicConfig(level=cli.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = cli.scheduler_config()
    manager: InstanceManager | None = None
    if cli.autoscale_command:
        manager = LocalProcessManager(shlex.split(cli.autoscale_command))
    metrics = cli.metrics
    endpoint = None if metrics.metrics_port is None else (metrics.metrics_host, metrics.metrics_port)
    provider = tracer_provider(
        TelemetryConfig.from_env(os.environ), "shoal-scheduler", instance_id=config.scheduler_id
    )
    try:
        event_loop.run(run_scheduler(
            cli.bus_config(), config, manager, stats_file=cli.stats_file, metrics=endpoint,
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

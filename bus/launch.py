"""Start the embedded NATS of ``shoal up``: one node or a cluster, optionally secured, streams provisioned.

:func:`start_embedded` starts :class:`bus.server.EmbeddedNats` (one node) or
:class:`bus.cluster.EmbeddedCluster` (``nodes`` > 1) with the
:class:`SecureSetup`'s users, permissions and TLS when given, and provisions
the streams and the KV bucket with ``replicas`` copies (as the admin user in
secure mode, since no component may create streams there) before any
component connects. Nothing here starts a shoal component.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from bus.auth import NatsAuth
from bus.cluster import EmbeddedCluster
from bus.event_loop import run
from bus.jetstream import JetStreamBus
from bus.protocol import BusConfig, StreamConfig
from bus.security import SecureDeployment, create_deployment
from bus.server import EmbeddedNats, free_port
from schemas.subjects import Subjects

__all__ = ["SecureSetup", "start_embedded"]


@dataclass(frozen=True)
class SecureSetup:
    """The credentials of one secured ``shoal up``: users for the components and agents ``agent-0``…."""

    deployment: SecureDeployment

    @classmethod
    def create(cls, log_dir: Path, prefix: str, num_agents: int) -> SecureSetup:
        agents = [f"agent-{index}" for index in range(num_agents)]
        return cls(create_deployment(log_dir / "nats-secure", Subjects(prefix), agents=agents))


def start_embedded(
    log_dir: Path, nodes: int, replicas: int, prefix: str, secure: SecureSetup | None
) -> tuple[EmbeddedNats | EmbeddedCluster, str]:
    """Start the server(s), provision the streams; (what to stop at the end, the clients' URL)."""
    extra = secure.deployment.server_config() if secure is not None else ""
    server: EmbeddedNats | EmbeddedCluster
    if nodes > 1:
        server = EmbeddedCluster(
            log_dir / "nats-store", size=nodes, extra_config=extra, log_dir=log_dir, die_with_parent=True
        ).start()
    else:
        server = EmbeddedNats(
            store_dir=log_dir / "nats-store",
            log_file=log_dir / "nats.log",
            die_with_parent=True,
            extra_config=extra,
            monitor_port=0 if secure else free_port(),  # /varz: message counters (shoal bench vllm-serve)
        ).start()
    try:
        config = BusConfig(
            url=server.url,
            subjects=Subjects(prefix),
            streams=StreamConfig(replicas=replicas),
            name="shoal-up",
            auth=secure.deployment.auth("admin") if secure is not None else NatsAuth(),
        )
        run(_provision(config))
    except BaseException:
        server.stop()
        raise
    return server, server.url


async def _provision(config: BusConfig) -> None:
    # asyncio warns about every TLS connection the server closes first; nothing to act on here
    quiet = logging.getLogger("asyncio")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        async with JetStreamBus(config):
            pass
    finally:
        quiet.setLevel(level)

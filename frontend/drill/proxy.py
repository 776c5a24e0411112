"""The chaos proxy: a TCP relay (asyncio, no external tool) that adds latency, blackholes or resets.

A :class:`ChaosProxy` listens on ``listen_host:listen_port`` and relays every
connection to ``upstream``. The drill's components connect through it (NATS
clients, and peers of an agent's KV transport), so the drill can, for a period:

* **latency**: deliver every chunk ``latency_s`` later than it arrived (order kept);
* **blackhole**: forward nothing in either direction and leave new connections
  unconnected upstream (packets vanish; TCP keeps what was sent, so it arrives
  when the blackhole ends, as after a real network outage that TCP outlives);
* **reset**: abort every open connection with a TCP RST (``SO_LINGER`` 0).

:class:`ProxyStats` counts what it did, so the drill verifies that a fault took
effect (chunks delayed, chunks held, connections reset) before counting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from dataclasses import dataclass, field

__all__ = ["ChaosProxy", "ProxyStats"]

_CHUNK = 65536


@dataclass
class ProxyStats:
    connections: int = 0
    bytes_forwarded: int = 0
    chunks_delayed: int = 0
    chunks_held: int = 0
    connections_held: int = 0
    connections_reset: int = 0


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class ChaosProxy:
    """A TCP relay with faults; ``async with ChaosProxy(...)`` or :meth:`start` / :meth:`close`."""

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        name: str = "proxy",
    ) -> None:
        self.upstream = upstream
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.name = name
        self.stats = ProxyStats()
        self.latency_s = 0.0
        self._open = asyncio.Event()  # set: traffic flows; clear: blackhole
        self._open.set()
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.listen_host, self.listen_port

    @property
    def blackholed(self) -> bool:
        return not self._open.is_set()

    async def start(self) -> ChaosProxy:
        self._server = await asyncio.start_server(
            self._accept, self.listen_host, self.listen_port, reuse_address=True
        )
        self.listen_port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            self._abort(link)
        if self._server is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> ChaosProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ faults

    def set_latency(self, seconds: float) -> None:
        self.latency_s = max(0.0, seconds)

    def blackhole(self, on: bool = True) -> None:
        if on:
            self._open.clear()
        else:
            self._open.set()

    def reset_all(self) -> int:
        """Abort every open connection with a RST; the number reset."""
        links = list(self._links)
        for link in links:
            self._abort(link)
        self.stats.connections_reset += len(links)
        return len(links)

    def heal(self) -> None:
        self.latency_s = 0.0
        self._open.set()

    # ------------------------------------------------------------------ relay

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        link = _Link(writer)
        self._links.add(link)
        try:
            if not self._open.is_set():
                self.stats.connections_held += 1
                await self._open.wait()
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                self._abort(link)
                return
            link.upstream = up_writer
            link.tasks = [
                asyncio.ensure_future(self._pump(reader, up_writer, link)),
                asyncio.ensure_future(self._pump(up_reader, writer, link)),
            ]
            await asyncio.gather(*link.tasks, return_exceptions=True)
        finally:
            self._links.discard(link)
            for w in (writer, link.upstream):
                if w is not None:
                    w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link) -> None:
        """Copy one direction; a queue keeps chunks in order while each waits out its delay."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.ensure_future(self._send(queue, writer))
        try:
            while True:
                try:
                    data = await reader.read(_CHUNK)
                except (ConnectionError, OSError):
                    break
                if not data:
                    break
                if self.latency_s > 0:
                    self.stats.chunks_delayed += 1
                await queue.put((time.monotonic() + self.latency_s, data))
            await queue.put((0.0, b""))
            await sender
        finally:
            sender.cancel()
            for task in link.tasks:
                task.cancel()

    async def _send(self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        while True:
            due, data = await queue.get()
            if not data:
                with contextlib.suppress(OSError, RuntimeError):
                    writer.write_eof()
                return
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not self._open.is_set():
                self.stats.chunks_held += 1
                await self._open.wait()
            try:
                writer.write(data)
                await writer.drain()
            except (ConnectionError, OSError):
                return
            self.stats.bytes_forwarded += len(data)

    def _abort(self, link: _Link) -> None:
        for w in (link.client, link.upstream):
            if w is None:
                continue
            sock = w.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()
        for task in link.tasks:
            task.cancel()

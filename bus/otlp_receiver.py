"""A small OTLP/HTTP trace receiver: ``POST /v1/traces`` decoded with OTLP's own protobuf messages.

What the exporters of :mod:`bus.telemetry` send (``http/protobuf``, gzip or
not) arrives here as an ``ExportTraceServiceRequest``; the receiver decodes
it, counts the spans (in all and by name), keeps them as
:class:`ReceivedSpan` when asked to, and answers 200 with an empty
``ExportTraceServiceResponse``. ``GET /stats`` answers the counts as JSON
(:class:`ReceiverStats`).

Two ways to run it:

* :class:`OtlpReceiver`, a server on a thread of this process (tests read
  :attr:`OtlpReceiver.spans`);
* :class:`ReceiverProcess`, ``python -m bus.otlp_receiver`` as a child process
  (``shoal bench tracing``: decoding spans then competes with shoal for the
  cores, as a collector on the same machine would, but not for this process's
  GIL), read over ``GET /stats`` with :func:`fetch_stats`.

Not here: a collector (nothing is stored or forwarded) or gRPC (the gRPC
exporter's test has its own servicer).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from bus.server import die_with_parent, free_port

__all__ = [
    "OtlpReceiver",
    "ReceivedSpan",
    "ReceiverProcess",
    "ReceiverStats",
    "decode_spans",
    "fetch_stats",
    "main",
]

TRACES_PATH = "/v1/traces"
STATS_PATH = "/stats"


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived; ``service`` is ``service.name`` plus ``/service.instance.id`` if set."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[str, ...]


class ReceiverStats(msgspec.Struct, frozen=True, kw_only=True):
    """What a receiver has taken so far: export requests, spans, request bytes, spans by name."""

    exports: int = 0
    spans: int = 0
    bytes: int = 0
    rejected: int = 0
    spans_by_name: dict[str, int] = msgspec.field(default_factory=dict)


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def decode_spans(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span of a decoded export request, with its resource's service name and instance."""
    spans: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
        service = resource.get("service.name", "")
        if resource.get("service.instance.id"):
            service += "/" + resource["service.instance.id"]
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    service=service, name=span.name,
                    trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_id=span.parent_span_id.hex(),
                    start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                    attributes={a.key: _value(a.value) for a in span.attributes},
                    events=tuple(e.name for e in span.events),
                ))
    return spans


class _State:
    """The counts (and kept spans) one receiver shares between its handler threads."""

    def __init__(self, keep_spans: bool) -> None:
        self.keep_spans = keep_spans
        self.lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.num_spans = 0
        self.bytes = 0
        self.rejected = 0
        self.by_name: Counter[str] = Counter()

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        names = [span.name for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
        kept = decode_spans(request) if self.keep_spans else []
        with self.lock:
            self.exports += 1
            self.num_spans += len(names)
            self.bytes += len(body)
            self.by_name.update(names)
            self.spans.extend(kept)

    def stats(self) -> ReceiverStats:
        with self.lock:
            return ReceiverStats(exports=self.exports, spans=self.num_spans, bytes=self.bytes,
                                 rejected=self.rejected, spans_by_name=dict(self.by_name))


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: _State) -> None:
        super().__init__(address, _Handler)
        self.state = state


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: the exporters reuse their connection

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != TRACES_PATH or self.headers.get("Content-Type") != "application/x-protobuf":
            self._reject(404 if self.path != TRACES_PATH else 415)
            return
        try:
            if self.headers.get("Content-Encoding", "").lower() == "gzip":
                body = gzip.decompress(body)
            self.server.state.take(body)
        except Exception:  # not an ExportTraceServiceRequest (protobuf's DecodeError) or bad gzip
            self._reject(400)
            return
        self._answer(200, "application/x-protobuf", ExportTraceServiceResponse().SerializeToString())

    def do_GET(self) -> None:
        if self.path != STATS_PATH:
            self._answer(404, "text/plain", b"")
            return
        self._answer(200, "application/json", msgspec.json.encode(self.server.state.stats()))

    def _reject(self, status: int) -> None:
        with self.server.state.lock:
            self.server.state.rejected += 1
        self._answer(status, "text/plain", b"")

    def _answer(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class OtlpReceiver:
    """The receiver on a thread of this process; ``with OtlpReceiver() as r:`` exporters send to ``r.url``.

    ``url`` is the base address (what ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes; the exporter adds
    ``/v1/traces``). With ``keep_spans`` every span is kept in :attr:`spans`.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, keep_spans: bool = False) -> None:
        self._state = _State(keep_spans)
        self._server = _Server((host, port), self._state)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def spans(self) -> list[ReceivedSpan]:
        """The spans kept so far (a live list; empty unless ``keep_spans``)."""
        return self._state.spans

    def stats(self) -> ReceiverStats:
        return self._state.stats()

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def fetch_stats(url: str, *, timeout: float = 5.0) -> ReceiverStats:
    """``GET /stats`` of the receiver at ``url``."""
    with urllib.request.urlopen(f"{url}{STATS_PATH}", timeout=timeout) as response:
        return msgspec.json.decode(response.read(), type=ReceiverStats)


class ReceiverProcess:
    """``python -m bus.otlp_receiver`` as a child process on a free loopback port (SIGTERM if we die)."""

    def __init__(self, log_path: Path, *, ready_timeout: float = 30.0) -> None:
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def stats(self) -> ReceiverStats:
        return fetch_stats(self.url)

    def start(self) -> ReceiverProcess:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bus.otlp_receiver", "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                self.stats()
                return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the OTLP receiver did not start; see {self.log_path}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> ReceiverProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until SIGTERM or SIGINT: ``python -m bus.otlp_receiver --port N``."""
    parser = argparse.ArgumentParser(
        prog="python -m bus.otlp_receiver", description="An OTLP/HTTP trace receiver that counts spans."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    with OtlpReceiver(host=args.host, port=args.port) as receiver:
        print(f"OTLP/HTTP receiver at {receiver.url}{TRACES_PATH}", flush=True)
        while not stop.wait(1.0):
            pass
        with contextlib.suppress(Exception):
            print(msgspec.json.encode(receiver.stats()).decode(), flush=True)


if __name__ == "__main__":
    main()

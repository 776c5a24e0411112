"""The UCX transport, through ``ucxx`` (the ``ucx`` extra: ``pip install shoal[ucx]``).

Speaks ``transport.wire``'s protocol over UCX tagged messages: control
messages as one framed tagged message each (``transport.wire``), the payload with one
``Endpoint.send``/``recv`` straight from the caller's buffer into the landing
slot. UCX picks the wire: TCP here (``ucx_tls="tcp"``), shared memory, RDMA
(InfiniBand/RoCE) or NVLink on real clusters.

CUDA tensors are handed to UCX as device memory (``__cuda_array_interface__``),
so with a UCX built with CUDA support and a NIC that has it, the payload moves
by GPUDirect RDMA without touching host memory; a CUDA ``into`` tensor is
received into directly. That path is untested here (no GPU on the machines
this was built on); without CUDA support in the UCX context, CUDA payloads are
staged through host memory as with TCP.

How ucxx is driven, and why:

* One UCX context per process and event loop (``_UcxRuntime``), shared by every
  ``UcxTransport`` in it and closed with the last one: ucxx starts progress
  for only one worker per event loop, so a second context in the same loop
  would never progress.
* Progress mode ``thread`` with Python futures (the notifier thread) and
  delayed submission: an idle receiver then costs no CPU (ucxx's default
  without futures spins the event loop with ``asyncio.sleep(0)`` while any
  receive is pending: a full core), and a control round trip takes ~0.3 ms
  (~7 ms without delayed submission).
* UCX options come from ``TransportConfig.ucx_config()`` and are handed to the
  context as a dict — nothing here reads or writes ``UCX_*`` variables
  (importing ``ucxx`` sets a few defaults of its own, e.g. ``UCX_RNDV_THRESH``).
* UCX's listener binds every interface; ``TransportConfig.host`` is what the
  address advertises. Before each new connection to a peer (connections are
  pooled, so this is rare) a plain TCP connect probes its port, so a dead
  address fails at once instead of after ``connect_timeout_s``.
* Closing a transport drops the expectations, the pooled endpoints and the
  endpoints it accepted. ucxx leaves a failed request's exception alive from
  C++; its traceback would pin the endpoint (``_forget_frames``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from transport.address import format_address, parse_host_port
from transport.base import Payload, TransferHeader
from transport.buffers import (
    checksum_of,
    device_readable,
    host_readable,
    is_device_tensor,
    payload_nbytes,
)
from transport.config import TransportConfig
from transport.errors import (
    PeerUnreachable,
    ProtocolViolation,
    TransportClosed,
    TransportError,
    TransportUnavailable,
)
from transport.pool import PeerPools, StaleConnection
from transport.receiving import Admission, ExpectationTable, TransportBase, serve_offer
from transport.wire import (
    CONTROL_SLOT_BYTES,
    Control,
    Landed,
    Offer,
    Verdict,
    expect_reply,
    frame_control,
    raise_if_refused,
    unframe_control,
)

__all__ = ["UcxTransport", "ucx_available"]

log = logging.getLogger(__name__)


def ucx_available() -> str | None:
    """None when ``ucxx`` imports; otherwise why not (for skips and the ``auto`` fallback)."""
    try:
        import ucxx  # noqa: F401
    except Exception as exc:  # ImportError, or a missing/broken libucx raising OSError
        return f"ucxx cannot be imported: {type(exc).__name__}: {exc}"
    return None


@dataclass(eq=False)
class _UcxRuntime:
    context: Any
    loop: asyncio.AbstractEventLoop
    options: dict[str, str]
    users: int = 0


_runtime: _UcxRuntime | None = None


def _acquire_runtime(config: TransportConfig) -> _UcxRuntime:
    global _runtime
    loop = asyncio.get_running_loop()
    options = config.ucx_config()
    if _runtime is not None and _runtime.loop is loop and _runtime.options == options:
        _runtime.users += 1
        return _runtime
    if _runtime is not None and _runtime.users > 0:
        raise TransportError(
            f"a UCX transport with options {_runtime.options} is open in this process; "
            f"another with {options} (or in another event loop) cannot run beside it"
        )
    if _runtime is not None:
        _close_runtime(_runtime)
        _runtime = None
    reason = ucx_available()
    if reason is not None:
        raise TransportUnavailable(reason)
    from ucxx._lib_async import ApplicationContext

    try:
        context = ApplicationContext(
            options,
            progress_mode="thread",
            enable_delayed_submission=True,
            enable_python_future=True,
            connect_timeout=config.connect_timeout_s,
        )
    except Exception as exc:
        raise TransportUnavailable(f"UCX failed to initialise: {type(exc).__name__}: {exc}") from exc
    runtime = _UcxRuntime(context=context, loop=loop, options=options, users=1)
    if not context.worker.enable_python_future:
        _close_runtime(runtime)
        raise TransportUnavailable("this ucxx build lacks Python-future notification (UCXX_ENABLE_PYTHON)")
    _runtime = runtime
    return runtime


def _release_runtime(runtime: _UcxRuntime) -> None:
    global _runtime
    runtime.users -= 1
    if runtime.users == 0 and _runtime is runtime:
        _close_runtime(runtime)
        _runtime = None


def _close_runtime(runtime: _UcxRuntime) -> None:
    """Stop the notifier and progress threads now (a plain stop waits out a 1 s poll)."""
    context = runtime.context
    if context.notifier_thread_q is not None:
        context.notifier_thread_q.put("shutdown")
        context.worker.stop_request_notifier_thread()
    context.stop_notifier_thread()
    context.clear_progress_tasks()


async def _send_control(endpoint: Any, message: Control) -> None:
    await endpoint.send(frame_control(message))


async def _recv_control(endpoint: Any) -> Control:
    slot = bytearray(CONTROL_SLOT_BYTES)
    await endpoint.recv(slot)
    return unframe_control(slot)


class UcxTransport(TransportBase):
    """A ``KVTransport`` over UCX."""

    kind = "ucx"

    def __init__(self, config: TransportConfig | None = None) -> None:
        self._config = config or TransportConfig(kind="ucx")
        self._table = ExpectationTable()
        self._runtime: _UcxRuntime | None = None
        self._listener: Any = None
        self._address = ""
        self._pools: PeerPools[Any] = PeerPools(
            max_per_peer=self._config.max_connections_per_peer,
            connect=self._connect,
            discard=_abort,
            scheme="ucx",
        )
        self._serving: set[Any] = set()

    # -- lifecycle -------------------------------------------------------------------

    @property
    def address(self) -> str:
        if not self._address:
            raise TransportClosed("ucx transport is not started")
        return self._address

    async def start(self) -> str:
        if self._address:
            return self._address
        runtime = _acquire_runtime(self._config)
        try:
            self._listener = runtime.context.create_listener(
                self._serve,
                port=self._config.port,
                connect_timeout=self._config.connect_timeout_s,
            )
        except Exception as exc:
            _forget_frames(exc)
            _release_runtime(runtime)
            raise TransportError(f"UCX cannot listen on port {self._config.port}: {exc}") from exc
        self._runtime = runtime
        self._address = format_address("ucx", self._config.advertised_host, int(self._listener.port))
        return self._address

    async def close(self) -> None:
        if self._runtime is None:
            return
        self._address = ""
        self._table.close()
        listener, self._listener = self._listener, None
        listener.close()  # the object must outlive its running handlers (ucxx warns otherwise)
        await self._pools.close()
        for endpoint in list(self._serving):
            await _abort(endpoint)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                while self._serving or listener.active_clients:
                    await asyncio.sleep(0.001)
        del listener
        # ucxx's listener sits in a reference cycle: only a collection unbinds its port (and
        # stops it accepting connections it can no longer serve).
        gc.collect()
        runtime, self._runtime = self._runtime, None
        _release_runtime(runtime)

    # -- receive side ------------------------------------------------------------------

    async def _serve(self, endpoint: Any) -> None:
        """The listener's callback: serve transfers on one incoming endpoint until it closes."""
        from ucxx.exceptions import UCXError

        self._serving.add(endpoint)
        try:
            while self._address:
                try:
                    message = await _recv_control(endpoint)
                except UCXError as exc:
                    _forget_frames(exc)
                    return  # the sender closed between transfers, or we are closing
                if not isinstance(message, Offer):
                    raise ProtocolViolation(f"expected an offer, got {type(message).__name__}")
                await self._serve_one(endpoint, message)
        except (UCXError, ProtocolViolation) as exc:
            log.debug("ucx transfer endpoint dropped: %r", exc)
            _forget_frames(exc)
        finally:
            self._serving.discard(endpoint)
            if not endpoint.closed:
                await endpoint.close()

    async def _serve_one(self, endpoint: Any, offer: Offer) -> None:
        reply = functools.partial(_send_control, endpoint)
        await serve_offer(self._table, offer, reply, functools.partial(self._receive_payload, endpoint))

    async def _receive_payload(self, endpoint: Any, admission: Admission) -> int | None:
        landing = admission.landing
        if landing.nbytes == 0:
            return None
        if landing.device is not None and self._cuda_capable():
            await endpoint.recv(landing.device)
            return None
        target, finish = landing.host_target()
        await endpoint.recv(target)
        finish()
        return checksum_of(target) if admission.header.checksum is not None else None

    def _cuda_capable(self) -> bool:
        return self._runtime is not None and bool(self._runtime.context.context.cuda_support)

    # -- send side -----------------------------------------------------------------------

    async def send(
        self, address: str, header: TransferHeader, payload: Payload, *, timeout: float | None = None
    ) -> None:
        if not self._address:
            raise TransportClosed("ucx transport is not started")
        peer = parse_host_port(address, "ucx")
        size = payload_nbytes(payload)
        if size != header.nbytes:
            raise ValueError(f"header says {header.nbytes} bytes, payload has {size}")
        if is_device_tensor(payload) and self._cuda_capable():
            buffer: Any = device_readable(payload)
        else:
            buffer = host_readable(payload)
            if self._config.checksum and header.checksum is None:
                header = msgspec.structs.replace(header, checksum=checksum_of(buffer))
        limit = self._config.send_timeout_s if timeout is None else timeout
        sending = self._pools.run(
            peer,
            lambda endpoint, reused: _transfer(endpoint, header, buffer, reused=reused),
            keep=self._is_open,
        )
        await self._send_counted(address, size, limit, sending)

    def _is_open(self) -> bool:
        return bool(self._address)

    async def _connect(self, peer: tuple[str, int]) -> Any:
        host, port = peer
        assert self._runtime is not None
        await _probe(host, port, self._config.connect_timeout_s)
        try:
            async with asyncio.timeout(self._config.connect_timeout_s + 1.0):
                return await self._runtime.context.create_endpoint(
                    host, port, connect_timeout=self._config.connect_timeout_s
                )
        except Exception as exc:  # ucxx raises UCXError subclasses and TimeoutError here
            _forget_frames(exc)
            raise PeerUnreachable(
                f"cannot connect to ucx://{host}:{port}: {type(exc).__name__}: {exc}"
            ) from exc


async def _transfer(endpoint: Any, header: TransferHeader, buffer: Any, *, reused: bool) -> None:
    from ucxx.exceptions import UCXError

    try:
        await _send_control(endpoint, Offer(header=header))
        verdict = expect_reply(await _recv_control(endpoint), Verdict)
    except UCXError as exc:
        _forget_frames(exc)
        if reused:
            raise StaleConnection from exc
        raise PeerUnreachable(f"endpoint lost before the offer was answered: {exc}") from exc
    raise_if_refused(verdict)
    try:
        if header.nbytes:
            await endpoint.send(buffer)
        landed = expect_reply(await _recv_control(endpoint), Landed)
    except UCXError as exc:
        _forget_frames(exc)
        raise PeerUnreachable(f"endpoint lost during the transfer: {exc}") from exc
    raise_if_refused(landed)


async def _probe(host: str, port: int, timeout: float) -> None:
    """Fail fast on a dead address: UCX itself only notices after its connect timeout."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except TimeoutError as exc:
        raise PeerUnreachable(f"connecting to ucx://{host}:{port} timed out") from exc
    except OSError as exc:
        raise PeerUnreachable(f"cannot connect to ucx://{host}:{port}: {exc}") from exc
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def _forget_frames(error: BaseException) -> None:
    """Drop a caught ucxx error's traceback.

    ucxx keeps the failed request's future (and so this exception) alive from C++, where
    the garbage collector cannot see it; its traceback's frames hold the ``Endpoint`` (and
    its UCX resources), which would then live as long as the process.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


async def _abort(endpoint: Any) -> None:
    with contextlib.suppress(Exception):
        await endpoint.close()

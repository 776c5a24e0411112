"""The in-process transport: agents in one process (tests, the demo cluster).

Endpoints register under a name in a process-wide registry and are reached
at ``inproc://<name>``. A send is judged by the receiver's expectation table
exactly as over a wire, then the payload's bytes are *copied* into the landing
slot (the sender may reuse its buffer afterwards, as with a real transport);
a torch tensor landing on a tensor is copied with ``Tensor.copy_`` (device to
device where both are on CUDA). All in the caller's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec

from transport.address import parse_inproc_name
from transport.base import Payload, RejectReason, TransferHeader
from transport.buffers import (
    Landing,
    checksum_of,
    device_readable,
    host_readable,
    is_device_tensor,
    is_tensor,
    payload_nbytes,
)
from transport.config import TransportConfig
from transport.errors import PeerUnreachable, TransferRejected, TransportClosed, TransportError
from transport.receiving import ExpectationTable, TransportBase

__all__ = ["InprocTransport"]

_registry: dict[str, InprocTransport] = {}
_names = itertools.count(1)


class InprocTransport(TransportBase):
    """A ``KVTransport`` whose peers live in the same process."""

    kind = "inproc"

    def __init__(self, config: TransportConfig | None = None) -> None:
        self._config = config or TransportConfig(kind="inproc")
        self._table = ExpectationTable()
        self._name = ""

    @property
    def address(self) -> str:
        if not self._name:
            raise TransportClosed("inproc transport is not started")
        return f"inproc://{self._name}"

    async def start(self) -> str:
        if self._name:
            return self.address
        name = self._config.inproc_name or f"endpoint-{next(_names)}"
        if name in _registry:
            raise TransportError(f"inproc endpoint {name!r} already exists")
        _registry[name] = self
        self._name = name
        return self.address

    async def close(self) -> None:
        if self._name and _registry.get(self._name) is self:
            del _registry[self._name]
        self._name = ""
        self._table.close()

    async def send(
        self, address: str, header: TransferHeader, payload: Payload, *, timeout: float | None = None
    ) -> None:
        if not self._name:
            raise TransportClosed("inproc transport is not started")
        size = payload_nbytes(payload)
        if size != header.nbytes:
            raise ValueError(f"header says {header.nbytes} bytes, payload has {size}")
        peer = _registry.get(parse_inproc_name(address))
        if peer is None:
            raise PeerUnreachable(f"no inproc endpoint at {address}")
        if self._config.checksum and header.checksum is None and not is_device_tensor(payload):
            header = msgspec.structs.replace(header, checksum=checksum_of(host_readable(payload)))
        await asyncio.sleep(0)  # a send is a suspension point, as it is on a wire
        try:
            peer._receive(header, payload)
        except TransferRejected:
            self._table.count_send_rejected()
            raise
        self._table.count_sent(size)

    def _receive(self, header: TransferHeader, payload: Payload) -> None:
        admission = self._table.admit(header)
        if isinstance(admission, RejectReason):
            raise TransferRejected(admission.value)
        landing = admission.landing
        _copy_into(landing, payload)
        checksum = None
        if header.checksum is not None and landing.host is not None:
            checksum = checksum_of(landing.host)
        refusal = self._table.land(admission, checksum=checksum)
        if refusal is not None:
            raise TransferRejected(refusal.value)


def _copy_into(landing: Landing, payload: Any) -> None:
    if landing.device is not None and is_tensor(payload):
        landing.device.copy_(device_readable(payload))
        return
    target, finish = landing.host_target()
    target[:] = host_readable(payload)
    finish()

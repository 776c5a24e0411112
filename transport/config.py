"""The frozen configuration of the KV data plane, passed in by the entry point.

Nothing in ``transport/`` reads the environment. UCX options travel in
``ucx_tls`` and ``ucx_options`` and are handed to the UCX context directly
(``ucxx`` takes them as a config dict), so no ``UCX_*`` variable needs setting.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["TransportConfig", "TransportKind"]

TransportKind = Literal["auto", "ucx", "tcp", "inproc"]


class TransportConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How an agent moves KV buffers.

    * ``kind``: ``auto`` tries UCX and falls back to TCP (with a warning in the log)
      when ``ucxx`` is missing or UCX fails to initialise.
    * ``host``/``port``: where to listen (``port=0``: any free port). The UCX listener
      binds every interface (ucxx offers no bind address).
    * ``advertise_host``: the host peers are told to connect to (:attr:`advertised_host`);
      blank: ``host`` (set it when binding ``0.0.0.0`` or behind NAT).
    * ``inproc_name``: the endpoint name of an in-process transport (blank: generated).
    * ``connect_timeout_s``: opening a connection to a peer; ``send_timeout_s``: one whole
      transfer (offer, payload, landing), unless ``send(timeout=...)`` says otherwise.
    * ``max_connections_per_peer``: concurrent transfers to one peer each use their own
      pooled connection, up to this many.
    * ``checksum``: senders attach a CRC-32 of host payloads; receivers verify it.
    * ``ucx_tls``: UCX's transport list (``UCX_TLS``), e.g. ``"tcp"`` to force TCP, or blank
      for UCX's own choice (shared memory, RDMA, CUDA IPC/GPUDirect where present).
    * ``ucx_options``: further UCX options as ``(name, value)`` pairs without the ``UCX_``
      prefix, e.g. ``(("RNDV_THRESH", "8192"),)``.
    """

    kind: TransportKind = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    inproc_name: str = ""
    connect_timeout_s: float = 2.0
    send_timeout_s: float = 60.0
    max_connections_per_peer: int = 4
    checksum: bool = False
    ucx_tls: str = ""
    ucx_options: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("auto", "ucx", "tcp", "inproc"):
            raise ValueError(f"unknown transport kind {self.kind!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if self.connect_timeout_s <= 0 or self.send_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_connections_per_peer < 1:
            raise ValueError("max_connections_per_peer must be >= 1")

    @property
    def advertised_host(self) -> str:
        """The host in the address peers use: ``advertise_host``, else the bind ``host``."""
        return self.advertise_host or self.host

    def ucx_config(self) -> dict[str, str]:
        """The options handed to the UCX context."""
        # CM_REUSEADDR: a restarted agent can listen on its port again at once (UCX's
        # listener otherwise leaves the port blocked by TIME_WAIT for a minute).
        options = {"WARN_UNUSED_ENV_VARS": "n", "CM_REUSEADDR": "y"}
        if self.ucx_tls:
            options["TLS"] = self.ucx_tls
        options.update(dict(self.ucx_options))
        return options

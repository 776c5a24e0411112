"""Transport addresses: ``tcp://host:port``, ``ucx://host:port``, ``inproc://name``.

Agents advertise the address their transport listens on (``InstanceJoined.transport_address``)
and peers send to it; the scheme says which transport can reach it. Pure.
"""

from __future__ import annotations

from transport.errors import InvalidAddress

__all__ = ["format_address", "parse_host_port", "parse_inproc_name", "scheme_of"]


def scheme_of(address: str) -> str:
    scheme, sep, _ = address.partition("://")
    if not sep:
        raise InvalidAddress(f"not a transport address (no scheme): {address!r}")
    return scheme


def format_address(scheme: str, host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def parse_host_port(address: str, scheme: str) -> tuple[str, int]:
    """``scheme://host:port`` → ``(host, port)``; ``InvalidAddress`` on anything else."""
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise InvalidAddress(f"{address!r} is not a {scheme}:// address")
    rest = address[len(prefix) :]
    host, sep, port_text = rest.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise InvalidAddress(f"{address!r} lacks host:port")
    port = int(port_text)
    if not 0 < port <= 65535:
        raise InvalidAddress(f"{address!r} has a port out of range")
    return host.strip("[]"), port


def parse_inproc_name(address: str) -> str:
    prefix = "inproc://"
    if not address.startswith(prefix) or len(address) == len(prefix):
        raise InvalidAddress(f"{address!r} is not an inproc:// address")
    return address[len(prefix) :]

"""The seam between nats-py and the bus: translating nats-py's exceptions.

Every nats-py exception that can escape a bus call passes through
:func:`translate` (or :func:`translated`, for an awaitable), which returns the
matching :mod:`bus.errors` class; callers raise it ``from`` the original so the
cause stays visible. Used by :mod:`bus.jetstream` and :mod:`bus.ordered`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import nats.errors
import nats.js.errors

from bus.errors import BusError, InvalidName, NoResponders, NotConnected, RequestTimeout, StreamNotFound

__all__ = ["translate", "translated"]

R = TypeVar("R")


def translate(exc: BaseException, what: str) -> BusError:
    """The bus error for a nats-py exception raised while doing ``what``."""
    if isinstance(exc, BusError):
        return exc
    if isinstance(exc, nats.js.errors.NotFoundError):
        return StreamNotFound(f"{what}: not found ({exc})")
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return StreamNotFound(f"{what}: no stream answered ({exc})")
    if isinstance(exc, nats.errors.NoRespondersError):
        return NoResponders(f"{what}: no responders")
    if isinstance(exc, nats.errors.TimeoutError | asyncio.TimeoutError):
        return RequestTimeout(f"{what}: timed out")
    if isinstance(exc, nats.errors.ConnectionClosedError | nats.errors.OutboundBufferLimitError | OSError):
        return NotConnected(f"{what}: {exc!r}")
    if isinstance(exc, nats.errors.BadSubjectError | nats.js.errors.InvalidKeyError):
        return InvalidName(f"{what}: {exc!r}")
    return BusError(f"{what}: {exc!r}")


async def translated(call: Awaitable[R], what: str) -> R:
    """Await a nats-py call, translating its errors at the seam."""
    try:
        return await call
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        raise translate(exc, what) from exc

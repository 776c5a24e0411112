"""Helpers shared by the bus tests (not fixtures)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, TypeVar

from bus import BusConfig, StreamConfig
from bus.protocol import MessageFeed
from schemas import Subjects

T = TypeVar("T")


def short_config(url: str, subjects: Subjects, **changes: Any) -> BusConfig:
    """A config with short timeouts, so failure paths are quick."""
    base = BusConfig(
        url=url,
        subjects=subjects,
        streams=StreamConfig(events_max_age=3600.0, loads_max_age=3600.0, loads_max_msgs_per_subject=100),
        ack_timeout=0.5,
        append_timeout=10.0,
        heartbeat=0.5,
        reconnect_time_wait=0.05,
        api_timeout=3.0,
    )
    return replace(base, **changes)


async def collect(feed: MessageFeed[T]) -> list[T]:
    """Everything a finite feed yields, closing it afterwards."""
    async with feed:
        return [item async for item in feed]


async def take(feed: MessageFeed[T], count: int, *, timeout: float = 5.0) -> list[T]:
    """The next ``count`` items of a live feed, failing the test if they do not come in time."""
    items: list[T] = []
    async with asyncio.timeout(timeout):
        while len(items) < count:
            items.append(await anext(feed))
    return items

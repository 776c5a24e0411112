"""The processes' event loop: uvloop (a dependency on Linux) when installed."""

from __future__ import annotations

import asyncio
import sys

import pytest

from bus import event_loop


async def _running_loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is not a dependency on Windows")
def test_run_uses_uvloop_where_it_is_installed() -> None:
    assert event_loop.loop_name() == "uvloop"
    assert event_loop.run(_running_loop_module()).startswith("uvloop")

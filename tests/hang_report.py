"""A test about to hit its timeout logs what every asyncio task is waiting on.

pytest-timeout's report shows the threads' stacks, and in an async test the main thread is always
in the event loop's ``select``: nothing says which await never returned. At four fifths of a
test's timeout this plugin asks the test session's loop (all async tests share it) to log its
tasks, those being cancelled first, the rest grouped by where they wait. The log is part of the
failed test's report, so a hang seen once in CI can be read from its output.
"""

from __future__ import annotations

import asyncio
import collections
import io
import logging
import threading
from collections.abc import AsyncIterator, Generator

import pytest

log = logging.getLogger("tests.hang")

#: The share of a test's timeout after which its tasks are logged.
REPORT_AT = 0.8

_loop: asyncio.AbstractEventLoop | None = None


@pytest.fixture(scope="session", autouse=True)
async def _session_loop() -> AsyncIterator[None]:
    global _loop
    _loop = asyncio.get_running_loop()
    yield
    _loop = None


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 0)


def _where(task: asyncio.Task[object]) -> str:
    frames = task.get_stack()
    if not frames:
        return "(not started)"
    frame = frames[-1]
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def tasks_report(loop: asyncio.AbstractEventLoop) -> str:
    """Tasks being cancelled in full (a cancel that did not end its task is the usual hang), then
    every other task counted by the line it waits on."""
    tasks = asyncio.all_tasks(loop)
    out = io.StringIO()
    cancelling = [task for task in tasks if task.cancelling()]
    for task in cancelling:
        print(f"-- cancelling: {task.get_name()} {task.get_coro()}", file=out)
        task.print_stack(file=out)
    waiting = collections.Counter(_where(task) for task in tasks if not task.cancelling())
    for where, count in waiting.most_common():
        print(f"{count:4d} x {where}", file=out)
    return f"{len(tasks)} asyncio tasks, {len(cancelling)} being cancelled:\n{out.getvalue()}"


def _report(nodeid: str) -> None:
    if _loop is not None:
        log.error("%s is near its timeout; %s", nodeid, tasks_report(_loop))


def _ask_loop(loop: asyncio.AbstractEventLoop, nodeid: str) -> None:
    try:
        loop.call_soon_threadsafe(_report, nodeid)
    except RuntimeError:  # the loop was closed meanwhile
        pass


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    limit, loop = _timeout_of(item), _loop
    timer = None
    if limit > 0 and loop is not None:
        timer = threading.Timer(limit * REPORT_AT, _ask_loop, args=(loop, item.nodeid))
        timer.daemon = True
        timer.start()
    try:
        return (yield)
    finally:
        if timer is not None:
            timer.cancel()

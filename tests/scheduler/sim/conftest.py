"""Fixtures of the simulator's tests."""

from __future__ import annotations

import pytest

from tests.scheduler.sim import overloaded
from tests.scheduler.sim.overloaded import PaperRun


@pytest.fixture(scope="session")
def overloaded_paper_run() -> PaperRun:
    """:func:`tests.scheduler.sim.overloaded.overloaded_paper_run`, made once per test session."""
    return overloaded.overloaded_paper_run()

"""Progress lines for ``shoal bench …``: what a benchmark is doing, as it goes, on stderr.

A benchmark names its phases up front when it can (``total``) and announces each
as it starts; every line carries the elapsed time and, once a phase has finished,
an estimate of the time left. The lines go to stderr, so a table or JSON printed
on stdout stays clean to pipe.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.text import Text

__all__ = ["BenchProgress"]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


class BenchProgress:
    """One status line per phase of a benchmark, on stderr.

    ``phase(text)`` starts the next of ``total`` phases (``total`` may be unknown);
    ``note(text)`` reports within a phase without counting one.
    """

    def __init__(
        self,
        name: str,
        total: int | None = None,
        *,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.total = total
        self.done = 0
        self._console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self._clock = clock
        self._started = clock()

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._started

    def phase(self, text: str) -> None:
        """Announce the next phase (the one before it counts as finished)."""
        elapsed = self.elapsed_s
        position = f"{self.done + 1}" if self.total is None else f"{self.done + 1}/{self.total}"
        left = ""
        if self.total is not None and self.done > 0:
            left = f", ~{_clock(elapsed / self.done * (self.total - self.done))} left"
        self.done += 1
        self._line(f"[{position} {_clock(elapsed)}{left}]", text)

    def note(self, text: str) -> None:
        """Report something within the current phase."""
        self._line(f"[{_clock(self.elapsed_s)}]", text)

    def finish(self, text: str = "done") -> None:
        """The last line: the benchmark has measured everything."""
        self._line(f"[{_clock(self.elapsed_s)}]", text)

    def _line(self, stamp: str, text: str) -> None:
        self._console.print(Text.assemble((f"bench {self.name} {stamp}", "dim"), " ", text))

"""Recorded chat sessions: a trace of multi-turn sessions the simulator replays closed-loop.

``shoal bench prefix --policies`` writes one of its live run (``*.jsonl``, or ``*.jsonl.gz``
read through gzip); ``shoal simulate --trace FILE`` replays it. One JSON object per turn::

    {"round": 0, "session": "r0-g1-s2", "turn": 1, "start_s": 0.0, "think_s": 0.84,
     "input_length": 1412, "output_length": 32, "block_tokens": 16, "hash_ids": [0, 1, 2, ...]}

* a session's first turn (``turn`` 0) arrives ``start_s`` seconds into the trace; each later turn
  arrives ``think_s`` after the previous turn's last token (closed loop, as the client sent it);
* ``hash_ids`` name the prompt's full blocks of ``block_tokens`` tokens, in order: equal ids are
  equal blocks holding equal prefixes (the ids number the live prompts' chained block hashes), so
  the simulator's prefix cache finds exactly what the live prompts shared; the tokens after the
  last full block are the turn's own;
* the prompt holds nothing of the previous turn but what its ``hash_ids`` say (a live client
  re-encodes the previous answer's text, which need not give back the generated token ids).

Rounds are laid end to end by their ``start_s``. What lives here is reading, writing and turning
the rows into a :class:`~scheduler.sim.workload.Workload`; the live side that records them is
:mod:`frontend.bench_prefix`.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import msgspec

from scheduler.sim.prompts import trace_block_segments
from scheduler.sim.workload import SimRequest, Workload

__all__ = [
    "SessionTurn",
    "is_session_trace",
    "read_session_trace",
    "session_trace_workload",
]

#: The keys that tell a sessions trace from the other JSON-lines traces (Mooncake's).
_KEYS = ("session", "turn", "hash_ids", "block_tokens")


class SessionTurn(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of a recorded session (see the module docstring)."""

    round: int
    session: str
    turn: int
    start_s: float
    think_s: float
    input_length: int
    output_length: int
    block_tokens: int
    hash_ids: tuple[int, ...]

    @property
    def request_id(self) -> str:
        return f"{self.session}.{self.turn:02d}"


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def is_session_trace(path: Path) -> bool:
    """Whether ``path`` is a sessions trace (its first line an object with a session's keys)."""
    if not path.is_file():
        return False
    try:
        with _open_text(path) as handle:
            first = handle.readline()
        row = json.loads(first)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(row, dict) and all(key in row for key in _KEYS)


def read_session_trace(path: Path) -> list[SessionTurn]:
    """The turns of a sessions trace; a line that is not a turn, or a session whose turns are not
    numbered 0, 1, 2, ... in order, is an error naming its line."""
    decoder = msgspec.json.Decoder(SessionTurn)
    turns: list[SessionTurn] = []
    last: dict[tuple[int, str], int] = {}
    with _open_text(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                turn = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}, line {number}: not a session turn ({exc})") from exc
            key = (turn.round, turn.session)
            if turn.turn != last.get(key, -1) + 1:
                raise ValueError(
                    f"{path}, line {number}: turn {turn.turn} of session {turn.session} follows turn "
                    f"{last.get(key, -1)}"
                )
            if turn.input_length < 1 or turn.output_length < 1 or turn.block_tokens < 1:
                raise ValueError(f"{path}, line {number}: lengths and block_tokens must be >= 1")
            if len(turn.hash_ids) * turn.block_tokens > turn.input_length:
                raise ValueError(f"{path}, line {number}: hash_ids cover more than input_length tokens")
            if turn.start_s < 0 or turn.think_s < 0:
                raise ValueError(f"{path}, line {number}: start_s and think_s must be >= 0")
            last[key] = turn.turn
            turns.append(turn)
    if not turns:
        raise ValueError(f"{path}: empty trace")
    return turns


def session_trace_workload(
    turns: Sequence[SessionTurn], *, name: str = "sessions", rounds: frozenset[int] | None = None
) -> Workload:
    """The turns as a closed-loop workload (``rounds``: a set of rounds to keep; None: all).

    A first turn arrives at its ``start_s``; a later one ``follows`` the turn before it and
    arrives its ``think_s`` after that turn's last token, its prompt its blocks alone.
    """
    kept = [t for t in turns if rounds is None or t.round in rounds]
    if not kept:
        raise ValueError(f"{name}: no turns in rounds {sorted(rounds or ())}")
    previous: dict[tuple[int, str], str] = {}
    requests: list[SimRequest] = []
    opening = {(t.round, t.session): t.start_s for t in kept if t.turn == 0}
    by_start = sorted(
        kept, key=lambda t: (t.round, opening.get((t.round, t.session), 0.0), t.session, t.turn)
    )
    for turn in by_start:
        key = (turn.round, turn.session)
        follows = previous.get(key, "") if turn.turn else ""
        requests.append(
            SimRequest(
                request_id=f"r{turn.round}:{turn.request_id}",
                arrival_s=turn.start_s,
                num_prompt_tokens=turn.input_length,
                num_output_tokens=turn.output_length,
                segments=trace_block_segments(turn.hash_ids, turn.block_tokens),
                follows=follows,
                think_s=turn.think_s if follows else 0.0,
                context_tokens=0,
            )
        )
        previous[key] = requests[-1].request_id
    sessions = {(t.round, t.session) for t in kept}
    block_tokens = sorted({t.block_tokens for t in kept})
    description = (
        f"sessions trace {name}: {len(sessions)} sessions, {len(requests)} turns, "
        f"{len({t.round for t in kept})} rounds, blocks of {'/'.join(map(str, block_tokens))} tokens "
        "(closed loop)"
    )
    return Workload(requests=tuple(requests), description=description)

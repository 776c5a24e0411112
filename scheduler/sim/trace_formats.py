"""The request-trace files the simulator reads, recognised by their columns (or keys).

* ``shoal``: CSV ``arrival_s,input_tokens,output_tokens``, arrivals in seconds (the traces
  shoal ships).
* ``azure``: CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``, arrivals as dates and times (the
  Azure LLM inference traces of 2023 and 2024, as published).
* ``burstgpt``: CSV ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``,
  arrivals in seconds (BurstGPT).
* ``mooncake``: JSON lines ``{"timestamp", "input_length", "output_length", "hash_ids"}``,
  arrivals in milliseconds (Mooncake's traces, as aiperf and Dynamo's tools read them). Each
  hash id names one 512-token block of the prompt (:attr:`TraceFormat.block_tokens`); equal
  ids are equal blocks, kept per row in :attr:`TraceFile.blocks`.

Other columns are ignored (BurstGPT's model and log type). A file whose name ends in ``.gz`` is
read through gzip. Arrivals are returned in seconds, rows sorted by arrival. A row with
no prompt or no output tokens (BurstGPT's failed requests have 0 response
tokens) is dropped and counted; a row that cannot be read is an error naming
its line.
"""

from __future__ import annotations

import csv
import gzip
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["TRACE_FORMATS", "TraceFile", "TraceFormat", "read_trace"]


@dataclass(frozen=True, slots=True)
class TraceFormat:
    """One trace format: the fields it needs, how an arrival reads, and whom results credit."""

    name: str
    arrival: str
    prompt: str
    output: str
    #: an arrival field's text or value -> seconds (on the format's own clock)
    seconds: Callable[[Any], float]
    credit: str = ""
    #: the field naming the prompt's blocks (equal names, equal tokens), "" if the format has none
    blocks: str = ""
    #: prompt tokens per named block
    block_tokens: int = 0

    @property
    def fields(self) -> tuple[str, str, str]:
        return (self.arrival, self.prompt, self.output)


def _date_seconds(value: Any) -> float:
    return datetime.fromisoformat(str(value).strip()).timestamp()


TRACE_FORMATS: tuple[TraceFormat, ...] = (
    TraceFormat("shoal", "arrival_s", "input_tokens", "output_tokens", float),
    TraceFormat(
        "azure", "TIMESTAMP", "ContextTokens", "GeneratedTokens", _date_seconds,
        credit="Trace: Azure LLM inference trace, Microsoft Azure Public Dataset (CC-BY 4.0).",
    ),
    TraceFormat(
        "burstgpt", "Timestamp", "Request tokens", "Response tokens", float,
        credit='Trace: BurstGPT (Wang et al., "BurstGPT: A Real-world Workload Dataset to Optimize LLM '
        'Serving Systems", arXiv:2401.17644).',
    ),
    TraceFormat(
        "mooncake", "timestamp", "input_length", "output_length", lambda ms: float(ms) / 1000.0,
        credit='Trace: Mooncake (Qin et al., "Mooncake: Trading More Storage for Less Computation - '
        'A KVCache-centric Architecture for Serving LLM Chatbot", FAST 2025; Apache-2.0).',
        blocks="hash_ids", block_tokens=512,
    ),
)


@dataclass(frozen=True, slots=True)
class TraceFile:
    """A trace's usable rows ``(arrival_s, prompt_tokens, output_tokens)``, by arrival."""

    format: TraceFormat
    rows: list[tuple[float, int, int]]
    #: rows dropped for having no prompt or no output tokens
    num_dropped: int
    #: per row, the ids of its prompt's blocks of ``format.block_tokens`` tokens (formats with blocks)
    blocks: list[tuple[int, ...]] = field(default_factory=list)


def _format_of(path: Path, fields: set[str]) -> TraceFormat:
    for known in TRACE_FORMATS:
        if set(known.fields) <= fields:
            return known
    accepted = "; ".join(f"{f.name}: {', '.join(f.fields)}" for f in TRACE_FORMATS)
    raise ValueError(f"{path}: not a trace shoal reads (fields {sorted(fields)}); it reads {accepted}")


def _json_lines(path: Path, handle: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {number}: not JSON ({exc})") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{path}, line {number}: expected a JSON object")
        yield number, row


def _block_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"block ids must be a list of integers, got {str(value)[:60]}")
    return tuple(value)


def _open(path: Path) -> Any:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", newline="", encoding="utf-8-sig")
    return path.open(newline="", encoding="utf-8-sig")


def read_trace(path: Path) -> TraceFile:
    """Read ``path`` in whichever format its header (CSV) or first object (JSON lines) names."""
    with _open(path) as handle:
        first = handle.readline()
        handle.seek(0)
        records: Iterable[tuple[int, dict[str, Any]]]
        if first.lstrip().startswith("{"):
            records = list(_json_lines(path, handle))
            if not records:
                raise ValueError(f"{path}: empty trace")
            trace_format = _format_of(path, set(records[0][1]))
        else:
            reader = csv.DictReader(handle)
            reader.fieldnames = [name.strip() for name in reader.fieldnames or ()]
            trace_format = _format_of(path, set(reader.fieldnames))
            records = ((reader.line_num, row) for row in reader)
        rows: list[tuple[float, int, int, tuple[int, ...]]] = []
        dropped = 0
        arrival, prompt, output = trace_format.fields
        blocks = trace_format.blocks
        for number, row in records:
            try:
                at = trace_format.seconds(row[arrival])
                num_prompt, num_output = int(row[prompt]), int(row[output])
                block_ids = _block_ids(row[blocks]) if blocks else ()
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(
                    f"{path}, line {number}: cannot read a {trace_format.name} row ({exc!r})"
                ) from exc
            if num_prompt <= 0 or num_output <= 0:
                dropped += 1
                continue
            rows.append((at, num_prompt, num_output, block_ids))
    rows.sort(key=lambda r: r[0])
    return TraceFile(
        trace_format, [r[:3] for r in rows], dropped,
        blocks=[r[3] for r in rows] if blocks else [],
    )

"""``shoal bench prefix``'s sessions mode: the clusters it compares (the prefix cache on and off, or
one dispatch policy each), the rounds of sessions run on each in turn, the sessions trace the
simulator replays, and the report."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import click

from bus.bench_progress import BenchProgress
from bus.server import die_with_parent, free_port
from frontend.bench_prefix_report import (
    combine_rounds,
    compare_prediction,
    fmt_ms,
    fmt_rate,
    paired_ratios,
    paired_to_reference,
    plot_results,
    results_table,
    scrape_cache_counters,
)
from frontend.bench_prefix_sessions import (
    Session,
    TurnRecord,
    Workload,
    build_sessions,
    chat_messages,
    run_sessions,
    summarize,
)
from frontend.bench_vllm_serve import Server
from frontend.up import _health

__all__ = [
    "CACHE_SIDES",
    "SIDES",
    "TRACE_ROUND_GAP_S",
    "Sides",
    "agent_metrics_urls",
    "policy_sides",
    "rotation",
    "run_side",
    "sessions_mode",
    "spawn_server",
    "trace_turns",
    "up_command",
    "wait_instances",
]

_SHOAL = [sys.executable, "-c", "from frontend.cli import main; main()"]
#: the two sides of a sessions run: the engines' prefix cache on, and off (``--no-prefix-cache``)
SIDES = ("on", "off")


# ---------------------------------------------------------------------------------------- the servers


def up_command(
    engine: str,
    model: str,
    instances: int,
    port: int,
    log_dir: Path,
    *,
    prefix_cache: bool,
    threads: int = 1,
    policy: str | None = None,
) -> list[str]:
    """``shoal up`` of one side: ``--no-prefix-cache`` where ``prefix_cache`` is False, ``--policy``
    where ``policy`` is given."""
    return [
        *_SHOAL,
        "up",
        "--engine",
        engine,
        "--model",
        model,
        "--instances",
        str(instances),
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--log-dir",
        str(log_dir),
        "--ready-timeout",
        "600",
        *([] if prefix_cache else ["--no-prefix-cache"]),
        *([] if policy is None else ["--policy", policy]),
    ]


_AGENT_METRICS = re.compile(r"^agent\s+\S+\s+pid \d+\s+metrics (http://\S+)", re.MULTILINE)


def agent_metrics_urls(up_output: str) -> list[str]:
    """The agents' ``/metrics`` URLs that ``shoal up`` printed."""
    return _AGENT_METRICS.findall(up_output)


def spawn_server(kind: str, command: list[str], url: str, log_path: Path) -> Server:
    log: IO[bytes] = open(log_path, "ab")
    try:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    finally:
        log.close()
    return Server(kind, process, url, log_path)


def wait_instances(server: Server, instances: int, timeout_s: float) -> None:
    """Until ``server``'s frontend lists ``instances`` ready instances; a ClickException if it dies first."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = _health(server.url)
        if health is not None and len(health.get("instances") or ()) >= instances:
            return
        if server.process.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(server.log_path.read_text(errors="replace").splitlines()[-20:])
            raise click.ClickException(f"shoal up ({server.kind}) did not start ({server.log_path}):\n{tail}")
        time.sleep(0.5)


def _check_no_prefix_cache_option() -> None:
    """``shoal up --no-prefix-cache`` exists (the side without the cache needs it)."""
    from frontend.up import up

    names = {opt for param in up.params for opt in (*param.opts, *param.secondary_opts)}
    if "--no-prefix-cache" not in names:
        raise click.ClickException(
            "this shoal up has no --no-prefix-cache: the side without the cache cannot run"
        )


@dataclass(frozen=True)
class Sides:
    """What a sessions run compares: its sides' names and each side's ``shoal up``."""

    #: the sides, the first the reference of the paired ratios
    names: tuple[str, ...]
    #: policies compared (all with the cache on); empty: the cache on against off
    policies: tuple[str, ...] = ()

    def command(
        self, side: str, engine: str, model: str, instances: int, port: int, log_dir: Path, threads: int
    ) -> list[str]:
        if self.policies:
            return up_command(
                engine, model, instances, port, log_dir, prefix_cache=True, threads=threads, policy=side
            )
        return up_command(engine, model, instances, port, log_dir, prefix_cache=side == "on", threads=threads)

    def order(self, round_index: int) -> tuple[str, ...]:
        """Round ``round_index``'s order: the sides rotated by one each round (alternating for two)."""
        shift = round_index % len(self.names)
        return self.names[shift:] + self.names[:shift]

    @property
    def label(self) -> str:
        return "policy" if self.policies else "cache"


CACHE_SIDES = Sides(SIDES)


def policy_sides(text: str) -> Sides:
    """The sides of ``--policies``: the ``shoal up --policy`` values given, in order, no repeats."""
    from scheduler.config import DISPATCH_MENU

    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    offered = [p.value for p in DISPATCH_MENU]
    unknown = [n for n in names if n not in offered]
    if not names or unknown:
        raise click.BadParameter(f"unknown policies {unknown}; shoal up --policy offers {', '.join(offered)}")
    return Sides(names, policies=names)


def rotation(names: Sequence[str], round_index: int) -> tuple[str, ...]:
    """The sides' order in round ``round_index`` (see :meth:`Sides.order`)."""
    return Sides(tuple(names)).order(round_index)


@contextlib.contextmanager
def _clusters(
    sides: Sides, engine: str, model: str, instances: int, threads: int, log_dir: Path, ready_timeout_s: float
) -> Iterator[dict[str, Server]]:
    """Every side's ``shoal up`` at once (started together, ready together), stopped at the end."""
    servers: dict[str, Server] = {}
    try:
        for side in sides.names:
            port = free_port()
            name = re.sub(r"[^\w.-]", "_", side)
            command = sides.command(side, engine, model, instances, port, log_dir / f"up-{name}", threads)
            servers[side] = spawn_server(
                side, command, f"http://127.0.0.1:{port}", log_dir / f"up-{name}.log"
            )
        for server in servers.values():
            wait_instances(server, instances, ready_timeout_s)
        yield servers
    finally:
        for server in servers.values():
            server.stop(grace_s=30.0)


# ---------------------------------------------------------------------------------------- sessions mode


def run_side(
    server: Server, model: str, sessions: Sequence[Session], workload: Workload, timeout_s: float
) -> tuple[list[TurnRecord], dict[str, Any]]:
    """One side's run of ``sessions``: its records and :func:`summarize` (with the hit rate from the
    agents' counters where the answers do not say)."""
    from bus import event_loop

    urls = agent_metrics_urls(server.log_path.read_text(errors="replace"))
    before = scrape_cache_counters(urls) if urls else None
    records = event_loop.run(run_sessions(server.url, model, sessions, workload, timeout_s))
    summary = summarize(records)
    summary["hit_rate_source"] = "usage" if summary["hit_rate"] is not None else None
    after = scrape_cache_counters(urls) if urls else None
    if before is not None and after is not None:
        delta = after - before
        summary["agent_prefix_cache"] = {
            "queries": delta.queries,
            "hits": delta.hits,
            "hit_rate": delta.hit_rate,
        }
        if summary["hit_rate"] is None and delta.hit_rate is not None:
            summary["hit_rate"], summary["hit_rate_source"] = delta.hit_rate, "agents' /metrics"
    return records, summary


def _post_json(url: str, body: Mapping[str, Any], timeout_s: float = 30.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def trace_turns(
    server: Server,
    model: str,
    sessions: Sequence[Session],
    records: Sequence[TurnRecord],
    round_index: int,
    round_start_s: float,
    block_size: int,
) -> list[dict[str, Any]]:
    """The answered turns of one round as sessions-trace rows (``chain``: the prompt's block hashes,
    from its token ids as the frontend renders the chat); a session ends at its first failed turn."""
    from schemas.block_hash import block_hashes

    by_name = {s.name: s for s in sessions}
    answers: dict[str, list[str]] = {}
    rows = []
    for record in sorted(records, key=lambda r: (r.session, r.turn)):
        session = by_name[record.session]
        done = answers.setdefault(record.session, [])
        if record.error or len(done) != record.turn:
            continue
        body = {"model": model, "messages": chat_messages(session, done)}
        tokens = _post_json(f"{server.url}/tokenize", body)["tokens"]
        done.append(record.answer)
        rows.append(
            {
                "round": round_index,
                "session": session.name,
                "turn": record.turn,
                "start_s": round(round_start_s + session.start_s, 4),
                "think_s": round(session.think_s[record.turn - 1], 4) if record.turn else 0.0,
                "input_length": len(tokens),
                "output_length": record.completion_tokens,
                "block_tokens": block_size,
                "chain": block_hashes(tokens, block_size),
            }
        )
    return rows


#: Seconds between the rounds' starts in a sessions trace (far more than a round lasts).
TRACE_ROUND_GAP_S = 1000.0


def sessions_mode(
    log_dir: Path,
    engine: str,
    model: str,
    instances: int,
    threads: int,
    workload: Workload,
    rounds: int,
    ready_timeout: float,
    run_timeout: float,
    json_path: Path | None,
    png_path: Path | None,
    sides: Sides,
    trace_path: Path | None,
    sim_profile: Path | None,
) -> None:
    from rich.console import Console

    if not sides.policies:
        _check_no_prefix_cache_option()
    predicting = bool(sides.policies) and engine == "torch"
    progress = BenchProgress("prefix", 1 + len(sides.names) * rounds + (3 if predicting else 0))
    profiles: dict[str, Path] = {} if sim_profile is None else {"given": sim_profile}
    if predicting and sim_profile is None:
        from agents.engines.profile import dump_profile
        from frontend.bench_prefix_sim import measure_torch_profile

        # alone: one agent's steps on an idle machine; shared: beside instances - 1 busy neighbours,
        # as when every agent of a cluster computes at once
        for name, neighbours in (("alone", 0), ("shared", instances - 1)):
            progress.phase(
                f"measuring the torch engine's profile of {model}, {name} ({neighbours} neighbours)"
            )
            profiles[name] = log_dir / f"profile-{name}.json"
            profile = measure_torch_profile(model, threads=threads, echo=progress.note, neighbours=neighbours)
            dump_profile(profile, profiles[name])
    what = f"policies {', '.join(sides.names)}" if sides.policies else "cache on and off"
    progress.phase(
        f"starting {len(sides.names)} clusters ({instances} {engine} agents of {model} each; {what})"
    )
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides.names}
    turns: dict[str, list[dict[str, Any]]] = {side: [] for side in sides.names}
    records_by_side: dict[str, list[TurnRecord]] = {side: [] for side in sides.names}
    trace_rows: list[dict[str, Any]] = []
    block_size = 16
    for path in profiles.values():
        block_size = int(json.loads(path.read_text())["block_size"])
    with _clusters(sides, engine, model, instances, threads, log_dir, ready_timeout) as servers:
        for round_index in range(rounds):
            sessions = build_sessions(workload, round_index)
            order = sides.order(round_index)
            for side in order:
                progress.phase(
                    f"round {round_index + 1}/{rounds}: {len(sessions)} sessions of {workload.turns} "
                    f"turns, {sides.label} {side}"
                )
                load_before = os.getloadavg()[0]
                records, summary = run_side(servers[side], model, sessions, workload, run_timeout)
                summary["load_before"], summary["load_after"] = load_before, os.getloadavg()[0]
                summary["first"] = side == order[0]
                runs[side].append(summary)
                records_by_side[side].extend(records)
                failed = next((r for r in records if r.error), None)
                if failed is not None:
                    progress.note(
                        f"{sides.label} {side}: {failed.session} turn {failed.turn + 1} failed: "
                        f"{failed.error}"
                    )
                turns[side].extend({"round": round_index, **asdict(r)} for r in records)
                if predicting and side == sides.names[0]:
                    trace_rows += trace_turns(
                        servers[side],
                        model,
                        sessions,
                        records,
                        round_index,
                        round_index * TRACE_ROUND_GAP_S,
                        block_size,
                    )
                progress.note(
                    f"{sides.label} {side}: TTFT p50 {summary['ttft_p50_ms']:.0f} ms, p99 "
                    f"{summary['ttft_p99_ms']:.0f} ms, hit rate {fmt_rate(summary['hit_rate'])}, "
                    f"{summary['errors']} errors"
                )
    results: dict[str, Any] = {side: combine_rounds(runs[side]) for side in sides.names}
    for side in sides.names:
        pooled = summarize(records_by_side[side])
        results[side]["pooled"] = {
            key: pooled[key] for key in ("ttft_p50_ms", "ttft_p99_ms", "hit_rate", "requests", "errors")
        }
    if sides.policies:
        results["paired"] = paired_to_reference(runs, sides.names)
        prompts = {
            side: {(t["round"], t["session"], t["turn"]): t["prompt_tokens"] for t in turns[side]}
            for side in sides.names
        }
        reference = prompts[sides.names[0]]
        same = sum(all(prompts[side].get(key) == n for side in sides.names) for key, n in reference.items())
        results["prompts_alike"] = same / len(reference) if reference else None
    else:
        results["paired"] = paired_ratios(runs["on"], runs["off"])
    Console(width=120).print(results_table(sides.names, results, policies=bool(sides.policies)))
    if sides.policies:
        for side, paired in results["paired"].items():
            click.echo(
                f"{side} over {sides.names[0]} (median of {rounds} paired rounds): TTFT p50 "
                f"{paired['ttft_p50_ratio']:.2f}x, p99 {paired['ttft_p99_ratio']:.2f}x"
            )
    else:
        paired = results["paired"]
        click.echo(
            f"TTFT without the cache over with it (median of {rounds} paired rounds): p50 "
            f"{paired['ttft_p50_ratio']:.2f}x, p99 {paired['ttft_p99_ratio']:.2f}x, later turns p50 "
            f"{paired['ttft_p50_later_turns_ratio']:.2f}x"
        )
    source = results[sides.names[0]].get("hit_rate_source")
    if source is None:
        click.echo(
            "hit rate: neither the answers' usage nor the agents' /metrics say how many tokens were cached"
        )
    prediction: dict[str, Any] | None = None
    if predicting and profiles and trace_rows:
        from frontend.bench_prefix_sim import predict, write_trace

        trace_file = trace_path or log_dir / "sessions-trace.jsonl.gz"
        write_trace(trace_rows, trace_file)
        click.echo(f"wrote the sessions trace {trace_file} ({len(trace_rows)} turns)")
        progress.phase("the simulator's prediction: shoal simulate --trace of the sessions, per policy")
        prediction = {"trace": str(trace_file), "profiles": {}, "predicted": {}, "comparison": {}}
        for name, path in profiles.items():
            prediction["profiles"][name] = {"path": str(path), "content": json.loads(path.read_text())}
        # each profile on hardware of its own per instance, and the first on this machine's cores
        first = next(iter(profiles))
        cores = os.cpu_count() or 1
        runs_of: list[tuple[str, Path, int | None]] = [(name, path, None) for name, path in profiles.items()]
        runs_of.append((f"{first}-on-{cores}-cores", profiles[first], cores))
        prediction["cores"] = cores
        for name, path, shared_cores in runs_of:
            work_dir = log_dir / f"sim-{len(prediction['predicted'])}"
            work_dir.mkdir(parents=True, exist_ok=True)
            predicted = predict(trace_file, path, sides.names, instances, work_dir, run_timeout, shared_cores)
            prediction["predicted"][name] = predicted
            prediction["comparison"][name] = compare_prediction(results, predicted)
            for policy, row in prediction["comparison"][name].items():
                ratio = row["ttft_p50_predicted_over_live"]
                click.echo(
                    f"{policy}: TTFT p50 live {fmt_ms(row['live_ttft_p50_ms'])} ms, simulated ({name}) "
                    f"{fmt_ms(row['predicted_ttft_p50_ms'])} ms "
                    f"({'-' if ratio is None else f'{ratio:.2f}x'}); hit rate live "
                    f"{fmt_rate(row['live_hit_rate'])}, simulated {fmt_rate(row['predicted_hit_rate'])}"
                )
            for policy, sim in predicted.items():
                if "error" in sim:
                    click.echo(f"{policy}: shoal simulate failed: {sim['error']}")
    progress.finish()
    meta = {
        "mode": "policies" if sides.policies else "sessions",
        "engine": engine,
        "model": model,
        "instances": instances,
        "threads": threads,
        "rounds": rounds,
        "sides": list(sides.names),
        "workload": asdict(workload),
        "cpus": os.cpu_count(),
        "load_average_end": os.getloadavg(),
        "commands": {
            side: sides.command(side, engine, model, instances, 0, Path("LOG"), threads)[3:]
            for side in sides.names
        },
    }
    document: dict[str, Any] = {"meta": meta, "results": results, "runs": runs}
    if prediction is not None:
        document["prediction"] = prediction
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(document, indent=2))
        click.echo(f"wrote {json_path}")
    (log_dir / "turns.json").write_text(json.dumps(turns))
    if png_path is not None:
        plot_results(sides.names, results, png_path, policies=bool(sides.policies))
        click.echo(f"wrote {png_path}")

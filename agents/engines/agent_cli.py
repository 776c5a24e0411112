"""The ``shoal agent`` command line as one frozen config: :class:`AgentCliConfig`.

Its fields are the command's options (:mod:`bus.cli_config`): ``shoal agent``
parses into it, and whatever starts agents (``shoal up``, the scheduler's
auto-scaler through ``shoal up``, the drills, the benchmarks) builds one and
renders it with :func:`~bus.cli_config.to_argv`. It lives in the engine layer,
not beside :mod:`agents.cli`, because those launchers sit above the engines
but beside the agent; it is plain data and imports nothing but the bus's
option machinery. :mod:`agents.cli` turns it into the engine, the
:class:`~agents.config.AgentConfig`, the migration and transport configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bus.cli_config import CliConfig, ConfigError, nested, option
from bus.options import MetricsOptions, NatsOptions

__all__ = ["ENGINE_NAMES", "AgentCliConfig", "EngineName", "FaultOptions"]

EngineName = Literal["torch", "sim", "vllm"]
ENGINE_NAMES: tuple[EngineName, ...] = ("torch", "sim", "vllm")


@dataclass(frozen=True)
class FaultOptions(CliConfig):
    """Fault injection for drills and tests (the agent's :class:`~agents.config.FaultPlan`)."""

    fault_copy_delay: float = option(
        "--fault-copy-delay", default=0.0, min=0, show_default=True,
        help="Fault injection: sleep this long before each stage's KV copy (source side).")
    fault_min_step: float = option(
        "--fault-min-step", default=0.0, min=0, show_default=True,
        help="Fault injection: each engine step lasts at least this long (s), however fast the engine.")
    fault_drop: tuple[str, ...] = option(
        "--fault-drop", default=(), metavar="DIRECTION:TYPE",
        help="Fault injection: lose handshake messages, e.g. out:Commit or in:Ack (repeatable).")
    fault_duplicate: tuple[str, ...] = option(
        "--fault-duplicate", default=(), metavar="DIRECTION:TYPE",
        help="Fault injection: repeat handshake messages, e.g. out:PreAllocate (repeatable).")
    fault_max: int | None = option(
        "--fault-max", default=None, min=0,
        help="Fault injection: affect at most this many messages of each kind.")
    fault_first_step: Literal["raise", "exit"] | None = option(
        "--fault-first-step", default=None,
        help="Fault injection: the engine's first step (the warm-up's, before the agent announces "
             "itself) raises (the agent exits 1 and is never ready) or kills the process with SIGILL "
             "(exit -4), as an engine that cannot compute on this machine.")

    def validate(self) -> None:
        for name in ("fault_drop", "fault_duplicate"):
            for value in getattr(self, name):
                direction, _, kind = value.partition(":")
                if direction not in ("in", "out") or not kind:
                    raise ConfigError(name, f"{value!r}: expected in:TYPE or out:TYPE")

    def messages(self, what: Literal["drop", "duplicate"], direction: Literal["in", "out"]) -> frozenset[str]:
        """The message types to ``what`` (drop or duplicate) in ``direction``."""
        values = self.fault_drop if what == "drop" else self.fault_duplicate
        return frozenset(kind for d, _, kind in (v.partition(":") for v in values) if d == direction)


@dataclass(frozen=True)
class AgentCliConfig(CliConfig):
    """Everything ``shoal agent`` is told: its cluster, its engine, KV transport, migration, drain, faults."""

    nats: NatsOptions = nested(NatsOptions)
    instance_id: str | None = option("--instance-id", default=None,
                                     help="Instance id (default: agent-<random>).")
    engine: EngineName = option("--engine", default="torch")
    model: str = option("--model", default="tiny", help="torch: preset name or HF checkpoint folder.")
    profile: str = option("--profile", default="tiny-test", help="sim: timing profile.")
    time_scale: float = option("--time-scale", default=1.0, min=0, min_open=True,
                               help="sim: step time multiplier.")
    num_blocks: int | None = option("--num-blocks", default=None, min=1,
                                    help="KV blocks (default: engine's choice).")
    kv_cache_bytes: int | None = option(
        "--kv-cache-bytes", default=None, min=1,
        help="KV budget instead of --num-blocks (vllm on CPU: 1 GiB unless VLLM_CPU_KVCACHE_SPACE).")
    block_size: int | None = option("--block-size", default=None, min=1,
                                    help="KV block size [default: torch 16, vllm 32].")
    max_batch_size: int = option("--max-batch-size", default=256, min=1)
    max_step_tokens: int = option(
        "--max-step-tokens", default=2048, min=0,
        help="torch: tokens per step; a longer prompt is prefilled in chunks (0: in one step).")
    max_model_len: int | None = option("--max-model-len", default=None, min=1)
    seed: int = option("--seed", default=0)
    device: str = option("--device", default="cpu")
    dtype: str | None = option(
        "--dtype", default=None,
        help="Model dtype (auto, float32, bfloat16, float16) [torch: float32 on CPU, bfloat16 on "
             "CUDA]; agents of different dtypes are never paired and refuse to migrate to each other.")
    gpu_memory_utilization: float | None = option("--gpu-memory-utilization", default=None, min=0, max=1,
                                                  min_open=True, help="vllm: GPU memory share.")
    tensor_parallel_size: int | None = option("--tensor-parallel-size", default=None, min=1,
                                              help="vllm: TP degree (1 with migration).")
    threads: int = option("--threads", default=1, min=1, help="torch.set_num_threads (CPU).")
    prefix_cache: bool = option(
        "--prefix-cache", secondary="--no-prefix-cache", default=True, show_default=True,
        envvar="SHOAL_PREFIX_CACHE",
        help="Automatic prefix caching: a prompt's full KV blocks computed before (by any request "
             "here) are reused, not computed again; cached blocks nobody uses count as free and are "
             "evicted least recently used first (sim, torch, vllm).")
    engine_core: Literal["thread", "process"] = option(
        "--engine-core", default="thread",
        help="torch: where the model step computes: in the agent's process, or in a child process "
             "of its own (KV pool in /dev/shm) so the agent's bus work runs beside the step (CPU).")
    cpu_bind: str | None = option(
        "--cpu-bind", default=None, metavar="auto|nobind|CPUS",
        help="vllm on CPU: the model thread's CPUs, one OpenMP thread each (e.g. 0-2) [default: "
             "VLLM_CPU_OMP_THREADS_BIND, else auto: one CPU per core, all but the last, as vLLM].")
    transport_kind: Literal["auto", "ucx", "tcp"] = option(
        "--transport", default="auto", help="KV data plane; auto tries UCX then TCP.")
    transport_host: str = option("--transport-host", default="127.0.0.1",
                                 help="Bind host of the KV transport.")
    transport_advertise: str = option("--transport-advertise", default="", metavar="HOST",
                                      help="Host peers use for KV transfers (default: --transport-host).")
    transport_port: int = option("--transport-port", default=0, min=0, max=65535, show_default=True)
    ucx_tls: str = option("--ucx-tls", default="", help="UCX transport list, e.g. 'tcp'.")
    report_interval: float = option("--report-interval", default=0.1, min=0, min_open=True, help="Seconds.")
    heartbeat_interval: float = option("--heartbeat-interval", default=1.0, min=0, min_open=True,
                                       help="Seconds.")
    last_stage_max_blocks: int = option("--last-stage-max-blocks", default=2, min=0)
    max_stages: int = option("--max-stages", default=8, min=1)
    max_concurrent_migrations: int = option("--max-concurrent-migrations", default=1, min=1)
    migration_copy_timeout: float = option(
        "--migration-copy-timeout", default=30.0, min=0, min_open=True,
        help="Seconds one stage's KV copy may take before the migration aborts.")
    migration_copy_share: float = option(
        "--migration-copy-share", default=0.0, min=0, max=1, show_default=True,
        help="Pace stage copies to this share of an engine step (0.1: co-located decoding slows by "
             "about a tenth, the copy takes ~10x longer; a source that is draining or short of "
             "memory copies at full speed, and a paced copy hurries once its source runs short "
             "or another migration wants its slot); 0: copy at full speed.")
    migration_idle_timeout: float = option(
        "--migration-idle-timeout", default=60.0, min=0, min_open=True,
        help="Seconds a destination keeps a reservation it hears nothing about (> copy timeout).")
    orphan_check_interval: float = option(
        "--orphan-check-interval", default=2.0, min=0,
        help="Seconds between probes for a listener of each request's tokens; a request nobody "
             "listens to twice in a row (its frontend died) is aborted. 0: never.")
    drain_on_term: bool = option(
        "--drain-on-term", secondary="--no-drain-on-term", default=True, show_default=True,
        help="SIGTERM drains (migrate requests away, then leave) instead of stopping at once.")
    drain_timeout: float = option("--drain-timeout", default=120.0, min=0,
                                  help="Seconds a SIGTERM drain may take before the agent stops anyway.")
    faults: FaultOptions = nested(FaultOptions)
    otlp_endpoint: str | None = option(
        "--otlp-endpoint", default=None,
        help="OTLP endpoint for spans (default: OTEL_EXPORTER_OTLP_ENDPOINT; unset: no tracing).")
    ready_file: Path | None = option(
        "--ready-file", default=None,
        help="Write {instance_id, transport_address, metrics_url} (JSON) here once serving.")
    metrics: MetricsOptions = nested(MetricsOptions)
    log_level: str = option("--log-level", default="INFO")

    def validate(self) -> None:
        if self.instance_id is not None and (
            not self.instance_id or any(c in self.instance_id for c in ".*> \t\r\n")
        ):
            raise ConfigError("instance_id", f"{self.instance_id!r}: no dots, wildcards or spaces")

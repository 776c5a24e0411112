"""Frozen configuration of the HTTP frontend, built once at the entry point.

:class:`FrontendConfig` says how to reach the bus, which model is served (and
so which tokenizer the frontend loads), the limits that protect the cluster
(concurrent requests, request size, ``max_tokens`` cap) and the timeouts of
dispatch, generate, gap repair and stall detection that drive bypass and
rescue, how long a rescue may look for an instance before the request
fails, the block size of the prompt hash chains sent for prefix-aware dispatch, and
the parser that finds tool calls in the model's text.
Nothing here reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bus.auth import NatsAuth
from frontend.tools import PARSERS

__all__ = ["FrontendConfig"]


@dataclass(frozen=True)
class FrontendConfig:
    """Everything the frontend reads. Times are seconds.

    ``model`` is a torch preset name (byte tokenizer), a checkpoint folder
    (its ``tokenizer.json``), or ``sim:<profile>`` (byte tokenizer with the
    profile's vocabulary). ``served_model_name`` is what clients put in
    ``model``; the default is ``model`` itself. ``api_keys`` empty means no
    authentication. ``max_model_len`` is used until an instance announces its own.
    """

    nats_url: str = "nats://127.0.0.1:4222"
    nats_auth: NatsAuth = field(default_factory=NatsAuth)
    nats_replicas: int = 1
    prefix: str = "shoal"
    model: str = "tiny"
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_model_len: int = 2048
    max_tokens_cap: int | None = None
    default_max_tokens: int | None = None
    max_concurrent_requests: int = 1024
    max_request_bytes: int = 4 * 1024 * 1024
    max_stop_strings: int = 16
    dispatch_policy: str = "prefill_ahead"
    dispatch_timeout: float = 0.5
    scheduler_backoff: float = 2.0
    generate_timeout: float = 2.0
    generate_retries: int = 2
    max_placement_attempts: int = 4
    gap_grace: float = 0.25
    stall_timeout: float = 30.0
    rescue_timeout: float = 30.0
    instance_stale_after: float = 3.0
    retry_after_s: int = 1
    request_deadline: float | None = None
    #: where a supervisor writes the components it left down (``/health`` reads it); None: no supervisor
    supervisor_status: Path | None = None
    extra_model_names: tuple[str, ...] = field(default_factory=tuple)
    #: block size of the prompt's block-hash chain each dispatch carries (the scheduler's prefix
    #: index); None: the block size the instances announce; 0: no chain
    prefix_block_size: int | None = None
    #: how long a stored Responses API response (``store: true``) can be retrieved or continued
    #: (``previous_response_id``): the TTL of the JetStream key-value bucket that holds them
    responses_ttl_s: float = 7 * 24 * 3600.0
    #: how ``tool_choice: auto`` finds tool calls in the model's text (``--tool-call-parser``: hermes,
    #: llama3_json, mistral); None: auto is refused (400 naming tool_choice), as vLLM refuses it
    #: without ``--enable-auto-tool-choice``; required, named and none work either way
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        for name in ("dispatch_timeout", "scheduler_backoff", "generate_timeout", "gap_grace",
                     "stall_timeout", "rescue_timeout", "instance_stale_after", "responses_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_concurrent_requests < 1 or self.max_model_len < 1:
            raise ValueError("max_concurrent_requests and max_model_len must be >= 1")
        if self.max_placement_attempts < 1:
            raise ValueError("max_placement_attempts must be >= 1")
        if self.generate_retries < 0:
            raise ValueError("generate_retries must be >= 0")
        if self.prefix_block_size is not None and self.prefix_block_size < 0:
            raise ValueError("prefix_block_size must be >= 0 (0: no chain)")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(PARSERS))}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.extra_model_names)

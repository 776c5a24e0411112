"""``shoal serve``: run the OpenAI-compatible HTTP frontend (uvicorn) against a NATS cluster.

Parses its options into one frozen :class:`ServeCliConfig` (which declares
them), turns it into a frozen :class:`~frontend.config.FrontendConfig`, builds
the app with :func:`frontend.app.create_app` (its lifespan connects to NATS and
runs the gateway) and serves it until SIGINT/SIGTERM. Tracing follows the
standard ``OTEL_*`` variables (:mod:`bus.telemetry`), read here and nowhere below.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from bus.cli_config import CliConfig, click_options, from_options, nested, option
from bus.options import NatsOptions
from bus.telemetry import TelemetryConfig, tracer_provider
from frontend.api_keys import read_key_file
from frontend.config import FrontendConfig
from frontend.tools import PARSERS

__all__ = ["ServeCliConfig", "config_from_options", "serve"]


def _api_keys(keys: Sequence[str], key_file: Path | None) -> tuple[str, ...]:
    """``--api-key`` values and the keys in ``--api-key-file`` (a bad file: a usage error)."""
    found = tuple(keys)
    if key_file is not None:
        try:
            found += read_key_file(key_file)
        except (OSError, ValueError) as exc:
            raise click.BadParameter(str(exc), param_hint="--api-key-file") from None
    return found


@dataclass(frozen=True)
class ServeCliConfig(CliConfig):
    """Everything ``shoal serve`` is told; :func:`config_from_options` makes the frontend's config of it."""

    nats: NatsOptions = nested(NatsOptions)
    model: str = option("--model", default="tiny",
                        help="Tokenizer: torch preset, checkpoint folder, or sim:<profile>.")
    served_model_name: str | None = option("--served-model-name", default=None,
                                           help="Name clients use (default: --model).")
    host: str = option("--host", default="127.0.0.1")
    port: int = option("--port", default=8000, min=0, max=65535, help="HTTP port.")
    api_key: tuple[str, ...] = option(
        "--api-key", default=(), envvar="SHOAL_API_KEY", secret=True,
        help="Require this Bearer key (repeatable; prefer the variable or --api-key-file).")
    api_key_file: Path | None = option(
        "--api-key-file", default=None, envvar="SHOAL_API_KEY_FILE",
        type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Bearer keys, one per line.")
    max_model_len: int = option("--max-model-len", default=2048, min=1,
                                help="Context length until an instance announces its own.")
    max_tokens_cap: int | None = option("--max-tokens-cap", default=None, min=1,
                                        help="Clamp every request's max_tokens.")
    max_concurrent_requests: int = option("--max-concurrent-requests", default=1024, min=1,
                                          help="In flight before answering 429.")
    max_request_bytes: int = option("--max-request-bytes", default=4 * 1024 * 1024, min=1)
    dispatch_policy: str = option("--dispatch-policy", default="prefill_ahead",
                                  help="Bypass-mode dispatch policy.")
    dispatch_timeout: float = option(
        "--dispatch-timeout", default=0.5, min=0, min_open=True,
        help="Seconds to wait for the scheduler before placing by itself (bypass).")
    generate_timeout: float = option(
        "--generate-timeout", default=2.0, min=0, min_open=True,
        help="Seconds an agent has to answer a generate before it is asked again.")
    generate_retries: int = option(
        "--generate-retries", default=2, min=0,
        help="Times an agent that does not answer a generate is asked again (generate is idempotent) "
             "before the request is placed elsewhere and the agent told to drop it.")
    stall_timeout: float = option("--stall-timeout", default=30.0, min=0, min_open=True,
                                  help="Seconds without a token before a request is rescued elsewhere.")
    rescue_timeout: float = option(
        "--rescue-timeout", default=30.0, min=0, min_open=True,
        help="Seconds a request whose instance failed may wait for another instance to take it; "
             "past that it fails with 503 (an SSE error event when streaming).")
    instance_stale_after: float = option(
        "--instance-stale-after", default=3.0, min=0, min_open=True,
        help="Seconds without a load report before an instance counts as dead.")
    request_deadline: float | None = option("--request-deadline", default=None, min=0, min_open=True,
                                            help="End requests running longer (seconds).")
    supervisor_status: Path | None = option(
        "--supervisor-status", default=None, type=click.Path(dir_okay=False, path_type=Path),
        help="A JSON file where a supervisor (shoal up) writes the components it left down and why: "
             "/health reports them.")
    prefix_block_size: int | None = option(
        "--prefix-block-size", default=None, min=0, metavar="TOKENS",
        help="Block size of the prompt hash chain each dispatch carries for prefix-aware placement "
             "(default: the block size the instances announce; 0: send none).")
    responses_ttl: float = option(
        "--responses-ttl", default=7 * 24 * 3600.0, min=0, min_open=True, metavar="SECONDS",
        help="How long a stored Responses API response can be retrieved or continued (the TTL of "
             "the <prefix>_responses key-value bucket).")
    tool_call_parser: str | None = option(
        "--tool-call-parser", default=None, type=click.Choice(sorted(PARSERS)),
        help="How tool_choice auto finds tool calls in the model's text (the model family's format, as "
             "vLLM's flag); without it, auto is refused (required, a named function and none work).")
    log_level: str = option("--log-level", default="warning")

    def frontend_config(self) -> FrontendConfig:
        """The frontend's config (the API keys read from ``--api-key-file`` now: a usage error if bad)."""
        nats = self.nats
        return FrontendConfig(
            nats_url=nats.nats_url,
            nats_auth=nats.auth.auth,
            nats_replicas=nats.nats_replicas,
            prefix=nats.prefix,
            model=self.model,
            served_model_name=self.served_model_name,
            api_keys=_api_keys(self.api_key, self.api_key_file),
            max_model_len=self.max_model_len,
            max_tokens_cap=self.max_tokens_cap,
            max_concurrent_requests=self.max_concurrent_requests,
            max_request_bytes=self.max_request_bytes,
            dispatch_policy=self.dispatch_policy,
            dispatch_timeout=self.dispatch_timeout,
            generate_timeout=self.generate_timeout,
            generate_retries=self.generate_retries,
            stall_timeout=self.stall_timeout,
            rescue_timeout=self.rescue_timeout,
            instance_stale_after=self.instance_stale_after,
            request_deadline=self.request_deadline,
            supervisor_status=self.supervisor_status,
            prefix_block_size=self.prefix_block_size,
            responses_ttl_s=self.responses_ttl,
            tool_call_parser=self.tool_call_parser,
        )


def config_from_options(options: Mapping[str, Any]) -> FrontendConfig:
    """The frontend's config that ``shoal serve``'s parsed options describe."""
    return from_options(ServeCliConfig, options).frontend_config()


@click.command("serve")
@click_options(ServeCliConfig)
def serve(**options: Any) -> None:
    """Run the OpenAI-compatible HTTP frontend."""
    import uvicorn

    from frontend.app import create_app

    cli = from_options(ServeCliConfig, options)
    logging.basicConfig(level=cli.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = config_from_options(options)
    provider = tracer_provider(TelemetryConfig.from_env(os.environ), "shoal-frontend")
    app = create_app(config, tracer_provider=provider, freeze_heap=True)
    try:
        uvicorn.run(app, host=cli.host, port=cli.port, log_level=cli.log_level.lower(), access_log=False)
    finally:
        if provider is not None:
            provider.shutdown()

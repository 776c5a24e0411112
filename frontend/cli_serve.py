"""``shoal serve``: run the OpenAI-compatible HTTP frontend (uvicorn) against a NATS cluster.

Parses options into a frozen :class:`~frontend.config.FrontendConfig`, builds
the app with :func:`frontend.app.create_app` (its lifespan connects to NATS and
runs the gateway) and serves it until SIGINT/SIGTERM. Tracing follows the
standard ``OTEL_*`` variables (:mod:`bus.telemetry`), read here and nowhere below.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import click

from bus.options import nats_auth_options, nats_option, nats_replicas_option
from bus.telemetry import TelemetryConfig, tracer_provider
from frontend.api_keys import read_key_file
from frontend.config import FrontendConfig

__all__ = ["config_from_options", "serve"]


def _api_keys(options: dict[str, Any]) -> tuple[str, ...]:
    keys = tuple(options["api_key"])
    if options.get("api_key_file") is not None:
        try:
            keys += read_key_file(options["api_key_file"])
        except (OSError, ValueError) as exc:
            raise click.BadParameter(str(exc), param_hint="--api-key-file") from None
    return keys


def config_from_options(options: dict[str, Any]) -> FrontendConfig:
    return FrontendConfig(
        nats_url=options["nats_url"],
        nats_auth=options["nats_auth"],
        nats_replicas=options["nats_replicas"],
        prefix=options["prefix"],
        model=options["model"],
        served_model_name=options["served_model_name"],
        api_keys=_api_keys(options),
        max_model_len=options["max_model_len"],
        max_tokens_cap=options["max_tokens_cap"],
        max_concurrent_requests=options["max_concurrent_requests"],
        max_request_bytes=options["max_request_bytes"],
        dispatch_policy=options["dispatch_policy"],
        dispatch_timeout=options["dispatch_timeout"],
        generate_timeout=options["generate_timeout"],
        generate_retries=options["generate_retries"],
        stall_timeout=options["stall_timeout"],
        instance_stale_after=options["instance_stale_after"],
        request_deadline=options["request_deadline"],
    )


@click.command("serve")
@nats_option()
@nats_auth_options
@nats_replicas_option
@click.option("--prefix", default="shoal", show_default=True, help="Subject prefix of the cluster.")
@click.option("--model", default="tiny", show_default=True,
              help="Tokenizer: torch preset, checkpoint folder, or sim:<profile>.")
@click.option("--served-model-name", default=None, help="Name clients use (default: --model).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", multiple=True, envvar="SHOAL_API_KEY", show_envvar=True,
              help="Require this Bearer key (repeatable; prefer the variable or --api-key-file).")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              envvar="SHOAL_API_KEY_FILE", show_envvar=True, help="Bearer keys, one per line.")
@click.option("--max-model-len", type=int, default=2048, show_default=True,
              help="Context length until an instance announces its own.")
@click.option("--max-tokens-cap", type=int, default=None, help="Clamp every request's max_tokens.")
@click.option("--max-concurrent-requests", type=int, default=1024, show_default=True,
              help="In flight before answering 429.")
@click.option("--max-request-bytes", type=int, default=4 * 1024 * 1024, show_default=True)
@click.option("--dispatch-policy", default="prefill_ahead", show_default=True,
              help="Bypass-mode dispatch policy.")
@click.option("--dispatch-timeout", type=float, default=0.5, show_default=True,
              help="Seconds to wait for the scheduler before placing by itself (bypass).")
@click.option("--generate-timeout", type=click.FloatRange(min=0, min_open=True), default=2.0,
              show_default=True, help="Seconds an agent has to answer a generate before it is asked again.")
@click.option("--generate-retries", type=click.IntRange(min=0), default=2, show_default=True,
              help="Times an agent that does not answer a generate is asked again (generate is idempotent) "
                   "before the request is placed elsewhere and the agent told to drop it.")
@click.option("--stall-timeout", type=float, default=30.0, show_default=True,
              help="Seconds without a token before a request is rescued elsewhere.")
@click.option("--instance-stale-after", type=float, default=3.0, show_default=True,
              help="Seconds without a load report before an instance counts as dead.")
@click.option("--request-deadline", type=float, default=None, help="End requests running longer (seconds).")
@click.option("--log-level", default="warning", show_default=True)
def serve(**options: Any) -> None:
    """Run the OpenAI-compatible HTTP frontend."""
    import uvicorn

    from frontend.app import create_app

    logging.basicConfig(level=options["log_level"].upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = config_from_options(options)
    provider = tracer_provider(TelemetryConfig.from_env(os.environ), "shoal-frontend")
    app = create_app(config, tracer_provider=provider, freeze_heap=True)
    try:
        uvicorn.run(app, host=options["host"], port=options["port"], log_level=options["log_level"].lower(),
                    access_log=False)
    finally:
        if provider is not None:
            provider.shutdown()

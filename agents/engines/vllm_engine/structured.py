"""vLLM's structured outputs on the vllm engine: a continued request's grammar, per-request whitespace.

The constraint itself is vLLM's (``StructuredOutputsParams``, compiled and applied by the structured-output
backend of vLLM's engine core, ``auto`` as ``vllm serve`` has it). Two things are added here:

- :func:`advance_grammar`: a request that continues after tokens it generated elsewhere (a rescue, a
  migration) reaches vLLM with them after its prompt; its grammar must start from the state those
  tokens left, not from the beginning. vLLM compiles a grammar in the background (a future its
  scheduler waits for); the advanced grammar replaces that future.
- :func:`honour_request_whitespace`: vLLM 0.32's backends (xgrammar, guidance) read
  ``disable_any_whitespace`` from the engine's configuration only and ignore the request's
  ``StructuredOutputsParams.disable_any_whitespace``. A request that asks for JSON without free
  whitespace (``StructuredOutput.any_whitespace`` false: tool calls, ``disable_any_whitespace``) is
  compiled by a copy of the engine's backend with that flag set, sharing its compiler and caches.
"""

from __future__ import annotations

import concurrent.futures
import copy
import threading
from typing import Any

__all__ = ["advance_grammar", "honour_request_whitespace"]


def advance_grammar(structured: Any, request_id: str, tokens: list[int]) -> None:
    """Make a request's grammar (vLLM's ``StructuredOutputRequest``) the one that has accepted ``tokens``.

    vLLM's scheduler admits the request only once the grammar's future is done, so the advanced
    grammar is a future that completes after the compiled one, with the tokens accepted. Tokens after
    the grammar terminated are ignored, as vLLM's own step does; tokens the grammar rejects fail the
    request as a grammar that failed to compile (vLLM's ``FINISHED_ERROR``).
    """
    pending = structured._grammar  # a future, or (compiled in line) the grammar or its error
    advanced: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def advance(done: Any) -> None:
        try:
            grammar = done.result() if isinstance(done, concurrent.futures.Future) else done
            if isinstance(grammar, Exception):
                raise grammar
            if grammar is None:
                raise ValueError(f"request {request_id!r}: vLLM built no grammar")
            if not grammar.accept_tokens(request_id, tokens):
                raise ValueError(
                    f"request {request_id!r}: the grammar rejects the {len(tokens)} tokens generated before"
                )
            advanced.set_result(grammar)
        except Exception as exc:  # vLLM's scheduler fails the request with it
            advanced.set_exception(exc)

    if isinstance(pending, concurrent.futures.Future):
        pending.add_done_callback(advance)
    else:
        advance(pending)
    structured.grammar = advanced


def honour_request_whitespace(manager: Any) -> None:
    """Let vLLM's ``StructuredOutputManager`` compile a request that sets ``disable_any_whitespace``
    without free whitespace, where the engine's configuration allows it (see the module docstring)."""
    create = manager._create_grammar
    twins: dict[int, Any] = {}
    lock = threading.Lock()

    def create_grammar(request: Any) -> Any:
        params = request.sampling_params.structured_outputs if request.sampling_params is not None else None
        backend = manager.backend
        if (
            params is None
            or not params.disable_any_whitespace
            or backend is None
            or getattr(backend, "disable_any_whitespace", True)
        ):
            return create(request)
        with lock:  # compilations run on vLLM's thread pool
            twin = twins.get(id(backend))
            if twin is None:
                twin = copy.copy(backend)
                twin.disable_any_whitespace = True
                twins[id(backend)] = twin
        kind, spec = request.structured_output_request.structured_output_key
        return twin.compile_grammar(kind, spec, stop_token_ids=request.sampling_params.all_stop_token_ids)

    manager._create_grammar = create_grammar

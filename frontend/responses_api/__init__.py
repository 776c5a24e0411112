"""OpenAI's Responses API on the frontend: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``.

* :mod:`.models` — the request body and the options refused with a 400;
* :mod:`.items` — input items checked and normalized, items as chat messages;
* :mod:`.plan` — a request's conversation, prompt, budget and output constraint;
* :mod:`.output` — output items (messages, function calls) and their stream events, from the text;
* :mod:`.objects` — the response object, usage, numbered SSE events;
* :mod:`.serve` — running it through the chat path, whole or streamed;
* :mod:`.store` — stored responses in a JetStream key-value bucket with a TTL.

The HTTP routes are :mod:`frontend.routes.responses`. This package imports nothing at import
time, so :mod:`frontend.dependencies` can use the store without a circle.
"""

from __future__ import annotations

__all__: list[str] = []

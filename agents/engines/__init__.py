"""The engine layer: the ``Engine`` protocol, what shoal's own engines share, and the engines.

The layer imports nothing of the agent around it, so the simulator and the
frontend use it directly:

* :mod:`agents.engines.protocol` — the :class:`~agents.engines.protocol.Engine`
  protocol, its data types and its error tree (pure);
* :mod:`agents.engines.block_manager`, :mod:`agents.engines.local_scheduler` —
  block accounting and the vLLM-v1-style local scheduler (pure);
* :mod:`agents.engines.scheduled` — the base of engines built on them;
* :mod:`agents.engines.tokenizer` — text <-> token ids (no torch; the frontend uses it);
* :mod:`agents.engines.profile` — step-time profiles of the ``sim`` engine;
* ``sim`` (:mod:`agents.engines.sim`) — timing model and exact block accounting, no tensors;
* ``torch`` (:mod:`agents.engines.torch_engine`) — the built-in paged-KV transformer;
* ``vllm`` (:mod:`agents.engines.vllm_engine`) — one in-process vLLM V1 engine (``./install.sh --vllm``).

Engine modules are imported lazily by :func:`engine_class`, so choosing ``sim``
never imports torch. Profiles (step-time tables) live in
:mod:`agents.engines.profile` and ``agents/engines/profiles/``.
"""

from __future__ import annotations

import importlib

__all__ = ["ENGINES", "engine_class"]

#: Engine name -> "module:attribute" of its class.
ENGINES: dict[str, str] = {
    "sim": "agents.engines.sim:SimEngine",
    "torch": "agents.engines.torch_engine:TorchEngine",
    "vllm": "agents.engines.vllm_engine.engine:VllmEngine",
}


def engine_class(name: str) -> type:
    """The class of engine ``name`` (imported on first use); ValueError for unknown names."""
    try:
        target = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    try:
        cls: type = getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"engine {name!r}: {module_name} has no {attribute}") from None
    return cls

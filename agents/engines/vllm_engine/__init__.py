"""vLLM as a shoal engine: one in-process vLLM V1 engine per agent behind the ``Engine`` protocol.

Modules: ``checkpoint`` (a small random Llama both vLLM and the torch engine
load; no vLLM needed). The engine itself imports vLLM, so it loads lazily.
"""

__all__: list[str] = []

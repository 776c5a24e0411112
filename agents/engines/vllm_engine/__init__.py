"""vLLM as a shoal engine: one in-process vLLM V1 engine per agent behind the ``Engine`` protocol.

Modules: ``config`` (:class:`VllmEngineConfig`), ``compat`` (which vLLM is
installed), ``sampling`` (shoal's sampling as vLLM's; which requests cannot
migrate), ``checkpoint`` (a small random Llama both vLLM and the torch engine
load), and, importing vLLM: ``engine`` (:class:`~.engine.VllmEngine`),
``scheduler`` (vLLM's scheduler plus suspend/resume), ``kv_blocks`` (block
gather/scatter on vLLM's KV tensors) and ``migration`` (reservations, export,
import, admission). See ``STATUS.md`` beside this file.
"""

from agents.engines.vllm_engine.compat import VllmUnavailable, vllm_unavailable_reason, vllm_version
from agents.engines.vllm_engine.config import VllmEngineConfig

__all__ = ["VllmEngineConfig", "VllmUnavailable", "vllm_unavailable_reason", "vllm_version"]

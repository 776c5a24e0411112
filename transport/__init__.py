"""The KV data plane: moving fused KV-block buffers between agents (UCX, TCP, in-process)."""

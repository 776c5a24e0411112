"""Subject and stream names, built from a configurable prefix.

Several clusters can share one NATS deployment by using different prefixes.
Stream names are the prefix with dots replaced, plus ``_events`` / ``_loads`` / ``_history``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Subjects"]


def _token(value: str) -> str:
    if not value or any(c in value for c in ".*> \t\r\n"):
        raise ValueError(f"invalid subject token: {value!r}")
    return value


@dataclass(frozen=True)
class Subjects:
    prefix: str = "shoal"

    def __post_init__(self) -> None:
        for part in self.prefix.split("."):
            _token(part)

    # -- streams ---------------------------------------------------------
    @property
    def events_stream(self) -> str:
        return self.prefix.replace(".", "_") + "_events"

    @property
    def loads_stream(self) -> str:
        return self.prefix.replace(".", "_") + "_loads"

    @property
    def events_all(self) -> str:
        return f"{self.prefix}.ev.>"

    @property
    def loads_all(self) -> str:
        return f"{self.prefix}.load.*"

    @property
    def history_stream(self) -> str:
        return self.prefix.replace(".", "_") + "_history"

    @property
    def history_all(self) -> str:
        return f"{self.prefix}.hist.>"

    @property
    def kv_bucket(self) -> str:
        return self.prefix.replace(".", "_") + "_state"

    @property
    def responses_bucket(self) -> str:
        """The frontends' stored Responses API responses (a KV bucket of its own, with a TTL)."""
        return self.prefix.replace(".", "_") + "_responses"

    # -- persisted (JetStream) ---------------------------------------------
    def instance(self, instance_id: str) -> str:
        return f"{self.prefix}.ev.instance.{_token(instance_id)}"

    def load(self, instance_id: str) -> str:
        return f"{self.prefix}.load.{_token(instance_id)}"

    def sched(self, kind: str) -> str:
        return f"{self.prefix}.ev.sched.{_token(kind)}"

    def mig(self, migration_id: str) -> str:
        return f"{self.prefix}.ev.mig.{_token(migration_id)}"

    def req(self, request_id: str) -> str:
        return f"{self.prefix}.ev.req.{_token(request_id)}"

    @property
    def kv_stream(self) -> str:
        """Prefix-cache events (``KVCacheEvents``) of every instance."""
        return self.prefix.replace(".", "_") + "_kv"

    @property
    def kv_all(self) -> str:
        return f"{self.prefix}.kv.*"

    def kv(self, instance_id: str) -> str:
        """One instance's prefix-cache events (``KVCacheEvents``)."""
        return f"{self.prefix}.kv.{_token(instance_id)}"

    def kv_sync(self, instance_id: str) -> str:
        """Core NATS: ask an instance for a full batch of its prefix cache (``KVCacheSync``)."""
        return f"{self.prefix}.kvsync.{_token(instance_id)}"

    def history(self, kind: str) -> str:
        """``loads`` (archived load reports) or ``checkpoint`` (folded state) in the history stream."""
        return f"{self.prefix}.hist.{_token(kind)}"

    # -- core NATS (not persisted) -----------------------------------------
    def tok(self, request_id: str) -> str:
        return f"{self.prefix}.tok.{_token(request_id)}"

    def tok_batch(self, frontend_id: str) -> str:
        """A frontend's token subject: per-step batches of its requests' deltas."""
        return f"{self.prefix}.tokb.{_token(frontend_id)}"

    def rpc_agent(self, instance_id: str, method: str) -> str:
        """Agent RPCs: generate, abort, resend, migrate_out, stop, drain."""
        return f"{self.prefix}.rpc.agent.{_token(instance_id)}.{_token(method)}"

    def rpc_mig(self, instance_id: str) -> str:
        """Migration handshake messages addressed to an agent."""
        return f"{self.prefix}.rpc.mig.{_token(instance_id)}"

    @property
    def rpc_dispatch(self) -> str:
        return f"{self.prefix}.rpc.sched.dispatch"

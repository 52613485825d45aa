from __future__ import annotations

LATENCY_BOUNDARIES_S = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0]


class TransferObserver:
    def pulled(self, transport: str, nbytes: int, seconds: float) -> None:
        """A pull landed: ``nbytes`` in ``seconds``."""

    def failed(self, transport: str, cause: str) -> None:
        """A pull failed (``cause``: read, timeout, lease_expired, post, ...)."""

    def recomputed(self, transport: str) -> None:
        """A request whose pull failed had its prompt computed on decode instead."""

    def fallback(self, transport: str, reason: str | None) -> None:
        """This worker's transport, and why it is not NIXL (None when it is)."""


class KVMetrics(TransferObserver):
    def __init__(self, role: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = ("role", "transport")
        self.role = role
        self._handoffs = Counter("tandem_kv_handoffs", "KV handoffs pulled", tags)
        self._bytes = Counter("tandem_kv_bytes", "KV bytes pulled", tags)
        self._latency = Histogram(
            "tandem_kv_pull_seconds",
            "Time from a pull's start to its last byte",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=tags,
        )
        self._failures = Counter(
            "tandem_kv_failures", "Failed KV pulls by cause", ("role", "transport", "cause")
        )
        self._recomputed = Counter(
            "tandem_kv_recomputed", "Prompts recomputed on decode after a failed KV pull", tags
        )
        self._fallback = Gauge(
            "tandem_kv_transport_fallback",
            "1 where this worker's KV transport is a fallback (not NIXL), else 0",
            tags,
        )

    def pulled(self, transport: str, nbytes: int, seconds: float) -> None:
        tags = {"role": self.role, "transport": transport}
        self._handoffs.inc(1, tags)
        self._bytes.inc(nbytes, tags)
        self._latency.observe(seconds, tags)

    def failed(self, transport: str, cause: str) -> None:
        self._failures.inc(1, {"role": self.role, "transport": transport, "cause": cause})

    def recomputed(self, transport: str) -> None:
        self._recomputed.inc(1, {"role": self.role, "transport": transport})

    def fallback(self, transport: str, reason: str | None) -> None:
        tags = {"role": self.role, "transport": transport}
        self._fallback.set(0.0 if reason is None else 1.0, tags)

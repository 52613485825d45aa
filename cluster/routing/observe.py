"""What a router did, for operators: decisions by basis (``BASES``, see docs/deploy.md), their
cost, the acceptance estimates it placed by; ``tandem_router_*`` metrics plus in-process totals.
No gauges: Ray drops a gauge's series unset for two export intervals, and an idle router sets none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECISION_BOUNDARIES_S = [1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2]
ESTIMATE_BOUNDARIES = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
BASES = (
    "stats",
    "partial",
    "fallback",
    "stats_free",
    "other_call",
    "affinity",
    "two_choices",
    "release",
)


@dataclass
class RouterTotals:
    """The same events as the exported metrics, readable in-process."""

    decisions: dict[str, int] = field(default_factory=dict)  # basis -> count
    decision_s: float = 0.0  # wall time, summed over decisions
    decision_cpu_s: float = 0.0
    slowest_s: float = 0.0
    estimates: dict[str, list[float]] = field(default_factory=dict)  # greedy|sampled -> alphas
    stats_rejected: int = 0


class RouterMetrics:
    """``tandem_router_*`` for one router instance; ``keep_estimates`` bounds the estimates
    kept in ``totals`` (the histogram has them all)."""

    def __init__(self, deployment: str, policy: str, keep_estimates: int = 4096) -> None:
        from ray.util.metrics import Counter, Histogram

        tags = ("deployment", "policy")
        self.tags = {"deployment": deployment, "policy": policy}
        self.totals = RouterTotals()
        self.keep_estimates = keep_estimates
        self._decisions = Counter(
            "tandem_router_decisions",
            "Rankings of a call's replicas, by their basis",
            (*tags, "basis"),
        )
        self._seconds = Histogram(
            "tandem_router_decision_seconds",
            "Wall time the router took to rank the replicas for one call",
            boundaries=DECISION_BOUNDARIES_S,
            tag_keys=tags,
        )
        self._cpu = Histogram(
            "tandem_router_decision_cpu_seconds",
            "CPU time of the router's thread for one ranking (the rest of the wall time is "
            "waiting for a core or the GIL)",
            boundaries=DECISION_BOUNDARIES_S,
            tag_keys=tags,
        )
        self._estimate = Histogram(
            "tandem_router_acceptance_estimate",
            "Calibrated acceptance estimates of the requests placed, greedy or sampled",
            boundaries=ESTIMATE_BOUNDARIES,
            tag_keys=(*tags, "sampling"),
        )
        self._rejected = Counter(
            "tandem_router_stats_rejected", "Replica routing stats the router could not use", tags
        )
        for m in (self._seconds, self._cpu, self._rejected):
            m.set_default_tags(self.tags)

    def decided(self, basis: str, seconds: float, cpu_seconds: float) -> None:
        """One ranking on ``basis`` (one of ``BASES``): wall and router-thread CPU seconds."""
        if basis not in BASES:
            raise ValueError(f"unknown routing decision basis {basis!r}")
        t = self.totals
        t.decisions[basis] = t.decisions.get(basis, 0) + 1
        t.decision_s += seconds
        t.decision_cpu_s += cpu_seconds
        t.slowest_s = max(t.slowest_s, seconds)
        self._decisions.inc(1, {**self.tags, "basis": basis})
        self._seconds.observe(seconds)
        self._cpu.observe(cpu_seconds)

    def estimate(self, alpha: float, greedy: bool) -> None:
        sampling = "greedy" if greedy else "sampled"
        kept = self.totals.estimates.setdefault(sampling, [])
        if len(kept) < self.keep_estimates:
            kept.append(alpha)
        self._estimate.observe(alpha, {**self.tags, "sampling": sampling})

    def rejected(self) -> None:
        """A replica's routing stats were malformed or of another version."""
        self.totals.stats_rejected += 1
        self._rejected.inc(1)


def basis_of(live: int, fresh: int | None) -> str:
    """A decode decision's basis from the live replicas and those with fresh stats."""
    if fresh is None:
        return "stats_free"
    if fresh == 0:
        return "fallback"
    return "stats" if fresh >= live else "partial"

"""The routers' view of a run, read back from Ray's Prometheus endpoint (``tandem_router_*``,
``cluster.routing.observe``): decisions by basis, their cost, and the acceptance estimates the
requests were placed by, greedy and sampled apart.

    samples = scrape(port, "decode")       # (sample name, basis, sampling) -> value
    view = router_view(samples)            # what bench/serve.py stores under "router"
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, str, str], float]
DECISIONS = "ray_tandem_router_decisions_total"
ESTIMATES = "ray_tandem_router_acceptance_estimate"
DECISION_BUCKETS = "ray_tandem_router_decision_"  # wall and CPU seconds


def quantile_bound(samples: Samples, histogram: str, q: float) -> float | None:
    """The smallest bucket bound holding at least ``q`` of ``histogram``'s observations (an
    upper bound on its ``q`` quantile; inf past the last bound); None without observations."""
    buckets = sorted(
        (float(third[3:]), v)
        for (name, _, third), v in samples.items()
        if name == f"{histogram}_bucket" and third.startswith("le=")
    )
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return None
    return next(bound for bound, cum in buckets if cum >= q * total)


def scrape(port: int, deployment: str, host: str = "127.0.0.1") -> Samples:
    """(sample name, basis, sampling) -> value of the ``deployment``'s router samples, summed
    over the processes that route to it. Of histogram buckets only the decision times' are
    kept, with ``le=<bound>`` in the sampling place."""
    text = httpx.get(f"http://{host}:{port}/metrics", timeout=10).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            lab = s.labels
            if not s.name.startswith("ray_tandem_router") or lab.get("deployment") != deployment:
                continue
            if "le" in lab and not s.name.startswith(DECISION_BUCKETS):
                continue
            third = f"le={lab['le']}" if "le" in lab else lab.get("sampling", "")
            key = (s.name, lab.get("basis", ""), third)
            out[key] = out.get(key, 0.0) + s.value
    return out


def placed(samples: Samples) -> float:
    """Requests placed: one acceptance estimate each."""
    return sum(v for (name, _, _), v in samples.items() if name == f"{ESTIMATES}_count")


def wait_for(port: int, deployment: str, requests: int, timeout_s: float = 30.0) -> Samples:
    """Scrape until ``requests`` placements are exported (Ray exports every few seconds) or
    ``timeout_s`` passes; the last scrape either way."""
    deadline = time.monotonic() + timeout_s
    samples = scrape(port, deployment)
    while placed(samples) < requests and time.monotonic() < deadline:
        time.sleep(1.0)
        samples = scrape(port, deployment)
    return samples


def router_view(samples: Samples) -> dict[str, Any]:
    """Decisions by basis, their mean wall and CPU time, and per sampling the estimates'
    count and mean."""
    decisions = {b: v for (n, b, _), v in samples.items() if n == DECISIONS}
    count = samples.get(("ray_tandem_router_decision_seconds_count", "", ""), 0.0)
    total = samples.get(("ray_tandem_router_decision_seconds_sum", "", ""), 0.0)
    cpu = samples.get(("ray_tandem_router_decision_cpu_seconds_sum", "", ""), 0.0)
    cpu_count = samples.get(("ray_tandem_router_decision_cpu_seconds_count", "", ""), 0.0)
    estimates = {}
    for (name, _, sampling), n in samples.items():
        if name == f"{ESTIMATES}_count" and n:
            mean = samples.get((f"{ESTIMATES}_sum", "", sampling), 0.0) / n
            estimates[sampling] = {"count": n, "mean": mean}
    return {
        "decisions": decisions,
        "decision_mean_s": total / count if count else None,
        "decision_cpu_mean_s": cpu / cpu_count if cpu_count else None,
        "decision_p50_at_most_s": quantile_bound(samples, f"{DECISION_BUCKETS}seconds", 0.5),
        "decision_cpu_p50_at_most_s": quantile_bound(
            samples, f"{DECISION_BUCKETS}cpu_seconds", 0.5
        ),
        "decision_p99_at_most_s": quantile_bound(samples, f"{DECISION_BUCKETS}seconds", 0.99),
        "estimates": estimates,
    }

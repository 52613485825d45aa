"""Reading the routers' Prometheus samples back: quantile bounds from buckets, the view."""

from __future__ import annotations

from bench.router_metrics import Samples, quantile_bound, router_view

H = "ray_tandem_router_decision_seconds"


def samples() -> Samples:
    # 10 decisions: 6 within 0.1 ms, 9 within 0.5 ms, all within 5 ms (cumulative buckets)
    out: Samples = {
        (f"{H}_bucket", "", "le=0.0001"): 6.0,
        (f"{H}_bucket", "", "le=0.0005"): 9.0,
        (f"{H}_bucket", "", "le=0.005"): 10.0,
        (f"{H}_bucket", "", "le=+Inf"): 10.0,
        (f"{H}_count", "", ""): 10.0,
        (f"{H}_sum", "", ""): 0.004,
        ("ray_tandem_router_decisions_total", "stats", ""): 9.0,
        ("ray_tandem_router_decisions_total", "fallback", ""): 1.0,
        ("ray_tandem_router_acceptance_estimate_count", "", "greedy"): 4.0,
        ("ray_tandem_router_acceptance_estimate_sum", "", "greedy"): 3.2,
    }
    return out


def test_quantile_bounds_come_from_the_cumulative_buckets() -> None:
    s = samples()
    assert quantile_bound(s, H, 0.5) == 0.0001
    assert quantile_bound(s, H, 0.9) == 0.0005
    assert quantile_bound(s, H, 0.99) == 0.005
    assert quantile_bound(s, "ray_tandem_router_decision_cpu_seconds", 0.5) is None


def test_the_view_sums_decisions_and_averages_estimates() -> None:
    view = router_view(samples())
    assert view["decisions"] == {"stats": 9.0, "fallback": 1.0}
    assert view["decision_mean_s"] == 0.0004
    assert view["decision_cpu_mean_s"] is None  # no CPU samples
    assert view["estimates"] == {"greedy": {"count": 4.0, "mean": 0.8}}
    assert view["decision_p50_at_most_s"] == 0.0001

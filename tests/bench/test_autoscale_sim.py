"""The decode autoscaling simulator: Serve's delays and the goodput decision as the pool sees
them, and a small day whose mix shifts at a steady rate: the goodput policy's pool follows the
mix where the request-count rule's overshoots it, both tuned rules reach the goal, and the
report holds what the comparison needs."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from bench import autoscale_sim
from bench.autoscalesim.pool import Policy, Report, Rule, Scaling, Wanted, serve_delays
from cluster.capacity_policy import decide

HOURS = 6
ARGS = [
    *("--minutes", str(HOURS * 60), "--step", "30", "--peak-replicas", "100"),
    *("--mix-levels", "3", "--trough", "1", "--noise", "0.03", "--check-days", "1"),
]  # a steady rate (trough = peak): only the mix moves the demand


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("autoscale") / "day.json"
    assert autoscale_sim.main([*ARGS, "--out", str(out)]) == out
    assert out.with_suffix(".png").stat().st_size > 0
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


@pytest.mark.parametrize(
    ("running", "streams", "capacity"), [(10, 40.0, 100.0), (10, 90.0, 100.0), (7, 65.0, 131.0)]
)
def test_the_pool_decides_as_with_one_entry_per_replica(
    running: int, streams: float, capacity: float
) -> None:
    """Below, inside and above the band: the pool's one entry gives ``decide``'s decision for
    one entry a replica."""
    policy = Policy(Rule.GOODPUT, 0.8, band=0.3)
    report = Report(streams, capacity, streams, capacity)  # the same numbers in either unit
    each = decide(
        running,
        dict.fromkeys(range(running), streams),
        dict.fromkeys(range(running), capacity),
        dict.fromkeys(range(running), streams),
        0.8,
        0.5,
        48.0,
    )
    assert policy.desired(running, report) == each.replicas


def test_serve_applies_a_change_only_once_wanted_for_its_delay() -> None:
    s = Scaling(1, 100, upscale_delay_s=30.0, downscale_delay_s=600.0)
    target, wanted = serve_delays(12, 10, Wanted(0, 0.0), 0.0, s)
    assert target == 10
    target, wanted = serve_delays(14, 10, wanted, 20.0, s)
    assert target == 10  # still within the upscale delay
    target, wanted = serve_delays(15, 10, wanted, 30.0, s)
    assert target == 15 and wanted.direction == 0  # what it wants now, not what it first did
    target, wanted = serve_delays(9, 15, wanted, 40.0, s)
    target, wanted = serve_delays(16, 15, wanted, 600.0, s)  # the other way: the clock restarts
    assert target == 15
    target, wanted = serve_delays(9, 15, wanted, 1200.0, s)
    assert target == 15  # a downscale wanted from 1200 s on waits until 1800 s
    assert serve_delays(9, 15, wanted, 1800.0, s)[0] == 9


def _phases(report: dict[str, Any]) -> dict[str, np.ndarray]:
    tl = report["timeline"]
    x = np.asarray(tl["creative_x"])  # [minutes]
    first = np.arange(len(x)) < len(x) // 2
    return {"copy": (x <= 0.1) & first, "creative": x >= 0.9}  # each [minutes]


def _mean(values: list[float], sel: np.ndarray) -> float:
    return float(np.asarray(values)[sel].mean())


def test_the_goodput_pool_follows_the_mix_where_the_request_count_overshoots(
    report: dict[str, Any],
) -> None:
    """At the same arrival rate a creative mix needs more replicas than a copy-heavy one
    (longer outputs, fewer tokens a step) but each holds more streams within the SLO. The
    goodput policy sees both and grows the pool about as the demand does (a replica that
    reported one capacity at every mix would grow it half as much again); a fixed
    target_ongoing_requests counts only the streams and grows it more still."""
    tl, phase = report["timeline"], _phases(report)
    rate = {k: _mean(tl["rate_rps"], sel) for k, sel in phase.items()}
    assert rate["creative"] == pytest.approx(rate["copy"], rel=0.05)

    def growth(values: list[float]) -> float:
        return _mean(values, phase["creative"]) / _mean(values, phase["copy"])

    demand = growth(tl["demand_replicas"])
    goodput = growth(tl["replicas"]["goodput-tuned"])
    requests = growth(tl["replicas"]["requests-tuned"])
    assert demand > 1.1
    assert goodput == pytest.approx(demand, rel=0.1)
    assert requests > 1.1 * demand
    # the goodput rule lets a creative replica hold more streams; the count rule does not
    assert growth(tl["streams"]["goodput-tuned"]) > growth(tl["streams"]["requests-tuned"])


def test_tuned_rules_reach_the_goal_and_the_report_is_complete(report: dict[str, Any]) -> None:
    goal, top = report["goal"], report["scaling"]["max_replicas"] * HOURS
    for rule in ("requests", "goodput"):
        pol = report["policies"][rule]
        assert pol["reached_goal"] and pol["tuned"]["attainment"] >= goal
        runs = [pol["default"], pol["tuned"], *pol["tried"], *pol["held_out"]]
        for r in runs:
            assert 0 < r["replica_hours"] <= top
            assert 0.0 <= r["attainment"] <= 1.0 and r["scale_events"] >= 0
            assert report["scaling"]["min_replicas"] <= r["peak_replicas"]
            assert r["peak_replicas"] <= report["scaling"]["max_replicas"]
        assert len(pol["tuned"]["hourly_attainment"]) == HOURS
        assert len(pol["held_out"]) == 1
    assert set(report["policies"]) == {"requests", "goodput", "dynamo", "dynamo_profiled"}
    hours = {k: v["tuned"]["replica_hours"] for k, v in report["policies"].items()}
    for peer in ("requests", "dynamo", "dynamo_profiled"):
        assert report["ratios"][f"goodput_over_{peer}"] == pytest.approx(
            hours["goodput"] / hours[peer]
        )
    assert 0 < report["demand_replica_hours"] < min(hours.values())
    assert report["policies"]["requests"]["default"]["knob"] == 48
    assert report["policies"]["goodput"]["default"]["downscale_utilization"] == pytest.approx(0.5)
    assert {"slo", "day", "scaling", "mix", "levels", "timeline", "peak_rps"} <= report.keys()


def test_the_replica_curve_agrees_with_the_capacity_prediction_at_pure_mixes(
    report: dict[str, Any],
) -> None:
    """Copy-heavy and creative: the first stream count at which some class of the curve's
    batch misses the SLO is where ``capacity_within_slo`` says the replica's capacity ends."""
    levels = report["levels"]
    for level in (levels[0], levels[-1]):
        assert abs(level["capacity_streams"] - level["reported_streams"]) <= 2
    assert levels[-1]["capacity_rps"] < levels[0]["capacity_rps"]  # creative: fewer requests/s


def test_dynamo_sizes_the_arrivals_by_its_profile_over_the_accept_length() -> None:
    """Its largest concurrency within the ITL target (forward over accept length, times the
    observed / expected correction) sets a replica's tokens/s; the arrivals' set the count."""
    prof = tuple(0.010 + 0.0001 * n for n in range(101))  # [n] a forward at n streams
    policy = Policy(Rule.DYNAMO, 0.0075, profile_step_s=prof)
    # accept length 2, latency as profiled: n = 50 (15 ms / 2), 50 * 2 / 15 ms a replica
    exact = Report(20, 0, 0, 0, accept_length=2.0, itl_s=prof[20] / 2, arrival_tok_s=1000.0)
    assert policy.desired(10, exact) == math.ceil(10_000 / (50 * 2 / prof[50]))
    slow = Report(20, 0, 0, 0, accept_length=2.0, itl_s=prof[20], arrival_tok_s=1000.0)
    assert policy.desired(10, slow) > 50  # twice the profile: nothing fits, one stream each
    # one scalar: an accept length measured light is applied to a full batch
    light = Report(5, 0, 0, 0, accept_length=4.0, itl_s=prof[5] / 4, arrival_tok_s=1000.0)
    assert policy.desired(10, light) < policy.desired(10, exact)
    profiled = Policy(
        Rule.DYNAMO_PROFILED, 0.0075, profile_step_s=prof, profile_accept=(2.0,) * 101
    )
    as_profiled = Report(5, 0, 0, 0, accept_length=4.0, itl_s=prof[5] / 2, arrival_tok_s=1000.0)
    assert profiled.desired(10, as_profiled) == policy.desired(10, exact)  # its 2, not the 4

"""Acceptance calibration: cells, shrinkage, forgetting, the router's pool, the wire format."""

from __future__ import annotations

import pytest

from cluster.routing.policies import RouteRequest
from cluster.routing.request_info import route_request
from kvtransfer.handoff import KVCompat, KVHandoff
from models.request import Request
from models.sampling import SamplingParams
from speculation.calibration import (
    PRIOR_TOKENS,
    WINDOW_TOKENS,
    AcceptanceCalibration,
    CalibrationPool,
    Cell,
    calibrated,
    calibration_key,
)
from speculation.routing_stats import (
    ReplicaLoad,
    RoutingStats,
    SpeculationState,
    collect_routing_stats,
)


def test_cells_split_by_temperature_and_probe() -> None:
    assert calibration_key(None, 0.0) == (0, 0)
    assert calibration_key(0.0, 0.0) == (0, 1)
    assert calibration_key(0.19, 0.3) == (1, 1)
    assert calibration_key(0.2, 0.7) == (2, 2)
    assert calibration_key(1.0, 1.0) == (2, 5)
    assert calibration_key(0.99, 1.5) == (3, 5)


def test_the_estimate_moves_from_the_fallback_to_what_the_cell_accepted() -> None:
    cal = AcceptanceCalibration()
    key = calibration_key(0.1, 0.0)
    assert cal.estimate(key, 0.1) == 0.1  # nothing finished yet
    cal.record(key, drafted=32, accepted=28)
    assert cal.estimate(key, 0.1) == pytest.approx((28 + PRIOR_TOKENS * 0.1) / (32 + PRIOR_TOKENS))
    for _ in range(50):
        cal.record(key, drafted=100, accepted=86)
    assert cal.estimate(key, 0.1) == pytest.approx(0.86, abs=0.01)
    assert cal.estimate(calibration_key(0.1, 1.0), 0.1) == 0.1  # another cell learned nothing
    cal.record(key, drafted=0, accepted=0)  # a request that never drafted says nothing
    (cell,) = cal.cells()
    assert cell.key == key and cell.drafted == WINDOW_TOKENS


def test_a_cell_forgets_an_old_workload() -> None:
    cal = AcceptanceCalibration()
    key = (0, 1)
    for _ in range(100):
        cal.record(key, drafted=100, accepted=90)
    for _ in range(200):
        cal.record(key, drafted=100, accepted=10)
    assert cal.estimate(key, 0.5) < 0.2


def test_the_router_pool_sums_replicas_and_drops_those_that_leave() -> None:
    pool = CalibrationPool()
    pool.put(0, (Cell(0, 1, 100.0, 90.0),))
    pool.put(1, (Cell(0, 1, 100.0, 70.0), Cell(2, 1, 50.0, 5.0)))
    assert pool.estimate((0, 1), 0.0) == pytest.approx(calibrated(200.0, 160.0, 0.0))
    pool.put(1, (Cell(0, 1, 300.0, 150.0),))  # a newer snapshot replaces the older
    assert pool.estimate((0, 1), 0.0) == pytest.approx(calibrated(400.0, 240.0, 0.0))
    assert pool.estimate((2, 1), 0.3) == 0.3  # no replica publishes that cell any more
    pool.clear(0)
    assert pool.estimate((0, 1), 0.0) == pytest.approx(calibrated(300.0, 150.0, 0.0))
    pool.clear(1)
    assert pool.estimate((0, 1), 0.42) == 0.42


def test_the_router_calibrates_the_probe_by_temperature_and_probe_bin() -> None:
    compat = KVCompat("m", "float32", 16, "layout", 1, "ngram", "nixl")
    handoff = KVHandoff("r", (), (1, 2, 3), ("target",), 40, 7, compat, 0.0, acceptance_probe=0.1)
    greedy = Request("g", list(range(40)), SamplingParams(temperature=0.0, max_tokens=8))
    hot = Request("h", list(range(40)), SamplingParams(temperature=1.0, max_tokens=8))
    pool = CalibrationPool()
    pool.put(0, (Cell(0, 1, 4000.0, 3440.0), Cell(2, 1, 4000.0, 400.0)))
    g = route_request([greedy, handoff], {}, pool)
    h = route_request([hot, handoff], {}, pool)
    assert g == RouteRequest(pytest.approx(calibrated(4000.0, 3440.0, 0.1)), 40, greedy=True)
    assert h == RouteRequest(pytest.approx(calibrated(4000.0, 400.0, 0.1)), 40)
    assert route_request([greedy, handoff], {}) == RouteRequest(0.1, 40, greedy=True)  # the probe


def test_cells_travel_in_the_routing_stats() -> None:
    cells = (Cell(0, 1, 123.456, 100.0), Cell(3, 0, 7.0, 0.0))
    stats = collect_routing_stats(
        [0.5],
        [2],
        ReplicaLoad(queued=0, free_blocks=1, num_blocks=2, block_size=16, max_batch_size=4),
        SpeculationState(k_max=4, adaptive=True, step_time=None, calibration=cells),
    )
    back = RoutingStats.from_dict(stats.to_dict())
    assert back.calibration == (Cell(0, 1, 123.46, 100.0), Cell(3, 0, 7.0, 0.0))
    bad = stats.to_dict() | {"calibration": [[0, 1, 5.0]]}
    with pytest.raises(ValueError, match="malformed"):
        RoutingStats.from_dict(bad)


def test_a_new_replica_is_seeded_from_the_pools_cells_of_its_drafter_version() -> None:
    """Only replicas of the same drafter version count; a cell seeds at most a window, so the
    replica's own requests take over; the prior becomes the pool's overall acceptance."""
    from decode.speculation import SpeculationPolicy
    from serving.shared_priors import pooled_cells

    entries = {
        "a": {
            "drafter_version": "v1",
            "calibration": [[0, 0, 3000.0, 2700.0], [2, 0, 100.0, 20.0]],
        },
        "b": {"drafter_version": "v1", "calibration": [[0, 0, 3000.0, 2400.0]]},
        "c": {"drafter_version": "v0", "calibration": [[0, 0, 5000.0, 100.0]]},  # an old head
        "d": {"running": 0},  # published nothing to learn from
    }
    cells = pooled_cells(entries, "v1")
    assert [(c.key, c.drafted, c.accepted) for c in cells] == [
        ((0, 0), 6000.0, 5100.0),
        ((2, 0), 100.0, 20.0),
    ]
    spec = SpeculationPolicy(k_max=4, step_time=None)
    seeded = spec.seed(cells)
    assert seeded == WINDOW_TOKENS + 100.0
    assert spec.calibration.estimate((0, 0), 0.5) == pytest.approx(
        calibrated(WINDOW_TOKENS, 0.85 * WINDOW_TOKENS, 0.5)
    )
    assert spec.prior == pytest.approx(5120 / 6100)
    assert pooled_cells(entries, "v2") == () and SpeculationPolicy(4, None).seed(()) == 0.0

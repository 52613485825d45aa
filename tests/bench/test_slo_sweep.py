"""The SLO sweep summary pairs each policy run with power of two's in the same report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import slo_sweep


def report(slo_s: float, runs: list[tuple[float, str, float, float]]) -> dict[str, Any]:
    """A router_sim report's fields the sweep reads: (load, policy, goodput, p99 TPOT)."""
    return {
        "slo": {"tpot_s": slo_s},
        "runs": [
            {"load": load, "policy": pol, "goodput_rps": g, "tpot_p99_s": p99}
            for load, pol, g, p99 in runs
        ],
    }


def test_points_pair_each_run_with_power_of_two_at_its_load_and_slo() -> None:
    a = report(0.016, [(0.8, "power_of_two", 100.0, 0.019), (0.8, "slo_aware", 138.0, 0.018)])
    b = report(0.015, [(0.7, "slo_aware", 90.0, 0.015), (0.8, "power_of_two", 50.0, 0.02)])
    pts = slo_sweep.points([a, b], "slo_aware")  # b has no power of two at 0.7: no point
    assert len(pts) == 1
    p = pts[0]
    assert (p["load"], p["tpot_slo_ms"]) == (0.8, 16.0)
    assert p["goodput_ratio"] == pytest.approx(1.38)
    assert p["tpot_p99_ms_delta"] == pytest.approx(-1.0)


def test_command_line_writes_json_and_png(tmp_path: Path) -> None:
    paths = []
    for i, slo in enumerate((0.015, 0.016)):
        rep = report(slo, [(0.8, "power_of_two", 100.0, 0.019), (0.8, "slo_aware", 90.0 + i, 0.02)])
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(rep))
    out = slo_sweep.main([*map(str, paths), "--out", str(tmp_path / "sweep.json")])
    doc = json.loads(out.read_text())
    assert [p["tpot_slo_ms"] for p in doc["points"]] == [15.0, 16.0]
    assert [round(p["goodput_ratio"], 2) for p in doc["points"]] == [0.9, 0.91]
    assert out.with_suffix(".png").stat().st_size > 10_000
    with pytest.raises(SystemExit, match="no report holds both"):
        slo_sweep.main([str(paths[0]), "--policy", "least_kv", "--out", str(tmp_path / "x.json")])

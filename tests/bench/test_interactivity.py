"""Goodput at equal interactivity: a mode counts at a concurrency only where its mean TPOT
meets the target, and adaptive speculation is flagged wherever it falls below the better of
off and the best fixed k; on the simulated GPU profile it never does."""

from __future__ import annotations

import json
from pathlib import Path

from bench import interactivity


def _part(adaptive_tok_s: float, adaptive_tpot_ms: float) -> dict[str, object]:
    return {
        "targets_ms": [50.0],
        "modes": {
            "off": {"4": {"tok_s": 100.0, "tpot_ms": 40.0}},
            "k=2": {"4": {"tok_s": 150.0, "tpot_ms": 60.0}},  # faster, but misses 50 ms
            "adaptive": {"4": {"tok_s": adaptive_tok_s, "tpot_ms": adaptive_tpot_ms}},
        },
    }


def test_a_mode_counts_only_where_it_meets_the_target() -> None:
    row = interactivity.at_targets(_part(120.0, 45.0))["50"]["4"]
    assert row["k=2"] == 0.0 and row["best_fixed"] == 100.0
    assert row["adaptive_over_best"] == 1.2 and row["no_cliff"]
    worse = interactivity.at_targets(_part(120.0, 55.0))["50"]["4"]  # adaptive misses it too
    assert worse["adaptive"] == 0.0 and not worse["no_cliff"]


def test_the_simulated_gpu_profile_has_no_cliff(tmp_path: Path) -> None:
    out = interactivity.main(["--parts", "sim", "--out", str(tmp_path / "i.json")])
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    sim = report["sim"]
    assert sim["cliffs"] == []
    rows = sim["at_targets"]["20"]
    assert set(rows) == {str(n) for n in interactivity.SIM_CONCURRENCY}
    # more users at 20 ms: more throughput, and speculation pays at low concurrency
    assert rows["128"]["best_fixed"] > rows["8"]["best_fixed"] > 0
    assert rows["1"]["off"] < rows["1"]["best_fixed"]

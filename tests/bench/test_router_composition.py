"""The composition report of the router simulator: it samples busy replicas only, its bins
cover every sampled replica and creative request, and a class-split placement shows up as
replicas of one kind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench import router_composition
from bench.routersim.capacity import saturation_rps
from bench.routersim.prefill import prefill_replicas_for, simulate_prefill
from bench.routersim.profiles import h200_profile
from bench.routersim.sim import SimConfig
from bench.routersim.workload import DEFAULT_MIX, generate


def test_samples_hold_every_running_request_and_a_split_separates_classes() -> None:
    p = h200_profile()
    w = generate(2500, 0.8 * saturation_rps(p, DEFAULT_MIX, 8), seed=2)
    pre = simulate_prefill(w, p, prefill_replicas_for(w, p))
    t_lo, t_hi = float(w.arrival_s[1000]), float(w.arrival_s[2250])
    got = {}
    for policy in ("power_of_two", "class_split@0.3"):  # the oracle: creative on its own replicas
        counts, steps, ks, pushes = router_composition.sample_run(
            w, pre, SimConfig(p, 8, policy), t_lo, t_hi
        )
        assert pushes > 0 and counts.shape == (steps.size, len(DEFAULT_MIX))
        assert np.all(counts.sum(axis=1) > 0) and np.all(steps > 0) and np.all(ks >= 0)
        got[policy] = router_composition.summarise(counts, steps, ks)
        bins = got[policy]["bins"]
        assert sum(b["replica_fraction"] for b in bins) == pytest.approx(1.0)
        assert sum(b["creative_fraction_here"] for b in bins) == pytest.approx(1.0)

    def pure(policy: str) -> float:  # creative requests on replicas at least 80 % creative
        return sum(
            b["creative_fraction_here"]
            for b in got[policy]["bins"]
            if b["creative_share"][0] >= 0.8
        )

    assert pure("class_split@0.3") > 0.9 and pure("power_of_two") < 0.5


def test_command_line_writes_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_composition, "RESULTS", tmp_path)
    path = router_composition.main(
        [
            "--decode-replicas",
            "4",
            "--requests",
            "800",
            "--policies",
            "power_of_two",
            "--label",
            "t",
            "--engine-slo",
        ]
    )
    report = json.loads(path.read_text())
    assert set(report["policies"]) == {"power_of_two"} and report["args"]["engine_slo"]
    for r in report["policies"].values():
        assert set(r["step_ms_seen_by_class"]) == {c.name for c in DEFAULT_MIX}
        b = r["batch_percentiles"]
        assert 0 < b["p1"] <= b["p50"] <= b["p99"]

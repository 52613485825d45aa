"""The pool's capacity within a TPOT SLO: what it reduces to, how it moves with the SLO, and
that the simulator's pool holds its requests within the SLO below it and not above it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from bench import slo_capacity as slo_capacity_cli
from bench.routersim.capacity import full_batch, kv_batch, saturation_rps
from bench.routersim.metrics import measure
from bench.routersim.prefill import prefill_replicas_for, simulate_prefill
from bench.routersim.profiles import cpu_profile, h200_profile
from bench.routersim.sim import SimConfig, simulate_decode
from bench.routersim.slo_capacity import best_within, slo_capacity
from bench.routersim.workload import DEFAULT_MIX, generate


def test_a_generous_slo_leaves_the_throughput_capacity() -> None:
    p = h200_profile()
    got = slo_capacity(p, DEFAULT_MIX, 10, 1.0)
    assert got.mixed_rps == pytest.approx(saturation_rps(p, DEFAULT_MIX, 10))
    assert got.mixed_batch == kv_batch(p, DEFAULT_MIX)
    assert sum(got.split_replicas.values()) == pytest.approx(1.0)


def test_capacity_grows_with_the_slo_and_keeps_every_member_within_it() -> None:
    p = h200_profile()
    caps = [slo_capacity(p, DEFAULT_MIX, 10, slo) for slo in (0.014, 0.016)]
    for a, b in itertools.pairwise(caps):
        assert a.split_rps <= b.split_rps and a.mixed_rps <= b.mixed_rps
    assert caps[0].mixed_rps < saturation_rps(p, DEFAULT_MIX, 10)
    best = best_within(p, DEFAULT_MIX, 0.016)
    assert best is not None and best.full.tpot_s <= 0.016 and best.guarded
    assert best.full == full_batch(p, DEFAULT_MIX, caps[1].mixed_batch, 0.016)


def test_an_slo_below_one_tokens_step_has_no_capacity() -> None:
    """One token alone takes 10 ms; a copy request emits at most ~3.5 tokens a step (4 drafts
    at 0.85, whose 4 rounds lengthen the step to ~16 ms), ~4.5 ms a token at best: no batch
    keeps to 3 ms, and at 5 ms only copy requests alone do."""
    p = h200_profile()
    got = slo_capacity(p, DEFAULT_MIX, 10, 0.003)
    assert got.rps == 0.0 and got.mixed_batch == 0 and got.split_replicas == {}
    assert best_within(p, DEFAULT_MIX, 0.003) is None
    copy_only = slo_capacity(p, DEFAULT_MIX, 10, 0.005)
    assert copy_only.split_batches["code_copy"] > 0 and copy_only.rps == 0.0


def test_splitting_by_class_pays_where_drafts_are_free() -> None:
    """With n-gram drafting (no rounds; the CPU profile) a mixed batch within 100 ms holds few
    requests, while copy requests alone draft deep: the split serves far more. Mixed, engines
    that draft for throughput keep more within than guarded ones: copy requests that draft
    leave the batch sooner."""
    p = cpu_profile()
    got = slo_capacity(p, DEFAULT_MIX, 2, 0.1)
    assert got.split_rps > 1.2 * got.mixed_rps
    assert got.split_batches["code_copy"] > got.split_batches["creative"]
    mixed = best_within(p, DEFAULT_MIX, 0.1)
    assert mixed is not None and not mixed.guarded


@pytest.mark.timeout(240)
def test_the_simulated_pool_keeps_to_the_slo_below_its_capacity_and_not_above() -> None:
    """Guarded engines under power of two: at 0.9 of the capacity within 16 ms nearly every
    request meets it; at 1.1 of it most miss (the cliff is that sharp: BENCHMARKS)."""
    p, d, slo = h200_profile(), 4, 0.016  # few replicas: the run reaches a steady state
    within = slo_capacity(p, DEFAULT_MIX, d, slo).rps
    met = []
    for share in (0.9, 1.1):
        w = generate(6000, share * within, DEFAULT_MIX, length_scale=p.length_scale, seed=4)
        pre = simulate_prefill(w, p, prefill_replicas_for(w, p), seed=4)
        cfg = SimConfig(p, d, "power_of_two", tpot_slo_s=slo, engine_tpot_slo_s=slo, seed=4)
        out = simulate_decode(w, pre, cfg)
        assert np.all(np.isfinite(out.finish_s))
        m = measure(w, DEFAULT_MIX, pre.first_token_s, out.finish_s, p.ttft_slo_s, slo)
        met.append(m.slo_attainment)
    assert met[0] > 0.95 and met[1] < 0.3


@pytest.mark.timeout(120)
def test_command_line_writes_the_table_and_the_check(tmp_path: Path) -> None:
    out = tmp_path / "cap.json"
    args = ["--slos", "0.016", "0.02", "--check-shares", "0.9", "--check-replicas", "2"]
    args += ["--check-requests", "400", "--check-policies", "power_of_two", "--seeds", "1"]
    assert slo_capacity_cli.main([*args, "--out", str(out)]) == out
    doc = json.loads(out.read_text())
    tight, loose = doc["capacities"]
    assert tight["rps"] < loose["rps"] and loose["loads_of_it"]["0.9"] == pytest.approx(0.9)
    assert tight["loads_of_it"]["0.9"] > 1.0  # the 0.9 is past what 16 ms allows
    (check,) = doc["checks"]
    assert check["share"] == 0.9 and check["finished"] == check["requests"]
    assert out.with_suffix(".png").stat().st_size > 10_000

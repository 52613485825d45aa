"""The step-time model (non-decreasing fits, refinement from the steps a replica runs) and the
acceptance estimates adaptive speculation reads."""

from __future__ import annotations

import itertools
import math
import random
import time
from pathlib import Path

import pytest

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from decode.speculation import EMA, SpeculationPolicy
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from speculation.calibration import DEFAULT_ACCEPTANCE
from speculation.goodput import DraftBatch, StepCosts, choose_ks
from speculation.step_time import StepTimeModel, StepTimeTracker, isotonic
from tests.decode.engine_utils import make_request, run_all, slowest_tpot

TRUE = StepTimeModel(((1, 0.050), (4, 0.060), (8, 0.090), (16, 0.150)))


def test_isotonic_pools_dips_and_keeps_monotone_points() -> None:
    ok = ((1, 1.0), (2, 2.0), (4, 3.0))
    assert isotonic(ok) == ok
    fit = isotonic(((1, 1.0), (2, 3.0), (3, 1.0), (4, 4.0)))
    assert [t for _, t in fit] == [1.0, 2.0, 2.0, 4.0]  # the dip and its peak pooled to a mean
    rng = random.Random(0)
    noisy = [(n, n * 0.01 + rng.uniform(-0.02, 0.02)) for n in range(1, 60)]
    fit = isotonic(noisy)
    assert all(b[1] >= a[1] for a, b in itertools.pairwise(fit))
    assert sum(t for _, t in fit) == pytest.approx(sum(t for _, t in noisy))  # pools keep means
    assert [n for n, _ in fit] == [n for n, _ in noisy]


def test_tracker_corrects_a_stale_model_from_real_steps() -> None:
    stale = StepTimeModel(tuple((n, 3 * t) for n, t in TRUE.points))  # measured on a busy box
    tracker = StepTimeTracker(stale, refit_every=8)
    rng = random.Random(1)
    for _ in range(64):  # a replica running narrow steps only (1..4 tokens)
        n = rng.choice((1, 2, 4))
        tracker.observe(n, TRUE.predict(n) * rng.uniform(0.97, 1.03))
    m = tracker.model
    for n in (1, 2, 4):
        assert m.predict(n) == pytest.approx(TRUE.predict(n), rel=0.05)
    # never-seen wide steps keep the calibrated shape at today's level
    assert m.predict(16) == pytest.approx(TRUE.predict(16), rel=0.08)
    pts = [t for _, t in m.points]
    assert pts == sorted(pts)


def test_tracker_ignores_a_lone_spike_and_waits_for_enough_samples() -> None:
    tracker = StepTimeTracker(TRUE, refit_every=4, min_samples=3)
    for _ in range(3):
        tracker.observe(8, 10.0)
    tracker.observe(1, TRUE.predict(1))  # the 4th observation: refit
    assert tracker.model.predict(8) == pytest.approx(10.0)  # three samples: it is the truth now
    tracker = StepTimeTracker(TRUE, refit_every=4, min_samples=3)
    for i in range(16):
        tracker.observe(4, 5.0 if i == 7 else TRUE.predict(4))  # one GC pause among 16 steps
    assert tracker.model.predict(4) == pytest.approx(TRUE.predict(4))
    tracker = StepTimeTracker(TRUE, refit_every=4, min_samples=3)
    for _ in range(2):
        tracker.observe(8, 10.0)
        tracker.observe(4, TRUE.predict(4))
    assert tracker.model.predict(8) == pytest.approx(TRUE.predict(8))  # 2 samples: not enough


@pytest.mark.timeout(300)
def test_engine_learns_its_step_time_while_serving(tiny_folder: Path) -> None:
    """An adaptive engine handed a model far too slow ends up with one near its real steps."""
    draft = DraftSpec(kind=DraftKind.NGRAM, num_speculative_tokens=3)
    cfg = DecodeEngineConfig(
        "tiny", ModelSpec(str(tiny_folder)), draft, num_blocks=64, max_batch_size=4
    )
    engine = DecodeEngine(cfg)
    try:
        spec = engine.speculation
        assert spec is not None and spec.tracker is not None
        measured = spec.tracker.base
        slow = StepTimeModel(tuple((n, 1000 * t) for n, t in measured.points))
        spec.tracker = StepTimeTracker(slow)
        sp = SamplingParams(temperature=0.0, max_tokens=48)
        steps, t0 = engine.steps, time.perf_counter()
        run_all(engine, [make_request([5, 6, 7, 5, 6, 7, 5, 6] * 2, sp) for _ in range(4)])
        served_s = (time.perf_counter() - t0) / (engine.steps - steps)  # a step's mean wall time
        learned = spec.step_time
        assert learned is not None and learned is spec.tracker.model
        # The real steps won: the seed said 1000x the start-up measurement; what was learned is
        # nearer, by ratio, to the mean wall time of the steps this run took than to the seed,
        # whatever the machine's load (a served step is also the engine's Python around the
        # forward the tracker times, and the first ones run cold).
        off = abs(math.log(learned.predict(4) / served_s))
        assert off < abs(math.log(slow.predict(4) / served_s)) / 2
    finally:
        engine.close()


def test_a_request_without_a_probe_starts_from_the_replica_prior() -> None:
    """One lucky draft does not read as certain acceptance; the prior follows what the
    replica's requests accept, slowly; a probe, when there is one, is the starting point."""
    policy = SpeculationPolicy(4, TRUE)
    r = make_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8))
    assert policy.estimate(r) == DEFAULT_ACCEPTANCE
    policy.learn(r, drafted=1, accepted=1)
    assert r.acceptance_estimate == pytest.approx((1 - EMA) * DEFAULT_ACCEPTANCE + EMA)
    for _ in range(300):  # the replica's requests accept 10 %
        policy.learn(make_request([1], SamplingParams()), drafted=10, accepted=1)
    assert policy.prior == pytest.approx(0.1, abs=0.03)
    fresh = make_request([1, 2, 3], SamplingParams())
    assert policy.estimate(fresh) == policy.prior
    probed = make_request([1, 2, 3], SamplingParams())
    probed.acceptance_estimate = 0.8  # prefill's probe
    policy.learn(probed, drafted=4, accepted=4)
    assert probed.acceptance_estimate == pytest.approx((1 - EMA) * 0.8 + EMA)


@pytest.mark.timeout(300)
def test_an_engine_with_a_tpot_slo_drafts_no_one_past_it(tiny_folder: Path) -> None:
    """``speculation_tpot_slo_s`` reaches the engine's adaptive speculation: at every step, the
    speculation lengths it would run keep every request's time per output token within the
    step without drafts (the SLO here is below any step, and the guard may cost any goodput),
    although throughput alone would have the likely request draft beside the unlikely one."""
    draft = DraftSpec(kind=DraftKind.NGRAM, num_speculative_tokens=3)
    cfg = DecodeEngineConfig(
        "tiny",
        ModelSpec(str(tiny_folder)),
        draft,
        num_blocks=64,
        max_batch_size=4,
        speculation_tpot_slo_s=1e-4,  # below any step: drafts may not lengthen anyone's TPOT
        speculation_tpot_slo_max_loss=1.0,  # whatever it costs the step's goodput
    )
    engine = DecodeEngine(cfg)
    try:
        spec = engine.speculation
        assert spec is not None and spec.tpot_slo_s == 1e-4 and spec.tpot_slo_max_loss == 1.0
        model = StepTimeModel.linear(0.010, 0.002)
        spec.tracker = StepTimeTracker(model, refit_every=10**9)
        sp = SamplingParams(temperature=0.0, max_tokens=24)
        likely, unlikely = (make_request([5, 6, 7, 5, 6, 7, 5, 6] * 3, sp) for _ in range(2))
        likely.acceptance_estimate, unlikely.acceptance_estimate = 0.95, 0.01
        for r in (likely, unlikely):
            engine.add(r, None)
        guarded = 0
        while engine.has_work:
            engine.step()
            s = engine.routing_stats()
            if s.running < 2:
                continue
            alphas, base = list(s.alphas), model.predict(s.running)
            assert slowest_tpot(alphas, list(s.ks), model) <= base * (1 + 1e-12)
            guarded += (
                slowest_tpot(alphas, choose_ks(DraftBatch(alphas, 3), StepCosts(model)), model)
                > base
            )
        assert guarded > 0  # throughput alone would have pushed the unlikely request
    finally:
        engine.close()

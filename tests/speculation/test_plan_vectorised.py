"""The vectorised planner grants exactly what the one-level-at-a-time planner granted, on
random batches, step-time curves (with steps of their own), budgets, tree widths, draft rounds
and TPOT guards."""

from __future__ import annotations

import random

import numpy as np
import pytest

from speculation.goodput import DraftBatch, StepCosts, TpotGuard, choose_ks
from speculation.step_time import StepTimeModel
from tests.speculation.reference_plan import reference_choose_ks


def _model(rng: random.Random) -> StepTimeModel:
    xs = sorted(rng.sample(range(1, 600), rng.randint(1, 7)))
    t, pts = rng.uniform(0.002, 0.05), []
    for x in xs:
        t += rng.choice([0.0, rng.uniform(0.0, 0.01)])  # flat runs and jumps: GEMM tiles
        pts.append((x, t))
    return StepTimeModel(tuple(pts))


@pytest.mark.parametrize("seed", range(4))
def test_the_vectorised_planner_equals_the_heap_planner(seed: int) -> None:
    rng = random.Random(seed)
    differ = 0
    for _ in range(150):
        n = rng.randint(1, 40)
        model = _model(rng)
        alphas = [rng.choice([0.0, 1.0, rng.random(), round(rng.random(), 1)]) for _ in range(n)]
        caps: int | list[int] = (
            rng.randint(0, 6) if rng.random() < 0.5 else [rng.randint(0, 6) for _ in range(n)]
        )
        widths = [rng.choice([1, 1, 2, 4]) for _ in range(n)] if rng.random() < 0.4 else None
        payers = [rng.random() < 0.6 for _ in range(n)] if rng.random() < 0.3 else None
        budget = rng.choice([None, rng.randint(0, 5 * n)])
        fixed = rng.choice([0, rng.randint(0, 300)])
        per_draft = rng.choice([None, rng.uniform(0.0, 0.004)])
        round_s = rng.choice([0.0, rng.uniform(0.0, 0.01)])
        paid = rng.randint(0, 3)
        slo = rng.choice([None, rng.uniform(0.001, 0.08)])
        loss = rng.choice([1.0, 0.1, 0.0])
        want = reference_choose_ks(
            alphas, model, caps, budget, fixed, per_draft, widths, round_s, paid, payers, slo, loss
        )
        got = choose_ks(
            DraftBatch(alphas, caps, widths, payers),
            StepCosts(model, budget, fixed, per_draft, round_s, paid),
            TpotGuard(slo, loss),
        )
        assert got == want, (alphas, caps, widths, payers, budget, fixed, per_draft, round_s)
        differ += got != [0] * n
    assert differ > 30  # the cases exercise drafting, not only its absence


def test_predict_many_is_predict_bit_for_bit() -> None:
    rng = random.Random(0)
    for _ in range(50):
        model = _model(rng)
        tokens = np.arange(0, 1200)
        want = [model.predict(int(t)) for t in tokens]
        assert model.predict_many(tokens).tolist() == want

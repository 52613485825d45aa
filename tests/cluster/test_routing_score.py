"""The pure routing maths: what a placement costs, scalar and vectorised, and the stats it reads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cluster.routing.score import (
    ReplicaStep,
    ReplicaSteps,
    StepTable,
    granted_k,
    placement,
    placement_outlook,
)
from speculation.goodput import DraftBatch, StepCosts, choose_ks, expected_tokens
from speculation.routing_stats import (
    ReplicaLoad,
    RoutingStats,
    SpeculationState,
    collect_routing_stats,
)
from speculation.step_time import StepTimeModel

MODEL = StepTimeModel.linear(0.010, 0.0005)  # 10 ms + 0.5 ms per scored token


def test_granted_k_takes_every_draft_whose_gain_beats_the_threshold() -> None:
    theta = np.array([0.0, 0.5, 0.6, 0.85, 2.0])
    assert granted_k(0.85, 4, theta).tolist() == [4, 4, 3, 0, 0]  # 0.85^4 = 0.522, ^3 = 0.614
    assert granted_k(0.3, 4, np.array([0.05, 0.1, 0.3])).tolist() == [2, 1, 0]


@pytest.mark.parametrize("per_draft_s", [None, 0.0015])
def test_granted_k_agrees_with_choose_ks_on_a_batch(per_draft_s: float | None) -> None:
    """Adding one request to a batch: the k the router predicts is what choose_ks grants it,
    also where the replica has learned that a draft token costs more than its model says."""
    batch = [0.6] * 12
    s = collect_routing_stats(
        batch,
        choose_ks(DraftBatch(batch, 4), StepCosts(MODEL, per_draft_s=per_draft_s)),
        ReplicaLoad(queued=0, free_blocks=100, num_blocks=100, block_size=16, max_batch_size=64),
        SpeculationState(k_max=4, adaptive=True, step_time=MODEL, draft_token_s=per_draft_s or 0.0),
    )
    grants = []
    for alpha in (0.2, 0.6, 0.9):
        replica = ReplicaStep(s.step_tokens, s.tpot_weight, s.step_emitted, True, 0, 0.0)
        predicted = placement(
            alpha, 4, dataclasses.replace(replica, draft_token_s=s.draft_token_s), MODEL
        )
        granted = choose_ks(
            DraftBatch([*batch, alpha], 4), StepCosts(MODEL, per_draft_s=per_draft_s)
        )[-1]
        assert abs(predicted.k - granted) <= 1, (alpha, predicted.k, granted)
        grants.append(predicted.k)
    if per_draft_s is not None:  # the dearer draft buys less than the model alone would
        cheap = [
            placement(
                a, 4, ReplicaStep(s.step_tokens, s.tpot_weight, s.step_emitted, True, 0, 0.0), MODEL
            ).k
            for a in (0.2, 0.6, 0.9)
        ]
        assert sum(grants) < sum(cheap), (grants, cheap)


def test_placement_prices_own_tpot_and_the_slowdown_of_others() -> None:
    replica = ReplicaStep(20, 10.0, 30.0, adaptive=False, step_max_k=4, draft_round_s=0.002)
    p = placement(0.85, 4, replica, model=MODEL)
    step = 0.010 + 0.0005 * (20 + 5) + 0.002 * 4
    before = 0.010 + 0.0005 * 20 + 0.002 * 4
    assert p.k == 4  # pinned
    assert p.tpot_s == pytest.approx(step / expected_tokens(0.85, 4))
    assert p.slowdown_s == pytest.approx((step - before) * 10.0)
    assert p.cost_s == pytest.approx(p.tpot_s + 2.0 * p.slowdown_s)


def test_a_longer_speculation_adds_draft_rounds_for_everyone() -> None:
    """A request that drafts beyond the batch's longest speculation adds rounds to the step."""
    short = placement(0.9, 4, ReplicaStep(20, 10.0, 30.0, False, 0, 0.002), MODEL)
    long = placement(0.9, 4, ReplicaStep(20, 10.0, 30.0, False, 4, 0.002), MODEL)
    assert short.slowdown_s - long.slowdown_s == pytest.approx(4 * 0.002 * 10.0)


def test_vectorised_costs_equal_the_scalar_ones() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, 50).astype(float)
    weight = rng.random(50) * 40
    emitted = rng.random(50) * 200
    adaptive = rng.random(50) < 0.7
    max_k = rng.integers(0, 5, 50).astype(float)
    rounds = np.full(50, 0.0015)
    per_draft = np.where(rng.random(50) < 0.5, 0.0, rng.random(50) * 0.003)
    width = rng.integers(1, 5, 50).astype(float)  # draft-tree widths, 1: chains
    for alpha in (0.1, 0.5, 0.95):
        replicas = ReplicaSteps(tokens, weight, emitted, adaptive, max_k, rounds, per_draft)
        got = placement_outlook(alpha, 4, replicas, StepTable.of(MODEL), width)
        want = [
            placement(
                alpha, 4, ReplicaStep(int(t), w, e, bool(a), int(m), 0.0015, c), MODEL, int(d)
            )
            for t, w, e, a, m, c, d in zip(
                tokens, weight, emitted, adaptive, max_k, per_draft, width, strict=True
            )
        ]
        np.testing.assert_allclose(got.cost_s, [p.cost_s for p in want], rtol=1e-9)
        np.testing.assert_allclose(got.tpot_s, [p.tpot_s for p in want], rtol=1e-9)
        assert got.k.tolist() == [p.k for p in want]


def test_a_tree_level_must_pay_for_its_width() -> None:
    """On the same replica, a tree 4 wide is granted fewer levels than a chain, and a level
    puts 4 tokens in the step."""
    args = (0.8, 4, ReplicaStep(60, 20.0, 10.0, True, 2, 0.0, 0.0), MODEL)  # theta: 0.125 a token
    chain, tree = placement(*args), placement(*args, width=4)
    assert (chain.k, tree.k) == (4, 3)  # 0.8^4 > 0.125; 0.8^3 > 4 * 0.125 > 0.8^4
    pinned = (0.7, 4, ReplicaStep(60, 20.0, 40.0, False, 2, 0.0, 0.0), MODEL)
    step_chain = MODEL.predict(61 + 4)
    step_tree = MODEL.predict(61 + 16)
    assert placement(*pinned).tpot_s == pytest.approx(step_chain / expected_tokens(0.7, 4))
    assert placement(*pinned, width=4).tpot_s == pytest.approx(step_tree / expected_tokens(0.7, 4))


def test_routing_stats_survive_the_trip_through_a_dict() -> None:
    s = collect_routing_stats(
        [0.3, 0.9],
        [0, 3],
        ReplicaLoad(queued=2, free_blocks=7, num_blocks=9, block_size=16, max_batch_size=8),
        SpeculationState(
            k_max=4,
            adaptive=True,
            step_time=MODEL,
            draft_round_s=0.001,
            draft_token_s=0.0021,
            tree_width=3,
        ),
        now=5.0,
    )
    assert (s.running, s.step_tokens, s.step_max_k) == (2, 5, 3)  # (1 + 0) + (1 + 3)
    assert s.tpot_weight == pytest.approx(1 + 1 / expected_tokens(0.9, 3))
    back = RoutingStats.from_dict(s.to_dict())
    assert back == s and back.step_time_model() == MODEL
    with pytest.raises(ValueError, match="version"):
        RoutingStats.from_dict({**s.to_dict(), "version": 99})
    with pytest.raises(ValueError, match="malformed"):
        RoutingStats.from_dict({k: v for k, v in s.to_dict().items() if k != "queued"})


@pytest.mark.parametrize(
    "points",
    [((4, 0.05),), ((1, 0.04), (8, 0.1), (32, 0.2)), ((1, 0.01), (4096, 0.5))],
)
def test_predict_many_is_predict_over_an_array(points: tuple[tuple[int, float], ...]) -> None:
    model = StepTimeModel(points)
    tokens = np.arange(0, 5000, 7)
    want = [model.predict(int(t)) for t in tokens]
    np.testing.assert_allclose(model.predict_many(tokens), want, rtol=1e-12)
    np.testing.assert_allclose(StepTable.of(model, 5000).at(tokens), want, rtol=1e-12)

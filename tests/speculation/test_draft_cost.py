"""The cost of a draft token, learned from observed decode steps, and how adaptive speculation
uses it."""

from __future__ import annotations

import random

import pytest

from speculation.draft_cost import DraftCost
from speculation.goodput import DraftBatch, StepCosts, choose_ks
from speculation.step_time import StepTimeModel


def test_draft_cost_is_the_slope_of_step_time_in_drafts_per_batch_size() -> None:
    cost = DraftCost()
    rng = random.Random(0)
    for _ in range(200):
        d = rng.randint(0, 20)
        cost.observe(32, d, 0.17 + 0.0033 * d + rng.gauss(0, 0.005))
        d = rng.randint(0, 4)
        cost.observe(2, d, 0.05 + 0.0005 * d + rng.gauss(0, 0.001))
    assert cost.per_draft(32) == pytest.approx(0.0033, rel=0.25)
    assert cost.per_draft(31) == cost.per_draft(32)  # one batch-size group
    assert cost.per_draft(2) == pytest.approx(0.0005, abs=0.0004)
    assert cost.per_draft(8) is None  # never seen


def test_draft_cost_is_unknown_without_enough_steps_or_spread() -> None:
    cost = DraftCost()
    for _ in range(100):
        cost.observe(16, 0, 0.1)  # speculation off: no spread in drafts
    assert cost.per_draft(16) is None
    cost = DraftCost()
    for d in (0, 5, 10):
        cost.observe(16, d, 0.1 + 0.01 * d)
    assert cost.per_draft(16) is None  # three steps are not enough


def test_speculation_charges_the_learned_draft_cost_when_it_is_higher() -> None:
    """The model's slope says drafts are nearly free; steps say otherwise."""
    flat = StepTimeModel(((1, 0.05), (32, 0.17), (64, 0.18)))  # 0.3 ms per token past 32
    alphas = [0.55] * 32
    assert sum(choose_ks(DraftBatch(alphas, 4), StepCosts(flat))) > 0
    assert sum(choose_ks(DraftBatch(alphas, 4), StepCosts(flat, per_draft_s=0.0033))) == 0
    assert choose_ks(DraftBatch(alphas, 4), StepCosts(flat, per_draft_s=0.0001)) == choose_ks(
        DraftBatch(alphas, 4), StepCosts(flat)
    )

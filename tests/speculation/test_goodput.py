from __future__ import annotations

import itertools
import random

import pytest

from decode.speculation import SpeculationPolicy
from models.sampling import SamplingParams
from speculation.goodput import (
    GUARD_MAX_LOSS,
    DraftBatch,
    StepCosts,
    TpotGuard,
    choose_ks,
    expected_tokens,
    goodput,
)
from speculation.step_time import StepTimeModel
from tests.decode.engine_utils import make_request, slowest_tpot, step_goodput


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_step_time_model_interpolates_and_extrapolates() -> None:
    m = StepTimeModel(((1, 0.040), (5, 0.060), (9, 0.100)))
    assert m.predict(1) == 0.040 and m.predict(0) == 0.040
    assert m.predict(3) == pytest.approx(0.050)
    assert m.predict(13) == pytest.approx(0.140)
    with pytest.raises(ValueError):
        StepTimeModel(((5, 0.1), (5, 0.2)))


def test_choose_ks_is_optimal_on_small_batches() -> None:
    """The greedy choice matches exhaustive search on every small case we try."""
    models = [
        StepTimeModel(((1, 0.046), (2, 0.047), (3, 0.050), (5, 0.074), (9, 0.086))),
        StepTimeModel.linear(0.010, 0.002),
        StepTimeModel.linear(0.001, 0.010),  # compute-bound: speculation never pays
    ]
    for model, alphas in itertools.product(models, [(0.9,), (0.8, 0.3), (0.95, 0.6, 0.1)]):
        ks = choose_ks(DraftBatch(alphas, 4), StepCosts(model))
        best = max(
            goodput(alphas, list(c), model) for c in itertools.product(range(5), repeat=len(alphas))
        )
        assert goodput(alphas, ks, model) == pytest.approx(best, rel=1e-9)


def test_speculation_switches_itself_off_when_compute_bound() -> None:
    # Step time proportional to tokens (a saturated replica): any draft only adds cost.
    model = StepTimeModel.linear(0.0, 0.01)
    assert choose_ks(DraftBatch([0.9] * 32, 8), StepCosts(model)) == [0] * 32
    # Memory-bound (flat) step: speculate, more for the predictable sequence.
    flat = StepTimeModel.linear(0.05, 0.0001)
    ks = choose_ks(DraftBatch([0.9, 0.2], 8), StepCosts(flat))
    assert ks[0] > ks[1] >= 0 and ks[0] == 8


def test_a_prompt_chunk_in_the_step_does_not_make_drafts_cheaper() -> None:
    """Drafts pay for themselves against the decodes' goodput, wherever the step runs: with a
    cost per token that is the same everywhere, a 500-token prompt chunk in the forward
    changes nothing (charging drafts the whole mixed step's goodput would grant many more)."""
    model = StepTimeModel.linear(0.040, 0.004)
    alphas = [0.3, 0.5, 0.7, 0.9]
    alone = choose_ks(DraftBatch(alphas, 4), StepCosts(model))
    assert choose_ks(DraftBatch(alphas, 4), StepCosts(model, fixed_tokens=500)) == alone
    assert sum(alone) < 4 * 4  # the low-acceptance requests get fewer drafts
    assert alone[0] <= alone[-1]


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_seeded_request_is_held_at_its_cap_where_drafts_depend_on_the_step(
    adaptive: bool,
) -> None:
    """With a step-dependent drafter (EAGLE), a client-seeded sampled request speculates its
    cap whatever the batch, the goodput and the budget say; the others are chosen as usual."""
    saturated = StepTimeModel.linear(0.0, 0.01)  # any draft only adds cost: adaptive gives 0
    policy = SpeculationPolicy(4, saturated if adaptive else None, step_dependent=True)
    seeded = SamplingParams(temperature=0.7, max_tokens=50, seed=3, seeded=True)
    unseeded = SamplingParams(temperature=0.7, max_tokens=50, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=50, seeded=True)
    reqs = [make_request([5, 6, 7], sp) for sp in (unseeded, seeded, greedy, seeded)]
    budget = 4 + 3  # one token per request and three drafts
    ks = policy.choose(reqs, [4, 4, 4, 2], 0, budget)
    assert ks[1] == 4 and ks[3] == 2  # held at their caps, past the budget
    assert ks[0] == ks[2] == 0  # the budget is spent, and drafts do not pay when saturated
    free = SpeculationPolicy(4, saturated if adaptive else None, step_dependent=False)
    assert sum(free.choose(reqs, [4, 4, 4, 2], 0, budget)) <= 3  # no drafter quirk: no hold


def test_a_draft_tree_is_priced_by_its_width() -> None:
    """A tree level costs its width in tokens: where tokens cost time, a greedy request on a
    replica drafting trees 4 wide gets fewer levels than a chain would at the same acceptance,
    and none where four tokens per level cannot pay; where tokens are nearly free, both go deep.
    The token budget counts a tree's tokens too."""
    steep = StepTimeModel.linear(0.010, 0.002)
    flat = StepTimeModel.linear(0.010, 0.00001)
    # 1 + .7 + .49 + .343 over 12 + 3 * 2 ms beats k=2 and k=4; a tree level costs 8 ms
    assert choose_ks(DraftBatch([0.7], 4), StepCosts(steep)) == [3]
    assert choose_ks(DraftBatch([0.7], 4, widths=[4]), StepCosts(steep)) == [1]
    assert choose_ks(DraftBatch([0.3], 4, widths=[4]), StepCosts(steep)) == [0]
    assert choose_ks(DraftBatch([0.7], 4, widths=[4]), StepCosts(flat)) == [4]
    assert choose_ks(DraftBatch([0.9], 4, widths=[4]), StepCosts(flat, token_budget=9)) == [2]
    greedy = make_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50))
    sampled = make_request([1, 2, 3], SamplingParams(temperature=0.8, max_tokens=50))
    pinned = SpeculationPolicy(4, None, tree_width=4)
    # pinned: a budget of 2 sequences + 10 tokens fits two tree levels, then the chain's four
    assert pinned.choose([greedy, sampled], [4, 4], 0, 12) == [2, 2]


@pytest.mark.parametrize("seed", range(40))
def test_a_tpot_slo_keeps_drafts_from_pushing_anyone_past_it(seed: int) -> None:
    """With an SLO kept at any cost, every sequence's time per output token in the chosen step
    stays within it, or within the step without drafts where that is longer already; drafts
    that fit are still taken, and where throughput alone already keeps everyone within it
    nothing changes. With the default bound on what it may cost, the step keeps to the SLO
    where that gives up at most a tenth of the goodput, and drafts for throughput elsewhere."""
    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    alphas = [rng.choice([rng.uniform(0.05, 0.4), rng.uniform(0.7, 0.95)]) for _ in range(n)]
    model = StepTimeModel.linear(0.010, rng.uniform(2e-5, 2e-4))
    round_s = rng.choice([0.0, 0.0015])
    slo = model.predict(n) * rng.uniform(0.9, 1.6)
    free = choose_ks(DraftBatch(alphas, 4), StepCosts(model, round_s=round_s))
    held = choose_ks(
        DraftBatch(alphas, 4), StepCosts(model, round_s=round_s), TpotGuard(slo_s=slo, max_loss=1.0)
    )
    limit = max(slo, model.predict(n))
    assert slowest_tpot(alphas, held, model, round_s) <= limit * (1 + 1e-12)
    if slowest_tpot(alphas, free, model, round_s) <= limit:
        assert held == free
    assert goodput(alphas, held, model) >= goodput(alphas, [0] * n, model) * (1 - 1e-12)
    bounded = choose_ks(
        DraftBatch(alphas, 4), StepCosts(model, round_s=round_s), TpotGuard(slo_s=slo)
    )
    kept = step_goodput(alphas, held, model, round_s) / step_goodput(alphas, free, model, round_s)
    assert bounded == (held if kept >= 1 - GUARD_MAX_LOSS else free)


def test_an_slo_stops_drafts_that_would_make_a_creative_request_miss_it() -> None:
    """The H200 case behind the guard: copy requests (0.85) beside creative ones (0.3) on a
    step of ~16 ms with 1.45 ms draft rounds. Throughput alone drafts the copy requests and
    pushes the creative ones to the longer step; a 16 ms SLO keeps the step drafting only as far
    as the creative requests stay within it, and a generous SLO changes nothing."""
    model = StepTimeModel.linear(0.010, 0.035e-3)
    alphas = [0.85] * 60 + [0.3] * 120
    free = choose_ks(DraftBatch(alphas, 4), StepCosts(model, round_s=0.00145))
    assert max(free) >= 1 and slowest_tpot(alphas, free, model, 0.00145) > 0.0175
    held = choose_ks(
        DraftBatch(alphas, 4), StepCosts(model, round_s=0.00145), TpotGuard(slo_s=0.0175)
    )
    assert slowest_tpot(alphas, held, model, 0.00145) <= 0.0175
    assert (
        choose_ks(DraftBatch(alphas, 4), StepCosts(model, round_s=0.00145), TpotGuard(slo_s=1.0))
        == free
    )


def test_the_speculation_policy_keeps_to_its_tpot_slo() -> None:
    """``SpeculationPolicy(tpot_slo_s=..., tpot_slo_max_loss=...)`` hands both to
    ``choose_ks``."""
    model = StepTimeModel.linear(0.010, 0.0005)
    reqs = [
        make_request([1, 2, 3], SamplingParams(temperature=0.8, max_tokens=50)) for _ in range(4)
    ]
    for r, a in zip(reqs, (0.95, 0.95, 0.95, 0.05), strict=True):
        r.acceptance_estimate = a
    free = SpeculationPolicy(4, model).choose(reqs, [4] * 4, 0, 4096)
    strict = SpeculationPolicy(4, model, tpot_slo_s=0.013, tpot_slo_max_loss=1.0)
    held = strict.choose(reqs, [4] * 4, 0, 4096)
    alphas = [0.95] * 3 + [0.05]
    assert sum(free) > 0 and slowest_tpot(alphas, free, model, 0.0) > 0.013
    assert slowest_tpot(alphas, held, model, 0.0) <= 0.013
    assert sum(held) > 0  # drafts that fit (12 ms without, 0.5 ms a token) are taken
    assert held != free
    # keeping to it here gives up more than a tenth of the step's goodput: by default the
    # policy then drafts for throughput
    assert step_goodput(alphas, held, model) < (1 - GUARD_MAX_LOSS) * step_goodput(
        alphas, free, model
    )
    assert SpeculationPolicy(4, model, tpot_slo_s=0.013).choose(reqs, [4] * 4, 0, 4096) == free

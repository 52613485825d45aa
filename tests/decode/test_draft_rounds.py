"""Draft rounds: a model drafter times its sequential forwards, the replica publishes what a
round costs, and the step-time model it learns leaves the rounds out."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from decode.spec_step import decode_step
from decode.speculation import SpeculationPolicy
from models.eagle import save_random_eagle
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from speculation.draft_cost import DraftRounds
from speculation.goodput import DraftBatch, StepCosts, choose_ks
from speculation.step_time import StepTimeModel
from tests.decode.engine_utils import make_request, run_all


def test_rounds_average_what_they_took_and_hand_over_the_time_spent_once() -> None:
    rounds = DraftRounds(ema=0.5)
    assert rounds.round_s == 0.0 and rounds.take_spent() == 0.0
    rounds.observe(0.004)
    assert rounds.round_s == pytest.approx(0.004)  # the first round sets the average
    rounds.observe(0.002)
    assert rounds.round_s == pytest.approx(0.003)
    assert rounds.take_spent() == pytest.approx(0.006)
    assert rounds.take_spent() == 0.0  # handed over once
    rounds.start()
    rounds.stop()
    assert rounds.rounds == 3 and rounds.take_spent() >= 0.0
    with pytest.raises(RuntimeError, match="without start"):
        rounds.stop()


def test_the_step_model_learns_the_target_without_the_rounds() -> None:
    """Steps of 10 ms of target plus 0.5 ms per draft token, and 2 ms of rounds per draft
    token: the step-time model and the draft-token cost learn the target's share only."""
    policy = SpeculationPolicy(4, StepTimeModel.linear(0.010, 0.0))
    for i in range(40):
        drafts = i % 5
        target = 0.010 + 0.0005 * drafts
        policy.observe(4, 4 + drafts, target + 0.002 * drafts, 0.002 * drafts)
    model = policy.step_time
    assert model is not None
    assert model.predict(6) == pytest.approx(0.011, rel=0.05)
    assert policy.draft_cost.per_draft(4) == pytest.approx(0.0005, rel=0.05)


def test_adaptive_speculation_pays_each_round_once_per_step() -> None:
    """One request, alpha 0.8, a flat 10 ms step: free drafts go to the cap; at 5 ms a round
    goodput peaks at 2 levels (2.44 tokens in 20 ms); rounds that held requests run anyway are
    free again."""
    flat = StepTimeModel.linear(0.010, 0.0)
    assert choose_ks(DraftBatch([0.8], 4), StepCosts(flat)) == [4]
    assert choose_ks(DraftBatch([0.8], 4), StepCosts(flat, round_s=0.005)) == [2]
    assert choose_ks(DraftBatch([0.8], 4), StepCosts(flat, round_s=0.005, paid_rounds=4)) == [4]
    # two requests: the second's levels ride on the first's rounds
    assert choose_ks(DraftBatch([0.8, 0.8], 4), StepCosts(flat, round_s=0.005)) == [2, 2]


@pytest.fixture(scope="module")
def eagle_folder(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_eagle(tiny_folder, tmp_path_factory.mktemp("eagle"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("lookup_first", "tree_width"), [(False, 1), (True, 1), (False, 3)])
def test_an_eagle_replica_publishes_its_measured_round_cost(
    tiny_folder: Path, eagle_folder: Path, lookup_first: bool, tree_width: int
) -> None:
    """Chains, lookup first, and trees (one round per level): the replica publishes what a
    round took, and the width of the trees a greedy request would draft there."""
    draft = DraftSpec(
        DraftKind.EAGLE,
        model=ModelSpec(str(eagle_folder)),
        num_speculative_tokens=3,
        adaptive=False,  # k pinned at 3: three rounds a step
        lookup_first=lookup_first,
        tree_width=tree_width,
    )
    cfg = DecodeEngineConfig("t", ModelSpec(str(tiny_folder)), draft, num_blocks=64)
    engine = DecodeEngine(cfg)
    try:
        assert engine.routing_stats().draft_round_s == 0.0  # nothing timed yet
        sp = SamplingParams(temperature=0.0, max_tokens=12)
        run_all(engine, [make_request([7, 300, 12, 9000 + i, 44], sp) for i in range(2)])
        rounds = engine.drafter.rounds if engine.drafter is not None else None
        assert rounds is not None and rounds.rounds > 0
        published = engine.routing_stats()
        assert published.draft_round_s == rounds.round_s > 0.0
        assert published.tree_width == tree_width
    finally:
        engine.close()


@pytest.mark.timeout(300)
def test_an_ngram_replica_has_no_rounds(tiny_folder: Path) -> None:
    draft = DraftSpec(DraftKind.NGRAM, num_speculative_tokens=3, adaptive=False)
    cfg = DecodeEngineConfig("t", ModelSpec(str(tiny_folder)), draft, num_blocks=64)
    engine = DecodeEngine(cfg)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=12)
        run_all(engine, [make_request([5, 6, 7, 5, 6, 7, 5, 6], sp)])
        assert engine.drafter is not None and engine.drafter.rounds is None
        assert engine.routing_stats().draft_round_s == 0.0
    finally:
        engine.close()


def test_requests_drafted_by_lookup_pay_no_rounds() -> None:
    """Request 1 is drafted by prompt lookup (no rounds); request 0 by the model. At 5 ms a
    round on a flat 10 ms step the model's drafts do not pay, lookup's all do."""
    flat = StepTimeModel.linear(0.010, 0.0)
    assert choose_ks(
        DraftBatch([0.8, 0.8], 4, pays_rounds=[True, False]), StepCosts(flat, round_s=0.005)
    ) == [0, 4]
    assert choose_ks(DraftBatch([0.8, 0.8], 4), StepCosts(flat, round_s=0.005)) == [2, 2]


@pytest.mark.timeout(300)
def test_lookup_first_knows_which_requests_the_model_drafts(
    tiny_folder: Path, eagle_folder: Path
) -> None:
    draft = DraftSpec(
        DraftKind.EAGLE,
        model=ModelSpec(str(eagle_folder)),
        num_speculative_tokens=3,
        adaptive=False,
        lookup_first=True,
    )
    engine = DecodeEngine(
        DecodeEngineConfig("t", ModelSpec(str(tiny_folder)), draft, num_blocks=64)
    )
    try:
        drafter = engine.drafter
        assert drafter is not None
        sp = SamplingParams(temperature=0.0, max_tokens=30)
        copy = make_request([5, 6, 7, 8] * 6, sp)
        copy.output_token_ids.append(5)  # its text goes on repeating the prompt
        assert drafter.pays_rounds(copy)  # nothing proposed yet: the model would draft
        (proposal,) = drafter.propose([copy], [4])
        assert proposal.tokens == (6, 7, 8, 5)  # lookup, which runs no model
        assert not drafter.pays_rounds(copy)
        drafter.forget(copy.request_id)
        assert drafter.pays_rounds(copy)
    finally:
        engine.close()


@pytest.mark.timeout(300)
def test_a_request_granted_no_drafts_runs_no_draft_round(
    tiny_folder: Path, eagle_folder: Path
) -> None:
    """k = 0: the head is not run for a greedy request (nothing is verified; its catch-up waits
    for a step that drafts); a client-seeded sampled one is still offered a draft at its next
    position, so its tokens do not depend on the k the planner picked."""
    draft = DraftSpec(DraftKind.EAGLE, model=ModelSpec(str(eagle_folder)), adaptive=False)
    engine = DecodeEngine(DecodeEngineConfig("t", ModelSpec(str(tiny_folder)), draft))
    try:
        greedy = make_request([7, 300, 12, 44], SamplingParams(temperature=0.0, max_tokens=8))
        seeded = make_request(
            [7, 300, 12, 45], SamplingParams(temperature=1.0, max_tokens=8, seed=3, seeded=True)
        )
        for r in (greedy, seeded):
            engine.add(r, None)
        engine.step()  # the prompts: both now hold one output token, not yet in the KV
        drafter = engine.drafter
        assert drafter is not None and greedy.output_token_ids and seeded.output_token_ids
        fed = drafter.tokens_fed  # positions the head has run over
        (em,) = decode_step(engine.target, drafter, [greedy], [1], [0])
        assert drafter.tokens_fed == fed and em.num_drafted == 0 and len(em.tokens) == 1
        (em,) = decode_step(engine.target, drafter, [seeded], [1], [0])
        assert drafter.tokens_fed > fed and em.num_drafted == 1 and len(em.tokens) == 1
    finally:
        engine.close()

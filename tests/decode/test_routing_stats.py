"""What a decode engine publishes for the router, checked against its own state mid-run."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from speculation.calibration import Cell, calibrated, calibration_key
from speculation.goodput import expected_tokens
from speculation.routing_stats import ReplicaLoad, SpeculationState, collect_routing_stats
from tests.decode.engine_utils import make_request, run_all


@pytest.mark.timeout(300)
def test_routing_stats_describe_the_running_batch(tiny_folder: Path) -> None:
    draft = DraftSpec(kind=DraftKind.NGRAM, num_speculative_tokens=3)
    cfg = DecodeEngineConfig(
        "tiny", ModelSpec(str(tiny_folder)), draft, num_blocks=64, max_batch_size=2
    )
    engine = DecodeEngine(cfg)
    try:
        empty = engine.routing_stats()
        assert (empty.running, empty.queued, empty.free_blocks, empty.step_tokens) == (0, 0, 64, 0)
        assert empty.adaptive and empty.k_max == 3 and empty.step_time  # measured at start-up
        sp = SamplingParams(temperature=0.0, max_tokens=40)
        reqs = [make_request([5, 6, 7, 5, 6, 7, 5, 6] * 3, sp) for _ in range(3)]
        reqs[0].acceptance_estimate = 0.9
        for r in reqs:
            engine.add(r, None)
        while not all(r.output_token_ids for r in reqs[:2]):
            engine.step()
        s = engine.routing_stats()
        assert s.running == 2 and s.queued == 1  # one beyond max_batch_size waits
        assert s.free_blocks == engine.allocator.num_free < 64
        assert len(s.alphas) == len(s.ks) == 2 and s.alphas[0] == 0.9
        assert all(0 <= k <= 3 for k in s.ks) and s.step_max_k == max(s.ks)
        assert s.step_tokens == sum(1 + k for k in s.ks)
        weights = [1 / expected_tokens(a, k) for a, k in zip(s.alphas, s.ks, strict=True)]
        assert s.tpot_weight == pytest.approx(sum(weights))
        assert s.slowest_weight == pytest.approx(max(weights)) and empty.slowest_weight == 0
    finally:
        engine.close()


@pytest.mark.timeout(300)
def test_finished_requests_calibrate_the_next_ones_of_their_cell(tiny_folder: Path) -> None:
    draft = DraftSpec(kind=DraftKind.NGRAM, num_speculative_tokens=3)
    cfg = DecodeEngineConfig("tiny", ModelSpec(str(tiny_folder)), draft, num_blocks=64)
    engine = DecodeEngine(cfg)
    spec = engine.speculation
    assert spec is not None
    try:
        prompt = [5, 6, 7, 8, 9] * 6
        first = make_request(prompt, SamplingParams(temperature=0.0, max_tokens=40))
        run_all(engine, [first])
        drafted, accepted = first.stats.num_draft_tokens, first.stats.num_accepted_tokens
        assert drafted > 0
        cell = calibration_key(None, 0.0)  # colocated: no probe; greedy
        assert engine.routing_stats().calibration == (Cell(*cell, drafted, accepted),)
        prior = spec.prior
        greedy = make_request(prompt, SamplingParams(temperature=0.0, max_tokens=40))
        hot = make_request(prompt, SamplingParams(temperature=1.0, max_tokens=40))
        engine.add(greedy, None)
        engine.add(hot, None)
        engine.step()  # both start: the prompt step verifies nothing yet
        assert greedy.acceptance_estimate == pytest.approx(calibrated(drafted, accepted, prior))
        assert greedy.acceptance_estimate != pytest.approx(prior)
        assert hot.acceptance_estimate == pytest.approx(prior)  # its cell has seen nothing
    finally:
        engine.close()


def test_a_greedy_requests_draft_tree_counts_its_width_in_the_step() -> None:
    load = ReplicaLoad(queued=0, free_blocks=8, num_blocks=8, block_size=16, max_batch_size=4)
    spec = SpeculationState(k_max=4, adaptive=False, step_time=None)
    chains = collect_routing_stats([0.5, 0.5], [4, 3], load, spec)
    trees = collect_routing_stats([0.5, 0.5], [4, 3], load, spec, widths=[4, 1])
    assert (chains.step_tokens, trees.step_tokens) == (9, 2 + 16 + 3)

from __future__ import annotations

import torch

from models.acceptance import one_hot_overlap, overlap, probe_estimate
from models.ngram import ngram_lookup
from models.sampling import SamplingParams, Stream, derived_seed, probs_from_logits, sample_token


def test_greedy_rows_are_one_hot_at_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, 1.0]])
    p = probs_from_logits(
        logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    )
    assert p[0].tolist() == [0.0, 1.0, 0.0]
    assert torch.allclose(p[1], torch.softmax(logits[1], -1))


def test_temperature_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, [SamplingParams(top_k=2)])
    assert torch.allclose(p[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top-p keeps the smallest prefix whose mass reaches p: 0.5 + 0.3 >= 0.8
    p = probs_from_logits(logits, [SamplingParams(top_p=0.8)])
    assert torch.allclose(p[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = probs_from_logits(logits, [SamplingParams(top_p=0.81)])
    assert p[0, 2] > 0 and p[0, 3] == 0
    hot = probs_from_logits(logits, [SamplingParams(temperature=0.5)])
    assert hot[0, 0] > 0.5 and torch.isclose(hot.sum(), torch.tensor(1.0))


def test_seeded_draws_depend_only_on_seed_position_and_stream() -> None:
    p = torch.softmax(torch.randn(1000), -1)
    sp = SamplingParams(seed=42)
    a = [sample_token(p, sp, pos, Stream.SAMPLE) for pos in range(20)]
    b = [sample_token(p, sp, pos, Stream.SAMPLE) for pos in range(20)]
    assert a == b
    assert len(set(a)) > 5  # positions get different draws
    assert derived_seed(42, 3, Stream.SAMPLE) != derived_seed(42, 3, Stream.ACCEPT)
    assert derived_seed(42, 3, 0) != derived_seed(43, 3, 0)


def test_probe_overlap() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.0, 0.5], [0.0, 1.0, 0.0]])
    assert overlap(p, q).tolist() == [0.5, 0.0]
    assert one_hot_overlap(p, torch.tensor([1, -1])).tolist() == [0.5, 0.0]
    assert probe_estimate(torch.tensor([0.5, 0.0])) == 0.25
    assert probe_estimate(torch.tensor([])) is None


def test_ngram_lookup_prefers_longest_latest_match() -> None:
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_lookup(toks, 2, max_n=3) == [7, 8]  # latest occurrence of [1, 2, 3]
    assert ngram_lookup([5, 6, 7], 3) == []
    assert ngram_lookup([4, 4], 3) == [4]

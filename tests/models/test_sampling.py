from __future__ import annotations

import torch
from scipy.stats import chisquare

from models.acceptance import one_hot_overlap, overlap, probe_estimate
from models.ngram import ngram_lookup
from models.sampling import (
    SamplingParams,
    Stream,
    derived_seed,
    probs_from_logits,
    sample_rows,
    sample_token,
)


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


def test_counter_based_draws_follow_the_distribution_and_keep_greedy_rows_argmax() -> None:
    """sample_rows over many seeds (one row each) draws each token as often as its probability
    says (chi-square), never a token of probability 0; greedy rows take the argmax."""
    p = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    n = 20000
    params = [SamplingParams(seed=s) for s in range(n)]
    drawn = sample_rows(p.expand(n, -1), params, [7] * n, Stream.SAMPLE)
    counts = torch.bincount(drawn, minlength=5).double()
    assert counts[1] == 0
    keep = p > 0
    assert chisquare(counts[keep].numpy(), (n * p[keep]).double().numpy()).pvalue > 1e-3
    mixed = [SamplingParams(temperature=0.0, seed=3), SamplingParams(seed=3)]
    rows = torch.tensor([[0.1, 0.6, 0.3], [0.1, 0.6, 0.3]])
    a = sample_rows(rows, mixed, [0, 0], Stream.SAMPLE)
    assert a[0] == 1 and a.tolist() == sample_rows(rows, mixed, [0, 0], Stream.SAMPLE).tolist()

"""Workload construction and arrival times (pure, no server)."""

from __future__ import annotations

import itertools
import statistics

import pytest

from bench.copy_prompts import COPY_PROMPTS
from bench.load_client import Target, request_body
from bench.sharegpt import Conversation
from bench.workloads import (
    CREATIVE_PROMPTS,
    approx_tokens,
    bimodal_items,
    first_exchange,
    poisson_offsets,
    sharegpt_items,
    synthetic_items,
)


def test_approx_tokens_is_four_chars_per_token_rounded_up() -> None:
    assert approx_tokens("") == 1
    assert approx_tokens("abcd") == 1
    assert approx_tokens("abcde") == 2
    assert approx_tokens("x" * 400) == 100


def test_first_exchange_pairs_the_first_human_turn_with_the_answer() -> None:
    conv = Conversation("a", (("gpt", "hi"), ("human", "q1"), ("gpt", "a1"), ("human", "q2")))
    assert first_exchange(conv) == ("q1", "a1")
    assert first_exchange(Conversation("b", (("human", "q"),))) is None
    assert first_exchange(Conversation("c", (("human", "q"), ("human", "q again")))) is None


def test_sharegpt_items_filter_cap_and_sample_reproducibly() -> None:
    convs = [
        Conversation("ok", (("human", "p" * 40), ("gpt", "a" * 400))),  # 10 and 100 tokens
        Conversation("short-prompt", (("human", "hi"), ("gpt", "a" * 400))),
        Conversation("short-answer", (("human", "p" * 40), ("gpt", "ok"))),
        Conversation("long-prompt", (("human", "p" * 4100), ("gpt", "a" * 40))),
        Conversation("ok2", (("human", "q" * 80), ("gpt", "b" * 40))),  # 20 and 10 tokens
    ]
    items = sharegpt_items(convs, n=10, seed=0, max_tokens_cap=64)
    assert sorted((i.prompt[0], i.max_tokens) for i in items) == [("p", 64), ("q", 10)]
    assert all(i.kind == "sharegpt" for i in items)
    one = sharegpt_items(convs, n=1, seed=3)
    assert one == sharegpt_items(convs, n=1, seed=3)
    assert len(one) == 1 and one[0].max_tokens in (100, 10)


def test_synthetic_items_lengths_and_copy_class() -> None:
    plain = synthetic_items(
        50, input_len=20, output_len=10, range_ratio=0.5, copy_fraction=0.0, seed=1
    )
    assert all(i.kind == "synthetic" for i in plain)
    assert all(10 <= len(i.prompt.split()) <= 30 for i in plain)
    assert all(5 <= i.max_tokens <= 15 for i in plain)
    assert len({i.max_tokens for i in plain}) > 1  # lengths really vary
    fixed = synthetic_items(
        5, input_len=7, output_len=3, range_ratio=0.0, copy_fraction=0.0, seed=1
    )
    assert {(len(i.prompt.split()), i.max_tokens) for i in fixed} == {(7, 3)}
    copies = synthetic_items(8, 20, 10, 0.0, copy_fraction=1.0, seed=2)
    assert all(i.kind == "copy" and i.prompt in COPY_PROMPTS for i in copies)
    mixed = synthetic_items(200, 20, 10, 0.0, copy_fraction=0.25, seed=3)
    assert 30 <= sum(i.kind == "copy" for i in mixed) <= 70
    with pytest.raises(ValueError, match="copy_fraction"):
        synthetic_items(1, 20, 10, 0.0, copy_fraction=1.5, seed=0)


def test_poisson_offsets_start_at_zero_and_have_the_requested_rate() -> None:
    offsets = poisson_offsets(4000, rate=5.0, seed=7)
    assert offsets[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert min(gaps) >= 0.0
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.1)  # exponential: sd = mean
    assert offsets == poisson_offsets(4000, rate=5.0, seed=7)
    assert poisson_offsets(3, rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="positive"):
        poisson_offsets(3, rate=0.0, seed=0)


def test_bimodal_alternates_greedy_copy_and_sampled_creative_requests() -> None:
    items = bimodal_items(6, 32, seed=0)
    assert [i.kind for i in items] == ["copy", "creative"] * 3
    assert all(i.prompt in COPY_PROMPTS and i.temperature == 0.0 for i in items[::2])
    assert all(i.prompt in CREATIVE_PROMPTS and i.temperature == 1.0 for i in items[1::2])
    target = Target("m", "chat", 0.7, seed=None)
    assert [request_body(target, i, 0)["temperature"] for i in items[:2]] == [0.0, 1.0]
    assert request_body(target, synthetic_items(1, 8, 8, 0.0, 0.0, 0)[0], 0)["temperature"] == 0.7

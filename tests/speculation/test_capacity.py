"""A replica's capacity within a TPOT SLO: exact where it has a closed form (k pinned, linear
step time), larger for better-predicted traffic, bounded by KV and the batch size."""

from __future__ import annotations

import math

import pytest

from speculation.capacity import capacity_within_slo
from speculation.goodput import expected_tokens
from speculation.routing_stats import (
    ReplicaLoad,
    RoutingStats,
    SpeculationState,
    collect_routing_stats,
)
from speculation.step_time import StepTimeModel

BASE_S, PER_TOKEN_S = 0.010, 0.0004
MODEL = StepTimeModel.linear(BASE_S, PER_TOKEN_S)


def _stats(
    alphas: list[float],
    ks: list[int],
    adaptive: bool,
    free_blocks: int = 10_000,
    max_batch_size: int = 256,
    k_max: int = 4,
    step_time: StepTimeModel | None = MODEL,
    queued: int = 0,
) -> RoutingStats:
    load = ReplicaLoad(
        queued=queued,
        free_blocks=free_blocks,
        num_blocks=free_blocks + 8 * len(alphas),  # each running stream holds 8 blocks
        block_size=16,
        max_batch_size=max_batch_size,
    )
    return collect_routing_stats(
        alphas, ks, load, SpeculationState(k_max=k_max, adaptive=adaptive, step_time=step_time)
    )


@pytest.mark.parametrize(("alpha", "slo_s"), [(0.3, 0.03), (0.8, 0.03), (0.8, 0.02)])
def test_pinned_k_matches_the_closed_form(alpha: float, slo_s: float) -> None:
    """k pinned at 4 and ``T(t) = base + c t``: N streams take ``base + c N (1 + k)`` a step and
    each emits ``E(alpha, 4)``, so the most within the SLO is
    ``floor((slo E - base) / (c (1 + k)))``."""
    stats = _stats([alpha] * 3, [4] * 3, adaptive=False)
    cap = capacity_within_slo(stats, slo_s)
    e = expected_tokens(alpha, 4)
    want = math.floor((slo_s * e - BASE_S) / (PER_TOKEN_S * 5) + 1e-9)
    assert cap is not None and cap.streams == want
    assert cap.demand == 3 and cap.headroom_streams == want - 3
    step = BASE_S + PER_TOKEN_S * 5 * want
    assert cap.capacity_goodput_tok_s == pytest.approx(want * e / step)
    assert cap.goodput_tok_s == pytest.approx(3 * e / (BASE_S + PER_TOKEN_S * 15))
    assert cap.headroom_tok_s == pytest.approx(cap.capacity_goodput_tok_s - cap.goodput_tok_s)


def test_well_predicted_traffic_fits_more_streams() -> None:
    """Adaptive speculation on a memory-bound step (nearly flat to 64 tokens): a copy-heavy mix
    holds more streams within the same SLO than a creative one. In a mixed batch the slowest
    stream decides: the well-predicted streams' drafts lengthen the step that the others, which
    emit one token a step, must keep within the SLO."""
    flat = StepTimeModel(((1, 0.010), (64, 0.011), (256, 0.014), (1024, 0.030), (4096, 0.1)))
    caps = [
        capacity_within_slo(_stats([a] * 4, [0] * 4, adaptive=True, step_time=flat), 0.01)
        for a in (0.2, 0.6, 0.9)
    ]
    streams = [c.streams for c in caps if c is not None]
    assert len(streams) == 3 and streams[0] < streams[1] < streams[2]
    mixed = capacity_within_slo(
        _stats([0.2, 0.9] * 2, [0] * 4, adaptive=True, step_time=flat), 0.01
    )
    assert mixed is not None and mixed.streams < streams[2]


def test_kv_and_the_batch_size_bound_it() -> None:
    roomy = capacity_within_slo(_stats([0.5] * 4, [0] * 4, adaptive=True), 0.05)
    assert roomy is not None and roomy.streams > 12
    # four running streams hold 8 blocks each: 40 free blocks leave room for 5 more
    tight = capacity_within_slo(_stats([0.5] * 4, [0] * 4, adaptive=True, free_blocks=40), 0.05)
    assert tight is not None and tight.streams == 9
    small = capacity_within_slo(
        _stats([0.5] * 4, [0] * 4, adaptive=True, max_batch_size=6, queued=3), 0.05
    )
    assert small is not None and small.streams == 6 and small.headroom_streams == -1


def test_an_unreachable_slo_is_zero_and_no_step_model_is_unknown() -> None:
    cap = capacity_within_slo(_stats([0.5], [0], adaptive=True), BASE_S / 2)
    assert cap is not None and cap.streams == 0 and cap.capacity_goodput_tok_s == 0.0
    assert capacity_within_slo(_stats([0.5], [0], adaptive=True, step_time=None), 0.05) is None
    # an idle replica plans with the prior
    idle = capacity_within_slo(_stats([], [], adaptive=True), 0.05)
    assert idle is not None and idle.streams > 0 and idle.demand == 0

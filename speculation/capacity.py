"""A decode replica's capacity within a TPOT SLO: the most streams of its current acceptance mix
whose slowest TPOT (step time over ``E(alpha, k)``) keeps to the SLO, and the goodput headroom."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from speculation.calibration import DEFAULT_ACCEPTANCE
from speculation.goodput import DraftBatch, StepCosts, TpotGuard, choose_ks, expected_tokens
from speculation.routing_stats import RoutingStats
from speculation.step_time import StepTimeModel


@dataclass(frozen=True)
class Capacity:
    streams: int
    demand: int  # streams it has: running plus queued
    goodput_tok_s: float
    capacity_goodput_tok_s: float
    single_goodput_tok_s: float

    @property
    def headroom_streams(self) -> int:
        return self.streams - self.demand

    @property
    def headroom_tok_s(self) -> float:
        return self.capacity_goodput_tok_s - self.goodput_tok_s


@dataclass(frozen=True)
class _Step:
    tpot_s: float
    goodput_tok_s: float


def _step(
    alphas: np.ndarray, stats: RoutingStats, model: StepTimeModel, slo_s: float, width: int
) -> _Step:
    n = len(alphas)
    if stats.k_max <= 0:
        ks = [0] * n
    elif stats.adaptive:
        ks = choose_ks(
            DraftBatch(alphas.tolist(), stats.k_max, [width] * n),
            StepCosts(
                model,
                per_draft_s=stats.draft_token_s or None,
                round_s=stats.draft_round_s,
            ),
            TpotGuard(slo_s),
        )
    else:
        ks = [stats.k_max] * n
    forwards_s = model.predict(sum(1 + width * k for k in ks)) + stats.draft_round_s * max(ks)
    step_s = forwards_s + stats.cycle_overhead_s  # what a client waits: the loop's whole cycle
    emitted = [expected_tokens(float(a), k) for a, k in zip(alphas, ks, strict=True)]
    return _Step(step_s / min(emitted), sum(emitted) / step_s)


def _mean_width(stats: RoutingStats) -> int:
    """Mean draft-tree width, from ``step_tokens = sum(1 + w_i k_i)``."""
    drafted = sum(stats.ks)
    if stats.tree_width <= 1 or drafted == 0 or stats.running == 0:
        return 1
    w = (stats.step_tokens - stats.running) / drafted
    return int(min(max(round(w), 1), stats.tree_width))


def capacity_within_slo(stats: RoutingStats, slo_s: float) -> Capacity | None:
    """Capacity within ``slo_s`` seconds per output token; None without a step-time model."""
    model = stats.step_time_model()
    if model is None:
        return None
    mix = np.asarray(stats.alphas or (DEFAULT_ACCEPTANCE,), dtype=np.float64)
    width = _mean_width(stats)
    most = stats.max_batch_size
    if stats.running > 0:  # KV: the running requests' average footprint, repeated
        used = stats.num_blocks - stats.free_blocks
        per_stream = max(used / stats.running, 1.0)
        most = min(most, stats.running + math.floor(stats.free_blocks / per_stream))
    single = _step(mix.mean(keepdims=True), stats, model, slo_s, width).goodput_tok_s
    streams, at_capacity = 0, 0.0
    for n in range(1, most + 1):  # a step's TPOT grows with its streams: the first miss ends it
        s = _step(np.resize(mix, n), stats, model, slo_s, width)
        if s.tpot_s > slo_s:
            break
        streams, at_capacity = n, s.goodput_tok_s
    now = 0.0
    if stats.running > 0:
        now = _step(np.resize(mix, stats.running), stats, model, slo_s, width).goodput_tok_s
    return Capacity(streams, stats.running + stats.queued, now, at_capacity, single)

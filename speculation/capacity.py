"""A decode replica's capacity within a TPOT SLO, for the traffic it is serving now.

How many streams a replica holds before its slowest one misses the SLO depends on how well
their tokens are predicted: a stream that accepts most drafts emits several tokens a step, so
the same step time is a shorter time per output token and more such streams fit. Queue-length
autoscaling sees none of this. Here the same goodput model that adaptive speculation and the
router use (``speculation.goodput``) answers, from a replica's ``RoutingStats``:

- the **mix**: the acceptance estimates of the requests in its batch (the prior
  ``DEFAULT_ACCEPTANCE`` while it has none), taken as what further requests will look like;
- for ``N`` streams of that mix (the mix repeated to ``N``), the drafts adaptive speculation
  would grant them with the SLO as its TPOT guard (``choose_ks``; ``k_max`` each when it is
  pinned), the step's predicted time ``T(sum(1 + w k)) + r * max k`` (step-time model, draft
  rounds ``r``), each stream's TPOT ``step / E(alpha, k)`` and the step's goodput
  ``sum E / step``;
- **capacity**: the largest ``N`` up to ``max_batch_size`` whose slowest stream stays within
  the SLO, and within the KV blocks the running requests' average footprint leaves room for;
- **headroom**: capacity minus the streams it has (running and queued), in streams and in the
  goodput the difference would add;
- and the goodput of one stream of the mix's mean acceptance alone: what a replica still
  delivers where the SLO is out of reach even for one stream.

``None`` where the replica has no step-time model yet (it has not measured its steps).
"""

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
    """A replica's capacity within the SLO at its current mix."""

    streams: int  # the most streams of the mix whose slowest TPOT stays within the SLO
    demand: int  # streams it has: running plus queued
    goodput_tok_s: float  # predicted tokens/s of the streams it runs now
    capacity_goodput_tok_s: float  # predicted tokens/s at capacity
    single_goodput_tok_s: float  # predicted tokens/s of one stream of the mix alone

    @property
    def headroom_streams(self) -> int:
        """Streams it could still take within the SLO (negative: over capacity)."""
        return self.streams - self.demand

    @property
    def headroom_tok_s(self) -> float:
        """Goodput it could still add within the SLO (negative: over capacity)."""
        return self.capacity_goodput_tok_s - self.goodput_tok_s


@dataclass(frozen=True)
class _Step:
    tpot_s: float  # the slowest stream's time per output token
    goodput_tok_s: float


def _step(
    alphas: np.ndarray, stats: RoutingStats, model: StepTimeModel, slo_s: float, width: int
) -> _Step:
    """Predicted step of the streams of acceptance ``alphas`` ([N]) on this replica."""
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
    step_s = model.predict(sum(1 + width * k for k in ks)) + stats.draft_round_s * max(ks)
    emitted = [expected_tokens(float(a), k) for a, k in zip(alphas, ks, strict=True)]
    return _Step(step_s / min(emitted), sum(emitted) / step_s)


def _mean_width(stats: RoutingStats) -> int:
    """Tokens per draft level of the batch's drafts (the tree's width where greedy requests
    draft trees), from the published aggregate ``step_tokens = sum(1 + w_i k_i)``."""
    drafted = sum(stats.ks)
    if stats.tree_width <= 1 or drafted == 0 or stats.running == 0:
        return 1
    w = (stats.step_tokens - stats.running) / drafted
    return int(min(max(round(w), 1), stats.tree_width))


def capacity_within_slo(stats: RoutingStats, slo_s: float) -> Capacity | None:
    """``stats``' replica's capacity within ``slo_s`` seconds per output token (module doc);
    None without a step-time model."""
    model = stats.step_time_model()
    if model is None:
        return None
    mix = np.asarray(stats.alphas or (DEFAULT_ACCEPTANCE,), dtype=np.float64)  # [M]
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

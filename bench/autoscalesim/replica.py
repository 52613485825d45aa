"""One decode replica serving a request mix, as a function of the streams it holds.

For ``n`` streams (1 up to what ``max_batch`` and its KV allow) of a mix of the workload's classes
(``bench.routersim.workload.DEFAULT_MIX``, lengths their means at the profile's scale):

- the batch holds each class in proportion to its arrival share times how long its requests
  stay, output tokens over tokens per step (as ``bench.routersim.capacity.full_batch`` does),
  each class's tokens per step carried over from the batch one stream smaller rather than
  iterated to a fixed point;
- the engine's adaptive speculation grants drafts with the TPOT SLO as its guard (``choose_ks``
  with ``TpotGuard(slo)``: the engine ``speculation.capacity`` predicts), and the step pays its
  draft rounds;
- a class's slowest stream runs at the step over its fewest expected tokens a step
  (``within[c, n]``: at most the SLO), and the replica completes
  ``n / sum_c(share_c * out_c * step / E_c)`` requests a second (Little's law). A class with
  no stream in a small batch keeps the verdict of the batch one smaller.

Its **capacity** is the streams before the first class misses the SLO, counted as
``capacity_within_slo`` counts them: the first miss ends it, though past the guard's loss cap a
larger batch that drafts nothing may be within again. **reported** is what
``capacity_within_slo`` predicts from the ``RoutingStats`` of a replica holding the batch at
capacity: what it would publish for the goodput policy (in streams, and in the tokens/s it
would emit there). It differs from ``capacity`` where that batch's composition, repeated,
behaves unlike the batches of other sizes (at the H200 profile and 16 ms, the mix 30 % of the
way to creative: 188 reported, 132 found).

A replica's streams are not proportional to the requests/s it completes: with fewer streams
each runs faster (smaller steps, deeper drafts), so a pool that halves its replicas more than
doubles the streams each holds.

**attainment** is the share of arrivals within the SLO when the pool holds a mean of ``n``
streams a replica, the replicas' streams spread around that mean (normal, standard deviation
``spread * sqrt(n)``: 1 is random placement; a router that balances keeps it smaller).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from bench.routersim.capacity import kv_batch, mean_lengths
from bench.routersim.profiles import Profile
from bench.routersim.workload import DEFAULT_MIX
from speculation.capacity import Capacity, capacity_within_slo
from speculation.goodput import DraftBatch, StepCosts, TpotGuard, choose_ks, expected_tokens
from speculation.routing_stats import ReplicaLoad, SpeculationState, collect_routing_stats

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
BLOCK_TOKENS = 16  # KV block size of the replica the capacity prediction sees


@dataclass(frozen=True)
class ReplicaCurve:
    """A decode replica at one mix, by the streams it holds (module doc)."""

    shares: tuple[float, ...]  # arrival share of each DEFAULT_MIX class, summing to 1
    throughput_rps: FloatArray  # [most + 1] requests/s it completes at n streams (increasing)
    within: BoolArray  # [classes, most + 1] the class's slowest stream within the SLO at n
    attainment: FloatArray  # [most + 1] share of arrivals within it at a pool mean of n
    capacity: int  # streams before the first class misses the SLO
    reported: int  # capacity_within_slo's prediction for a replica holding that batch
    reported_tok_s: float  # and its prediction of the tokens/s it emits at capacity
    output_tokens: float  # mean output tokens of an arriving request
    step_s: FloatArray  # [most + 1] its step at n streams, draft rounds included
    accept_length: FloatArray  # [most + 1] mean tokens a stream emits a step at n (1: none)

    @property
    def most(self) -> int:
        """The most streams it holds (``max_batch``, or fewer where its KV binds)."""
        return len(self.throughput_rps) - 1

    @property
    def capacity_rps(self) -> float:
        """Requests/s it completes at capacity: what sizes the pool for a rate."""
        return float(self.throughput_rps[self.capacity])

    def streams_for(self, rps: float) -> float:
        """Mean streams it holds to complete ``rps`` requests/s (at most ``most``)."""
        n = np.arange(self.most + 1, dtype=np.float64)  # [most + 1]
        return float(np.interp(rps, self.throughput_rps, n))

    def at(self, values: FloatArray, streams: float) -> float:
        """``values`` ([most + 1], by streams) at a fractional ``streams``."""
        n = np.arange(self.most + 1, dtype=np.float64)  # [most + 1]
        return float(np.interp(streams, n, values))

    def attainment_at(self, streams: float) -> float:
        n = np.arange(self.most + 1, dtype=np.float64)  # [most + 1]
        return float(np.interp(streams, n, self.attainment))


@dataclass(frozen=True)
class _Step:
    seconds: float  # the step, draft rounds included
    mean_tokens: FloatArray  # [classes] expected tokens a step of the class's streams (1: none)
    fewest_tokens: FloatArray  # [classes] of its slowest stream (1: none)


def replica_curve(p: Profile, shares: Sequence[float], slo_s: float, spread: float) -> ReplicaCurve:
    """A replica of profile ``p`` serving arrivals of ``shares`` (DEFAULT_MIX order) within
    ``slo_s`` seconds per output token (module doc)."""
    mix = tuple(replace(c, share=s) for c, s in zip(DEFAULT_MIX, shares, strict=True))
    share = np.asarray(shares, dtype=np.float64) / sum(shares)  # [classes]
    alpha = np.array([c.alpha for c in mix])  # [classes]
    out, _ = mean_lengths(p, mix)  # [classes] mean output tokens
    most = kv_batch(p, mix)
    tokens = np.ones(len(mix))  # [classes] per step, carried from the batch one smaller
    throughput = np.zeros(most + 1)  # [most + 1]
    within = np.ones((len(mix), most + 1), dtype=np.bool_)  # [classes, most + 1]
    members_at = [np.zeros(len(mix), dtype=np.int64)]  # [most + 1] of [classes]
    step_s, accept_length = np.zeros(most + 1), np.ones(most + 1)  # [most + 1]
    for n in range(1, most + 1):
        members = _apportion(share * out / tokens, n)
        step = _step(p, alpha, members, slo_s)
        held = members > 0
        tokens = np.where(held, step.mean_tokens, tokens)
        # a class with no stream in this batch keeps the verdict of the batch one smaller
        within[:, n] = np.where(held, step.seconds / step.fewest_tokens <= slo_s, within[:, n - 1])
        throughput[n] = n / float(share @ (out * step.seconds / tokens))
        members_at.append(members)
        step_s[n], accept_length[n] = step.seconds, float(members @ step.mean_tokens) / n
    step_s[0], accept_length[0] = step_s[1], accept_length[1]  # an idle replica's next step
    missed = np.flatnonzero(~within[share > 0].all(axis=0))  # stream counts some class misses
    capacity = int(missed[0]) - 1 if missed.size else most
    if capacity < 1:
        raise ValueError(
            f"a {p.name} replica keeps no stream of the mix {tuple(shares)} within "
            f"{slo_s * 1e3:g} ms per output token: a pool cannot be sized for it"
        )
    ramp = np.arange(most + 1) * 1e-9  # strictly increasing, for the inverse
    predicted = _reported(p, members_at[capacity], slo_s)
    return ReplicaCurve(
        shares=tuple(float(s) for s in share),
        throughput_rps=np.maximum.accumulate(throughput) + ramp,
        within=within,
        attainment=_spread(share @ within, spread),
        capacity=capacity,
        reported=predicted.streams,
        reported_tok_s=predicted.capacity_goodput_tok_s,
        output_tokens=float(share @ out),
        step_s=step_s,
        accept_length=accept_length,
    )


def _apportion(weights: FloatArray, n: int) -> IntArray:
    """``n`` streams split in proportion to ``weights`` ([classes]), by largest remainders."""
    exact = weights / weights.sum() * n  # [classes]
    members: IntArray = np.floor(exact).astype(np.int64)
    members[np.argsort(members - exact)[: n - int(members.sum())]] += 1
    return members


def _ks(p: Profile, alphas: list[float], slo_s: float) -> list[int]:
    return choose_ks(
        DraftBatch(alphas, p.k_max),
        StepCosts(p.step_time, round_s=p.draft_round_s),
        TpotGuard(slo_s),
    )


def _step(p: Profile, alpha: FloatArray, members: IntArray, slo_s: float) -> _Step:
    """The step of a batch of ``members`` ([classes]) streams of acceptance ``alpha``."""
    alphas = np.repeat(alpha, members).tolist()  # [n], grouped by class
    ks = _ks(p, alphas, slo_s)
    seconds = p.step_time.predict(sum(1 + k for k in ks)) + p.draft_round_s * max(ks)
    emitted = np.array([expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True)])  # [n]
    mean, fewest = np.ones(len(alpha)), np.ones(len(alpha))  # [classes]
    start = 0
    for c, m in enumerate(members.tolist()):
        if m:
            mean[c] = emitted[start : start + m].mean()
            fewest[c] = emitted[start : start + m].min()
        start += m
    return _Step(seconds, mean, fewest)


def _interleave(members: IntArray) -> list[int]:
    """The class of each stream, classes spread evenly through the batch: the capacity
    prediction repeats or cuts the published list, so any prefix should hold the mix."""
    keyed = sorted(((j + 0.5) / m, c) for c, m in enumerate(members.tolist()) for j in range(m))
    return [c for _, c in keyed]


def _reported(p: Profile, members: IntArray, slo_s: float) -> Capacity:
    """What ``capacity_within_slo`` predicts for a replica holding ``members`` ([classes])
    streams halfway through their outputs, with the ks its engine runs them at."""
    alpha = np.array([c.alpha for c in DEFAULT_MIX])  # [classes]
    order = _interleave(members)
    alphas = [float(alpha[c]) for c in order]
    out, prompt = mean_lengths(p, DEFAULT_MIX)  # [classes]
    per_stream = np.ceil((prompt + out / 2) / BLOCK_TOKENS)  # [classes] KV blocks held
    num_blocks = p.kv_tokens // BLOCK_TOKENS
    used = int(sum(per_stream[c] for c in order))
    stats = collect_routing_stats(
        alphas,
        _ks(p, alphas, slo_s),
        ReplicaLoad(0, num_blocks - used, num_blocks, BLOCK_TOKENS, p.max_batch),
        SpeculationState(p.k_max, True, p.step_time, draft_round_s=p.draft_round_s),
        now=0.0,
    )
    cap = capacity_within_slo(stats, slo_s)
    assert cap is not None  # the replica has a step-time model
    return cap


def _spread(ok: FloatArray, spread: float) -> FloatArray:
    """``ok`` ([most + 1]: the share of arrivals within the SLO at exactly n streams) averaged
    over replicas spread normally around each mean n, the tails at 0 and ``most``."""
    n = np.arange(len(ok), dtype=np.float64)  # [most + 1] the pool's mean streams
    sigma = np.maximum(spread * np.sqrt(np.maximum(n, 1.0)), 1e-9)  # [most + 1]
    z = (n[None, :-1] + 0.5 - n[:, None]) / sigma[:, None]  # [mean, most] to each upper edge
    cdf = 0.5 * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(z / math.sqrt(2.0)))
    ends = np.ones((len(n), 1))  # [mean, 1]
    p = np.diff(np.hstack([0.0 * ends, cdf, ends]), axis=1)  # [mean, most + 1] P(replica at n)
    out: FloatArray = np.clip(p @ ok, 0.0, 1.0)  # the sums' rounding
    return out

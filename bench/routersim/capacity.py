"""The decode pool's capacity: requests per second it completes when every replica is full.

A full replica holds ``max_batch`` requests (fewer if their KV does not fit), each class in
proportion to its share times the steps a request of it stays in the batch (output tokens over
tokens per step); the speculation lengths are ``choose_ks``'s for that batch, and the step pays
its draft rounds too. Iterated to a fixed point. Load levels in the simulator are fractions of
this number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bench.routersim.profiles import Profile
from bench.routersim.workload import RequestClass
from speculation.goodput import DraftBatch, StepCosts, TpotGuard, choose_ks, expected_tokens

LOGNORMAL_MEAN = math.exp(0.6**2 / 2)  # mean over median of the workload's length law
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class FullBatch:
    """One replica holding ``batch`` requests of the mix, at its fixed point."""

    members: tuple[int, ...]  # requests of each class in the batch
    step_s: float  # its step, draft rounds included
    tokens_per_s: float  # what it emits
    tpot_s: float  # the slowest member's step over the tokens it expects from it


def mean_lengths(p: Profile, mix: tuple[RequestClass, ...]) -> tuple[FloatArray, FloatArray]:
    """Per class, the mean output and prompt tokens of its requests."""
    out = np.array([c.output_median for c in mix]) * p.length_scale * LOGNORMAL_MEAN
    prompt = np.array([c.prompt_median for c in mix]) * p.length_scale * LOGNORMAL_MEAN
    return out, prompt


def kv_batch(p: Profile, mix: tuple[RequestClass, ...]) -> int:
    """The most requests of the mix one replica holds (``max_batch``, or what its KV fits)."""
    shares = _shares(mix)
    out, prompt = mean_lengths(p, mix)
    return min(p.max_batch, int(p.kv_tokens / float(shares @ (out + prompt))))


def full_batch(
    p: Profile, mix: tuple[RequestClass, ...], batch: int, tpot_slo_s: float | None = None
) -> FullBatch:
    """A replica holding ``batch`` requests of the mix, each class in proportion to the steps
    its requests stay, with ``choose_ks``'s speculation lengths (kept to ``tpot_slo_s`` at any
    cost in goodput, when given)."""
    shares = _shares(mix)
    out, _ = mean_lengths(p, mix)
    occupancy = shares.copy()
    e = np.ones(len(mix))
    width = np.ones(len(mix))
    slowest = np.zeros(len(mix))  # per class, its members' fewest expected tokens
    n = np.zeros(len(mix), dtype=np.int64)
    ks: list[int] = []
    for _ in range(6):
        was = n
        n = np.maximum(np.round(batch * occupancy / occupancy.sum()).astype(np.int64), 0)
        if np.array_equal(n, was):
            break  # the same batch again: at its fixed point
        alphas = [c.alpha for c, m in zip(mix, n, strict=True) for _ in range(m)]
        ks = choose_ks(
            DraftBatch(alphas, p.k_max),
            StepCosts(p.step_time, p.max_batched_tokens, round_s=p.draft_round_s),
            TpotGuard(tpot_slo_s, max_loss=1.0),  # whatever it costs
        )
        start = 0
        for i, (c, m) in enumerate(zip(mix, n, strict=True)):
            got = [expected_tokens(c.alpha, k) for k in ks[start : start + m]]
            if m:
                e[i] = sum(got) / m
                width[i] = 1 + sum(ks[start : start + m]) / m
                slowest[i] = min(got)
            start += m
        occupancy = shares * out / e
    step = p.step_time.predict(round(float(n @ width))) + p.draft_round_s * max(ks, default=0)
    held = n > 0
    tpot = float(step / slowest[held].min()) if held.any() else 0.0
    return FullBatch(tuple(int(m) for m in n), step, float(n @ e) / step, tpot)


def saturation_rps(p: Profile, mix: tuple[RequestClass, ...], replicas: int) -> float:
    full = full_batch(p, mix, kv_batch(p, mix))
    out, _ = mean_lengths(p, mix)
    return replicas * full.tokens_per_s / float(_shares(mix) @ out)


def _shares(mix: tuple[RequestClass, ...]) -> FloatArray:
    shares = np.array([c.share for c in mix], dtype=np.float64)
    out: FloatArray = shares / shares.sum()
    return out

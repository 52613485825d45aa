"""The decode pool's capacity: requests per second it completes when every replica is full.

A full replica holds ``max_batch`` requests (fewer if their KV does not fit), each class in
proportion to its share times the steps a request of it stays in the batch (output tokens over
tokens per step); the speculation lengths are ``choose_ks``'s for that batch, and the step pays
its draft rounds too. Iterated to a fixed point. Load levels in the simulator are fractions of
this number.
"""

from __future__ import annotations

import math

import numpy as np

from bench.routersim.profiles import Profile
from bench.routersim.workload import RequestClass
from decode.goodput import choose_ks, expected_tokens

LOGNORMAL_MEAN = math.exp(0.6**2 / 2)  # mean over median of the workload's length law


def saturation_rps(p: Profile, mix: tuple[RequestClass, ...], replicas: int) -> float:
    shares = np.array([c.share for c in mix], dtype=np.float64)
    shares /= shares.sum()
    out = np.array([c.output_median for c in mix]) * p.length_scale * LOGNORMAL_MEAN
    prompt = np.array([c.prompt_median for c in mix]) * p.length_scale * LOGNORMAL_MEAN
    mean_reserve = float(shares @ (out + prompt))
    batch = min(p.max_batch, int(p.kv_tokens / mean_reserve))
    occupancy = shares.copy()
    e = np.ones(len(mix))
    width = np.ones(len(mix))
    for _ in range(6):
        n = np.maximum(np.round(batch * occupancy / occupancy.sum()).astype(int), 0)
        alphas = [c.alpha for c, m in zip(mix, n, strict=True) for _ in range(m)]
        ks = choose_ks(alphas, p.step_time, p.k_max, p.max_batched_tokens, round_s=p.draft_round_s)
        start = 0
        for i, (c, m) in enumerate(zip(mix, n, strict=True)):
            part = ks[start : start + m]
            start += m
            if m:
                e[i] = sum(expected_tokens(c.alpha, k) for k in part) / m
                width[i] = 1 + sum(part) / m
        occupancy = shares * out / e
    step = p.step_time.predict(round(float(n @ width))) + p.draft_round_s * max(ks, default=0)
    tokens_per_s = float(n @ e) / step
    return replicas * tokens_per_s / float(shares @ out)

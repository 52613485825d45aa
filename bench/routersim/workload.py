"""Simulated traffic: request classes with their own acceptance rates, lengths and prefixes, and
the arrival process.

Default mix (acceptance rates as the issue gives them; lengths and shares assumed):

| class | share | acceptance | prompt (median) | output (median) | shared prefix |
|---|---|---|---|---|---|
| code/copy, greedy | 0.3 | 0.85 | 1024 | 256 | 512 tokens, 200 groups |
| chat | 0.4 | 0.6 | 512 | 256 | 256 tokens, 50 groups |
| creative, temperature 1 | 0.3 | 0.3 | 128 | 512 | none |

Lengths are log-normal (sigma 0.6) and capped; a profile's ``length_scale`` shrinks them (the CPU
profile serves a 135M model with short requests). The router sees each request's acceptance
through prefill's probe, modelled as the class rate plus Gaussian noise (sigma ``probe_noise``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class RequestClass:
    name: str
    share: float
    alpha: float  # true per-token acceptance rate of the draft
    prompt_median: int
    output_median: int
    prefix_tokens: int  # shared prefix (system prompt, few-shot, repository context)
    prefix_groups: int  # distinct shared prefixes, chosen Zipf-like


DEFAULT_MIX: tuple[RequestClass, ...] = (
    RequestClass("code_copy", 0.3, 0.85, 1024, 256, 512, 200),
    RequestClass("chat", 0.4, 0.60, 512, 256, 256, 50),
    RequestClass("creative", 0.3, 0.30, 128, 512, 0, 0),
)


def mix_with(shares: dict[str, float]) -> tuple[RequestClass, ...]:
    """The default classes with other shares (missing classes get 0)."""
    from dataclasses import replace

    return tuple(replace(c, share=shares.get(c.name, 0.0)) for c in DEFAULT_MIX)


@dataclass(frozen=True)
class Workload:
    """N requests in arrival order (arrays indexed by request)."""

    arrival_s: FloatArray
    cls: npt.NDArray[np.int8]
    prompt: IntArray
    output: IntArray  # output tokens the request generates (at least 2)
    prefix: IntArray  # shared-prefix tokens (a whole number of 16-token blocks)
    group: IntArray  # prefix group id (-1: none), unique across classes
    alpha_probe: FloatArray  # what the router is told
    alphas: FloatArray  # true acceptance per class

    @property
    def size(self) -> int:
        return int(self.arrival_s.size)


def arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> FloatArray:
    """Arrival times: gamma-distributed gaps of mean ``1 / rate`` and coefficient of variation
    ``burstiness`` (1.0 is a Poisson process)."""
    shape = 1.0 / burstiness**2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    gaps[0] = 0.0
    out: FloatArray = np.cumsum(gaps)
    return out


def generate(
    n: int,
    rate: float,
    mix: tuple[RequestClass, ...] = DEFAULT_MIX,
    *,
    length_scale: float = 1.0,
    probe_noise: float = 0.08,
    burstiness: float = 1.0,
    seed: int = 0,
) -> Workload:
    rng = np.random.default_rng(seed)
    shares = np.array([c.share for c in mix], dtype=np.float64)
    cls = rng.choice(len(mix), size=n, p=shares / shares.sum()).astype(np.int8)
    pm = np.array([c.prompt_median for c in mix], dtype=np.float64)[cls] * length_scale
    om = np.array([c.output_median for c in mix], dtype=np.float64)[cls] * length_scale
    prompt = np.clip(np.round(pm * rng.lognormal(0.0, 0.6, n)), 8, 8192).astype(np.int64)
    output = np.clip(np.round(om * rng.lognormal(0.0, 0.6, n)), 2, 4096).astype(np.int64)
    prefix = np.zeros(n, dtype=np.int64)
    group = np.full(n, -1, dtype=np.int64)
    offset = 0
    for i, c in enumerate(mix):
        sel = np.flatnonzero(cls == i)
        if c.prefix_groups and sel.size:
            ranks = rng.zipf(1.2, sel.size) % c.prefix_groups
            group[sel] = offset + ranks
            blocks = int(c.prefix_tokens * length_scale) // 16
            prefix[sel] = np.minimum(blocks * 16, (prompt[sel] // 16) * 16)
        offset += c.prefix_groups
    alphas = np.array([c.alpha for c in mix], dtype=np.float64)
    probe = np.clip(alphas[cls] + rng.normal(0.0, probe_noise, n), 0.0, 0.99)
    return Workload(
        arrival_s=arrivals(n, rate, burstiness, rng),
        cls=cls,
        prompt=prompt,
        output=output,
        prefix=prefix,
        group=group,
        alpha_probe=probe,
        alphas=alphas,
    )

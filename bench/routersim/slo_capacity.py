"""What a decode pool can serve within a TPOT SLO: the load past which no placement keeps
every request within it.

``saturation_rps`` (``bench.routersim.capacity``) is the throughput of full replicas whose
speculation maximises throughput; requests there may run past any SLO. This is the same fluid
estimate with every step kept within the SLO, by engines whose speculation keeps to it
(``decode.speculation_tpot_slo_s``), at the batch size that emits most while the slowest member
keeps to it (or by engines drafting for throughput, where that keeps more within):

- **split**: each class on replicas of its own (copy requests draft deep where no creative
  request pays their rounds), the pool divided in proportion to what each class needs;
- **mixed**: every replica holding the mix (what balanced placement gives).

A steady fluid estimate: it leaves out KV transfer and queueing (a few ms once per request)
and the batches' fluctuation, so real placements keep fewer within the SLO at a load near it.
It places the simulator's cliff for the H200 profile (batches near 190). For the CPU profile
(batches of 11-32 requests of a few dozen tokens, where what it leaves out weighs more) it
misses both ways: a guarded class split at 0.89 of it kept 52 % within the SLO, balanced
placement at 1.18 of its mixed figure 74 % (BENCHMARKS.md).
Offered loads above the larger of the two cannot be held within the SLO by placement alone:
goodput gained there is some requests kept within at the cost of others further past it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.routersim.capacity import FullBatch, full_batch, kv_batch, mean_lengths
from bench.routersim.profiles import Profile
from bench.routersim.workload import RequestClass, mix_with


@dataclass(frozen=True)
class Within:
    """The batch that emits most with its slowest member within the SLO."""

    batch: int
    full: FullBatch
    guarded: bool  # its speculation keeps to the SLO (else it drafts for throughput alone)


@dataclass(frozen=True)
class SloCapacity:
    tpot_slo_s: float
    split_rps: float  # each class on replicas of its own
    mixed_rps: float  # every replica holding the mix
    split_replicas: dict[str, float]  # the share of the pool each class takes in the split
    # (empty: some class alone cannot keep to the SLO)
    split_batches: dict[str, int]  # and its batch there
    mixed_batch: int

    @property
    def rps(self) -> float:
        """The better of the two placements."""
        return max(self.split_rps, self.mixed_rps)


def best_within(p: Profile, mix: tuple[RequestClass, ...], tpot_slo_s: float) -> Within | None:
    """Over every batch size the replica's KV holds, and speculation kept to the SLO or
    drafting for throughput, the one that emits most with every member's step TPOT within
    ``tpot_slo_s``. (Drafting for throughput can keep more within: where drafts are cheap,
    copy requests that draft leave the batch sooner, and the batch then holds fewer of them.)
    None: no batch keeps to it, not even one request alone."""
    best: Within | None = None
    for batch in range(1, kv_batch(p, mix) + 1):
        for guard in (tpot_slo_s, None):
            full = full_batch(p, mix, batch, guard)
            if full.tpot_s > tpot_slo_s or not any(full.members):
                continue
            if best is None or full.tokens_per_s > best.full.tokens_per_s:
                best = Within(batch, full, guard is not None)
    return best


def slo_capacity(
    p: Profile, mix: tuple[RequestClass, ...], replicas: int, tpot_slo_s: float
) -> SloCapacity:
    """Requests per second ``replicas`` serve with every step within ``tpot_slo_s``."""
    shares = np.array([c.share for c in mix], dtype=np.float64)
    shares /= shares.sum()
    out, _ = mean_lengths(p, mix)
    need = {}  # replicas per (request per second of the whole mix), per class
    batches = {}
    for c, share, tokens in zip(mix, shares, out, strict=True):
        if share == 0:
            continue
        alone = best_within(p, mix_with({c.name: 1.0}), tpot_slo_s)
        need[c.name] = np.inf if alone is None else share * tokens / alone.full.tokens_per_s
        batches[c.name] = 0 if alone is None else alone.batch
    per_rps = sum(need.values())
    mixed = best_within(p, mix, tpot_slo_s)
    mixed_rps = 0.0 if mixed is None else replicas * mixed.full.tokens_per_s / float(shares @ out)
    split = {k: float(v / per_rps) for k, v in need.items()} if np.isfinite(per_rps) else {}
    return SloCapacity(
        tpot_slo_s,
        float(replicas / per_rps),
        mixed_rps,
        split,
        batches,
        0 if mixed is None else mixed.batch,
    )

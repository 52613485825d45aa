"""What a simulated run achieved: goodput under SLOs, TPOT and TTFT, per class.

- TTFT: arrival -> prefill done (the first token is sampled by prefill and sent at once).
- TPOT: (last token - first token) / (output tokens - 1): KV transfer, decode queueing and
  every decode step included, as ``bench/load_metrics.py`` defines it for live runs.
- Goodput: requests meeting both the TTFT and the TPOT SLO, per second of arrivals.
- Drift: mean TPOT of the counted requests arriving in the second half of the counted span over
  the first half's, minus one. A large drift means the run ended while the pool was still
  filling and understates what its load costs. A small one does not prove a steady state: long
  requests accumulate slowly (100 H200 replicas at 0.8 load: 10^5 requests drift -0.2 %, yet
  their mean TPOT is 5 % below 3 * 10^5 requests').

Requests arriving in the first ``warmup`` and the last ``cooldown`` share of the arrival span
are left out: the cluster starts empty (a long request takes seconds to finish, so batches
take that long to fill) and drains at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.routersim.workload import RequestClass, Workload

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Metrics:
    requests: int
    finished: int
    goodput_rps: float
    slo_attainment: float
    throughput_rps: float
    tpot_mean_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    ttft_mean_s: float
    ttft_p99_s: float
    per_class: dict[str, dict[str, float]]
    goodput_by_tpot_slo: dict[str, float]  # goodput at other TPOT SLOs (ms -> rps)
    tpot_drift: float  # second half's mean TPOT over the first half's, minus one

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def measure(
    w: Workload,
    mix: tuple[RequestClass, ...],
    first_token_s: FloatArray,
    finish_s: FloatArray,
    ttft_slo_s: float,
    tpot_slo_s: float,
    sweep_ms: tuple[float, ...] = (15, 20, 25, 30, 40, 50, 75, 100, 150, 200),
    warmup: float = 0.3,
    cooldown: float = 0.05,
) -> Metrics:
    t0, t1 = float(w.arrival_s[0]), float(w.arrival_s[-1])
    keep = (w.arrival_s >= t0 + warmup * (t1 - t0)) & (w.arrival_s <= t1 - cooldown * (t1 - t0))
    ttft = (first_token_s - w.arrival_s)[keep]
    tpot = ((finish_s - first_token_s) / (w.output - 1))[keep]
    span = float(w.arrival_s[keep][-1] - w.arrival_s[keep][0]) or 1.0
    done = np.isfinite(tpot)
    met = done & (ttft <= ttft_slo_s) & (tpot <= tpot_slo_s)
    cls = w.cls[keep]
    per_class = {}
    for i, c in enumerate(mix):
        sel = (cls == i) & done
        if sel.any():
            per_class[c.name] = {
                "requests": float(sel.sum()),
                "tpot_mean_s": float(tpot[sel].mean()),
                "tpot_p99_s": float(np.percentile(tpot[sel], 99)),
                "slo_attainment": float(met[cls == i].mean()),
            }
    ok_ttft = done & (ttft <= ttft_slo_s)
    late = w.arrival_s[keep] > w.arrival_s[keep][0] + span / 2
    drift = float(tpot[done & late].mean() / tpot[done & ~late].mean() - 1)
    return Metrics(
        requests=int(keep.sum()),
        finished=int(done.sum()),
        goodput_rps=float(met.sum()) / span,
        slo_attainment=float(met.mean()),
        throughput_rps=float(done.sum()) / span,
        tpot_mean_s=float(tpot[done].mean()),
        tpot_p50_s=float(np.percentile(tpot[done], 50)),
        tpot_p99_s=float(np.percentile(tpot[done], 99)),
        ttft_mean_s=float(ttft.mean()),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        per_class=per_class,
        goodput_by_tpot_slo={
            f"{ms:g}": float((ok_ttft & (tpot <= ms / 1000)).sum()) / span for ms in sweep_ms
        },
        tpot_drift=drift,
    )

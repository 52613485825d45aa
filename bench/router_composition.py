"""Where each class's requests sit under a routing policy: replica composition and step time.

Runs the router simulator (``bench/routersim/``) at one load per policy and samples the decode
pool at every stats push while the middle of the workload is in flight (arrivals 40–90 %): per
replica, its running requests per class, its step time and its longest speculation. Reports,
per policy, the replicas binned by their share of creative requests, and the step time each
class's requests see (request-weighted).

    .venv/bin/python -m bench.router_composition --profile h200 --decode-replicas 100 \\
        --requests 150000 --load 0.9 --tpot-slo 0.016 --policies power_of_two slo_aware
    # --engine-slo: the replicas' speculation keeps its drafts within --tpot-slo too

Writes ``bench/results/router_composition-<label>.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.routersim.capacity import saturation_rps
from bench.routersim.decode import DecodePool
from bench.routersim.prefill import PrefillResult, prefill_replicas_for, simulate_prefill
from bench.routersim.profiles import PROFILES
from bench.routersim.sim import SimConfig, simulate_decode
from bench.routersim.workload import DEFAULT_MIX, Workload, generate

RESULTS = Path(__file__).resolve().parent / "results"
BINS = ((0.0, 0.2), (0.2, 0.5), (0.5, 0.8), (0.8, 1.01))  # creative share of a replica's batch
IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


def summarise(counts: IntArray, step_s: FloatArray, max_k: IntArray) -> dict[str, Any]:
    """counts: [samples, classes] requests per class; step_s, max_k: [samples], one per replica
    and push, busy replicas only."""
    names = [c.name for c in DEFAULT_MIX]
    total = counts.sum(axis=1)
    creative = counts[:, names.index("creative")]
    share = creative / total
    bins = []
    for lo, hi in BINS:
        m = (share >= lo) & (share < hi)
        if not m.any():
            continue
        bins.append(
            {
                "creative_share": [lo, min(hi, 1.0)],
                "replica_fraction": float(m.mean()),
                "batch": float(total[m].mean()),
                "per_class": {n: float(counts[m, i].mean()) for i, n in enumerate(names)},
                "step_ms": float(step_s[m].mean() * 1e3),
                "max_k": float(max_k[m].mean()),
                "creative_fraction_here": float(creative[m].sum() / creative.sum()),
            }
        )
    seen = {}
    for i, n in enumerate(names):
        per_request = np.repeat(step_s, counts[:, i]) * 1e3  # the step each request sits in
        p50, p90, p99 = np.percentile(per_request, [50, 90, 99])
        seen[n] = {"mean": float(per_request.mean()), "p50": p50, "p90": p90, "p99": p99}
    p1, p50, p99 = np.percentile(total, [1, 50, 99])
    return {
        "bins": bins,
        "step_ms_seen_by_class": seen,
        "mean_batch": float(total.mean()),
        "batch_percentiles": {"p1": float(p1), "p50": float(p50), "p99": float(p99)},
    }


def sample_run(
    w: Workload, pre: PrefillResult, cfg: SimConfig, t_lo: float, t_hi: float
) -> tuple[IntArray, FloatArray, IntArray, int]:
    """One simulated run, sampled at every stats push in ``[t_lo, t_hi]``: busy replicas'
    requests per class [samples, classes], step time [samples], longest speculation
    [samples], and the number of pushes sampled."""
    samples: list[tuple[IntArray, FloatArray, IntArray]] = []

    def observe(pool: DecodePool, now: float) -> None:
        if t_lo <= now <= t_hi:
            busy = pool.n_active > 0
            max_k = (pool.k * (pool.req >= 0)).max(axis=1)
            samples.append((pool.counts[busy], pool.step_s[busy], max_k[busy]))

    simulate_decode(w, pre, cfg, observe)
    counts, steps, ks = (np.concatenate(part) for part in zip(*samples, strict=True))
    return counts, steps, ks, len(samples)


def run(args: argparse.Namespace) -> dict[str, Any]:
    p = PROFILES[args.profile]()
    d, n = args.decode_replicas, args.requests
    rate = args.load * saturation_rps(p, DEFAULT_MIX, d)
    w = generate(n, rate, DEFAULT_MIX, length_scale=p.length_scale, seed=args.seed)
    pre = simulate_prefill(w, p, prefill_replicas_for(w, p), seed=args.seed)
    t_lo, t_hi = float(w.arrival_s[int(0.4 * n)]), float(w.arrival_s[int(0.9 * n)])
    out: dict[str, Any] = {"benchmark": "router_composition", "args": vars(args), "policies": {}}
    for policy in args.policies:
        guard = args.tpot_slo if args.engine_slo else None
        cfg = SimConfig(
            p, d, policy, tpot_slo_s=args.tpot_slo, engine_tpot_slo_s=guard, seed=args.seed
        )
        counts, steps, ks, pushes = sample_run(w, pre, cfg, t_lo, t_hi)
        out["policies"][policy] = summarise(counts, steps, ks) | {"pushes": pushes}
        report(policy, out["policies"][policy])
    return out


def report(policy: str, r: dict[str, Any]) -> None:
    b = r["batch_percentiles"]
    print(
        f"{policy}: mean batch {r['mean_batch']:.0f} (p1 {b['p1']:.0f}, p50 {b['p50']:.0f}, "
        f"p99 {b['p99']:.0f}), {r['pushes']} pushes"
    )
    for b in r["bins"]:
        lo, hi = b["creative_share"]
        per = " ".join(f"{k} {v:.0f}" for k, v in b["per_class"].items())
        print(
            f"  creative share [{lo:.1f}, {hi:.1f}): {b['replica_fraction']:.0%} of replicas, "
            f"batch {b['batch']:.0f} ({per}), step {b['step_ms']:.2f} ms, max k "
            f"{b['max_k']:.2f}, {b['creative_fraction_here']:.0%} of creative requests"
        )
    for c, s in r["step_ms_seen_by_class"].items():
        print(
            f"  {c}: step seen mean {s['mean']:.2f} ms, p50 {s['p50']:.2f}, p90 {s['p90']:.2f}, "
            f"p99 {s['p99']:.2f}"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="h200")
    ap.add_argument("--decode-replicas", type=int, default=100)
    ap.add_argument("--requests", type=int, default=150_000)
    ap.add_argument("--load", type=float, default=0.9, help="fraction of capacity")
    ap.add_argument("--tpot-slo", type=float, default=0.016, help="seconds (slo_aware)")
    ap.add_argument(
        "--engine-slo", action="store_true", help="engines keep their drafts within --tpot-slo"
    )
    ap.add_argument("--policies", nargs="+", default=["power_of_two", "slo_aware"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default=None, help="default: <profile>-d<replicas>-<load>")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    label = args.label or f"{args.profile}-d{args.decode_replicas}-{args.load:g}"
    path = RESULTS / f"router_composition-{label}.json"
    path.write_text(json.dumps(run(args), indent=2) + "\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()

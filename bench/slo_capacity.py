"""The decode pool's capacity within a TPOT SLO, by SLO, and the simulator's check of it.

For each ``--slos`` value: the capacity within it (``bench/routersim/slo_capacity.py``), split
by class and mixed, as a fraction of the throughput capacity the simulator's loads are
fractions of, and where the loads ``--loads`` fall against it. Then ``--check-replicas`` decode
replicas with guarded engines (``decode.speculation_tpot_slo_s``) under ``--check-policies`` at
offered loads that are ``--check-shares`` of the capacity within ``--check-slo``: the share of
requests that meet it, the p99 TPOT, and the drift (a small pool reaches a steady state).

    .venv/bin/python -m bench.slo_capacity --profile h200 --slos 0.015 0.016 0.017 0.02 \\
        --check-shares 0.85 0.95 1.0 1.05 1.1 --label h200

Writes ``bench/results/slo_capacity-<label>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.routersim.capacity import saturation_rps
from bench.routersim.metrics import measure
from bench.routersim.prefill import prefill_replicas_for, simulate_prefill
from bench.routersim.profiles import PROFILES
from bench.routersim.sim import SimConfig, simulate_decode
from bench.routersim.slo_capacity import slo_capacity
from bench.routersim.workload import DEFAULT_MIX, generate

RESULTS = Path(__file__).parent / "results"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = ap.add_argument
    add("--profile", choices=sorted(PROFILES), default="h200")
    add("--slos", type=float, nargs="+", default=[0.015, 0.016, 0.017, 0.02], help="seconds")
    add("--loads", type=float, nargs="+", default=[0.7, 0.8, 0.9], help="of the throughput cap.")
    add("--check-slo", type=float, default=0.016, help="seconds")
    add("--check-shares", type=float, nargs="*", default=[0.85, 0.95, 1.0, 1.05, 1.1])
    add("--check-policies", nargs="+", default=["power_of_two", "least_kv", "slo_aware"])
    add("--check-replicas", type=int, default=4)
    add("--check-requests", type=int, default=6000)
    add("--seeds", type=int, nargs="+", default=[4, 5])
    add("--label", help="default: the profile's name")
    add("--out", type=Path, help="JSON path; default bench/results/slo_capacity-<label>.json")
    return ap.parse_args(argv)


def capacities(args: argparse.Namespace) -> list[dict[str, Any]]:
    p = PROFILES[args.profile]()
    capacity = saturation_rps(p, DEFAULT_MIX, 1)
    rows = []
    for slo in args.slos:
        got = slo_capacity(p, DEFAULT_MIX, 1, slo)
        rows.append(
            {
                **asdict(got),
                "rps": got.rps,
                "split_of_capacity": got.split_rps / capacity,
                "mixed_of_capacity": got.mixed_rps / capacity,
                "loads_of_it": {
                    f"{load:g}": load * capacity / got.rps if got.rps else None
                    for load in args.loads
                },
            }
        )
        print(
            f"within {slo * 1e3:g} ms: {got.split_rps / capacity:.3f} of capacity split by "
            f"class, {got.mixed_rps / capacity:.3f} mixed; loads "
            + " / ".join(f"{k} = {v:.2f}" for k, v in rows[-1]["loads_of_it"].items() if v)
            + " of it",
            flush=True,
        )
    return rows


def checks(args: argparse.Namespace) -> list[dict[str, Any]]:
    p, d, slo = PROFILES[args.profile](), args.check_replicas, args.check_slo
    within = slo_capacity(p, DEFAULT_MIX, d, slo).rps
    rows = []
    for seed in args.seeds:
        for share in args.check_shares:
            rate = share * within
            w = generate(
                args.check_requests, rate, DEFAULT_MIX, length_scale=p.length_scale, seed=seed
            )
            pre = simulate_prefill(w, p, prefill_replicas_for(w, p), seed=seed)
            for policy in args.check_policies:
                cfg = SimConfig(p, d, policy, tpot_slo_s=slo, engine_tpot_slo_s=slo, seed=seed)
                out = simulate_decode(w, pre, cfg)
                m = measure(w, DEFAULT_MIX, pre.first_token_s, out.finish_s, p.ttft_slo_s, slo)
                rows.append({"seed": seed, "share": share, "policy": policy, **m.as_dict()})
                print(
                    f"seed {seed} {share:.2f} of it, {policy}: {m.slo_attainment:6.1%} within "
                    f"{slo * 1e3:g} ms, TPOT mean {m.tpot_mean_s * 1e3:5.2f} p99 "
                    f"{m.tpot_p99_s * 1e3:5.2f} ms, drift {m.tpot_drift:+.1%}",
                    flush=True,
                )
    return rows


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in sorted({r["policy"] for r in report["checks"]}):
        for seed in sorted({r["seed"] for r in report["checks"]}):
            pts = [r for r in report["checks"] if r["policy"] == policy and r["seed"] == seed]
            ax.plot(
                [r["share"] for r in pts],
                [r["slo_attainment"] for r in pts],
                marker="o",
                label=f"{policy}, seed {seed}",
            )
    ax.axvline(1.0, color="grey", linestyle=":")
    ax.set_xlabel("offered load / capacity within the TPOT SLO (fluid estimate)")
    ax.set_ylabel("share of requests within the SLO")
    ax.set_title(f"{report['profile']}, {report['check_replicas']} replicas, guarded engines")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    report = {
        "benchmark": "slo_capacity",
        "command": " ".join(["python -m bench.slo_capacity", *sys.argv[1:]]),
        "profile": args.profile,
        "capacities": capacities(args),
        "check_slo_s": args.check_slo,
        "check_replicas": args.check_replicas,
        "check_requests": args.check_requests,
        "checks": checks(args),
    }
    out: Path = args.out or RESULTS / f"slo_capacity-{args.label or args.profile}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    if report["checks"]:
        plot(report, out.with_suffix(".png"))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()

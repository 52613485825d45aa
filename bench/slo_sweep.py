"""Goodput ratio and p99 change against power of two, by TPOT SLO and load, over router_sim runs.

Each ``bench/router_sim.py`` report routes for one TPOT SLO (``--tpot-slo``); this gathers
several, pairs every policy's run with power of two's at the same load in the same report, and
plots the ratio against the SLO, one line per load and policy.

    .venv/bin/python -m bench.slo_sweep bench/results/router_sim-h200-d100-slo*.json \\
        --policy slo_aware --label h200-d100

Writes ``bench/results/slo_sweep-<label>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
BASELINE = "power_of_two"


def points(reports: Sequence[dict[str, Any]], policy: str) -> list[dict[str, float]]:
    """One point per (load, SLO) where a report holds both ``policy`` and power of two."""
    out = []
    for rep in reports:
        slo_ms = rep["slo"]["tpot_s"] * 1e3
        at = {(r["load"], r["policy"]): r for r in rep["runs"]}
        for (load, name), mine in at.items():
            base = at.get((load, BASELINE))
            if name != policy or base is None or not base["goodput_rps"]:
                continue
            out.append(
                {
                    "load": load,
                    "tpot_slo_ms": slo_ms,
                    "goodput_rps": mine["goodput_rps"],
                    "baseline_goodput_rps": base["goodput_rps"],
                    "goodput_ratio": mine["goodput_rps"] / base["goodput_rps"],
                    "tpot_p99_ms_delta": (mine["tpot_p99_s"] - base["tpot_p99_s"]) * 1e3,
                }
            )
    return sorted(out, key=lambda p: (p["load"], p["tpot_slo_ms"]))


def plot(pts: list[dict[str, float]], policy: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for load in sorted({p["load"] for p in pts}):
        mine = [p for p in pts if p["load"] == load]
        x = [p["tpot_slo_ms"] for p in mine]
        a.plot(x, [p["goodput_ratio"] for p in mine], marker="o", label=f"load {load:g}")
        b.plot(x, [p["tpot_p99_ms_delta"] for p in mine], marker="o", label=f"load {load:g}")
    a.axhline(1.2, color="grey", linestyle=":", label="1.2x")
    a.set(xlabel="TPOT SLO (ms)", ylabel=f"goodput, {policy} / {BASELINE}", yscale="log")
    b.axhline(0.0, color="grey", linestyle=":")
    b.set(xlabel="TPOT SLO (ms)", ylabel=f"p99 TPOT, {policy} - {BASELINE} (ms)")
    a.legend(fontsize=8)
    fig.suptitle(f"{policy} against {BASELINE} by the TPOT SLO it routes for")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("reports", type=Path, nargs="+", help="router_sim JSON reports")
    ap.add_argument("--policy", default="slo_aware")
    ap.add_argument("--label", default="sweep")
    ap.add_argument("--out", type=Path, help="default bench/results/slo_sweep-<label>.json")
    args = ap.parse_args(argv)
    pts = points([json.loads(p.read_text()) for p in args.reports], args.policy)
    if not pts:
        raise SystemExit(f"no report holds both {args.policy} and {BASELINE} at one load")
    out: Path = args.out or RESULTS / f"slo_sweep-{args.label}.json"
    doc = {"policy": args.policy, "baseline": BASELINE, "reports": [str(p) for p in args.reports]}
    out.write_text(json.dumps({**doc, "points": pts}, indent=1))
    plot(pts, args.policy, out.with_suffix(".png"))
    for p in pts:
        print(
            f"load {p['load']:g} SLO {p['tpot_slo_ms']:g} ms: {p['goodput_ratio']:.2f}x, "
            f"p99 {p['tpot_p99_ms_delta']:+.1f} ms"
        )
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return out


if __name__ == "__main__":
    main()

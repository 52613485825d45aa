"""The simulator's summary: goodput ratios against the baselines, and the plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BASELINES = ("power_of_two", "least_kv", "round_robin", "prefix_affinity", "cache_aware")


def ratios(runs: list[dict[str, Any]], policy: str = "acceptance_aware") -> dict[str, Any]:
    """Per load: ``policy``'s goodput over each baseline's, and its p99 TPOT minus theirs."""
    out: dict[str, Any] = {}
    for load in sorted({r["load"] for r in runs}):
        at = {r["policy"]: r for r in runs if r["load"] == load}
        if policy not in at:
            continue
        mine = at[policy]
        out[f"{load:g}"] = {
            base: {
                "goodput_ratio": mine["goodput_rps"] / at[base]["goodput_rps"]
                if at[base]["goodput_rps"]
                else None,
                "tpot_mean_ratio": mine["tpot_mean_s"] / at[base]["tpot_mean_s"],
                "tpot_p99_ms_delta": (mine["tpot_p99_s"] - at[base]["tpot_p99_s"]) * 1e3,
                "goodput_ratio_by_tpot_slo_ms": {
                    ms: (g / at[base]["goodput_by_tpot_slo"][ms])
                    if at[base]["goodput_by_tpot_slo"][ms]
                    else None
                    for ms, g in mine["goodput_by_tpot_slo"].items()
                },
            }
            for base in BASELINES
            if base in at
        }
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    loads = sorted({r["load"] for r in runs})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    a, b, c = axes
    for pol in policies:
        rs = sorted((r for r in runs if r["policy"] == pol), key=lambda r: r["load"])
        a.plot([r["load"] for r in rs], [r["goodput_rps"] for r in rs], marker="o", label=pol)
        b.plot([r["load"] for r in rs], [r["tpot_p99_s"] * 1e3 for r in rs], marker="o")
        b.plot(
            [r["load"] for r in rs],
            [r["tpot_mean_s"] * 1e3 for r in rs],
            marker="x",
            linestyle=":",
            color=b.lines[-1].get_color(),
        )
        mid = [r for r in rs if r["load"] == loads[len(loads) // 2]]
        if mid:
            sweep = mid[0]["goodput_by_tpot_slo"]
            c.plot([float(k) for k in sweep], list(sweep.values()), marker=".", label=pol)
    slo = report["slo"]
    a.set(xlabel="load (fraction of capacity)", ylabel="goodput (req/s)",
          title=f"goodput, TTFT<={slo['ttft_s']:g}s & TPOT<={slo['tpot_s'] * 1e3:g}ms")  # fmt: skip
    b.set(xlabel="load", ylabel="TPOT (ms)", title="TPOT: p99 (solid), mean (dotted)")
    c.set(xlabel="TPOT SLO (ms)", ylabel="goodput (req/s)",
          title=f"goodput vs TPOT SLO at load {loads[len(loads) // 2]:g}")  # fmt: skip
    c.set_xlim(0, 60 if report["profile"]["name"] == "h200" else 220)
    a.legend(fontsize=8)
    fig.suptitle(
        f"router simulator: {report['profile']['name']} profile, "
        f"{report['decode_replicas']} decode replicas, {report['requests']} requests per run"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

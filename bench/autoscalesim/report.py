"""The autoscaling simulator's plot: the pool over the day, attainment per hour, the tuning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLOURS = {"requests": "tab:blue", "goodput": "tab:orange"}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = report["timeline"]
    hours = [m / 60 for m in tl["minute"]]
    fig, axes = plt.subplots(2, 2, figsize=(15, 9))
    for ax, kind in ((axes[0, 0], "tuned"), (axes[0, 1], "default")):
        ax.plot(hours, tl["demand_replicas"], color="black", lw=1, ls="--",
                label="demand at capacity")  # fmt: skip
        for rule, colour in COLOURS.items():
            knob = report["policies"][rule][kind]["knob"]
            ax.plot(hours, tl["replicas"][f"{rule}-{kind}"], color=colour, lw=1,
                    label=f"{rule} ({knob:g})")  # fmt: skip
        mix = ax.twinx()
        mix.fill_between(hours, tl["creative_x"], color="grey", alpha=0.12, lw=0)
        mix.set(ylim=(0, 1), ylabel="mix: 0 copy-heavy, 1 creative (shaded)")
        ax.set(xlabel="hour", ylabel="replicas (running and starting)",
               title=f"replicas over the day, {kind} knobs")  # fmt: skip
        ax.legend(fontsize=8, loc="upper left")

    goal, b, c = report["goal"], axes[1, 0], axes[1, 1]
    for rule, colour in COLOURS.items():
        for kind, style in (("tuned", "-"), ("default", ":")):
            hourly = report["policies"][rule][kind]["hourly_attainment"]
            b.plot(range(len(hourly)), hourly, color=colour, ls=style, marker=".",
                   label=f"{rule} {kind}")  # fmt: skip
        tried = report["policies"][rule]["tried"]
        c.plot([t["replica_hours"] for t in tried], [t["attainment"] for t in tried],
               color=colour, marker="o", ms=3, lw=0.8, label=rule)  # fmt: skip
        best = report["policies"][rule]["tuned"]
        c.plot(best["replica_hours"], best["attainment"], color=colour, marker="*", ms=12)
    b.axhline(goal, color="black", lw=0.7)
    b.set(xlabel="hour", ylabel="share of arrivals within the SLOs",
          title=f"attainment per hour (day goal {goal:g}; dotted: defaults)")  # fmt: skip
    b.legend(fontsize=8)
    c.axhline(goal, color="black", lw=0.7)
    c.axvline(report["demand_replica_hours"], color="black", lw=0.7, ls="--")
    c.set(xlabel="replica-hours (dashed: demand at capacity)", ylabel="day's attainment",
          ylim=(max(0.0, goal - 0.2), 1.002),
          title="tuning: each knob setting (star: the one kept)")  # fmt: skip
    c.legend(fontsize=8)
    slo, ratios = report["slo"], report["ratios"]
    fig.suptitle(
        f"decode autoscaling: {report['profile']['name']}, peak {report['peak_replicas']} "
        f"replicas, TPOT SLO {slo['tpot_s'] * 1e3:g} ms. Tuned replica-hours over requests': "
        f"goodput {ratios['goodput_over_requests']:.3f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""Decode autoscaling over a day: Serve's request-count rule and Dynamo's speculation-aware SLA
planner against the goodput policy.

A day of arrivals (``bench/autoscalesim/load.py``: a diurnal rate with slow random bursts, the
mix going from copy-heavy to creative and back) on a pool of decode replicas of a profile
(``--profile h200``: a 70B target with an 8B draft at TP = 4, ``bench/routersim/profiles.py``),
in a fluid model per control interval (``bench/autoscalesim/pool.py``; one replica at each mix:
``bench/autoscalesim/replica.py``). The peak rate is the one ``--peak-replicas`` replicas
hold at capacity within the TPOT SLO. Policies, all behind Serve's bounds, upscale and
downscale delays, look-back averaging, and the same replica start-up time:

- ``requests``: Serve's default, ``ceil(streams / target_ongoing_requests)``;
- ``goodput``: ``cluster.capacity_policy.decide`` on each replica's streams and
  ``capacity_streams`` (``speculation.capacity``), ``downscale_utilization = target - --band``;
- ``dynamo``: Dynamo's SLA planner as its speculation support (PR #10435) runs it: forward time
  by concurrency profiled once at the day's middle mix, the inter-token latency divided by the
  pool's scraped mean accept length, corrected by observed over expected latency; its knob is
  the ITL target (``bench/autoscalesim/pool.py``).

Each policy runs at its deployment default (``deploy/apps/gpu-disaggregated.yaml``: 48
ongoing requests; utilization 0.8 / 0.5; Dynamo's ITL target at the SLO) and with its one knob
tuned: the setting with the fewest replica-hours whose day keeps ``--goal`` of its arrivals
within the SLOs (goodput's at each of ``--tune-bands``, its downscale band, too).

At the H200 profile the TPOT SLO defaults to 16 ms, the router simulator's (BENCHMARKS.md): at
the profile's own 20 ms no batch up to ``max_batch`` misses it at any mix, so capacity in
streams is the batch limit everywhere and the rules differ only in their knobs and hysteresis.

    .venv/bin/python -m bench.autoscale_sim --profile h200 --label day
    .venv/bin/python -m bench.autoscale_sim --minutes 120 --peak-replicas 100 --step 30 \\
        --mix-levels 5 --label short

Writes ``bench/results/autoscale_sim-<label>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.autoscalesim.load import (
    COPY_HEAVY,
    CREATIVE,
    DayConfig,
    DayLoad,
    day_load,
    mix_level,
    mix_levels,
)
from bench.autoscalesim.pool import DayRun, Policy, Rule, Scaling, Tuned, World, simulate, tune
from bench.autoscalesim.replica import ReplicaCurve, replica_curve
from bench.autoscalesim.report import plot
from bench.routersim.profiles import PROFILES, Profile
from bench.routersim.workload import DEFAULT_MIX

RESULTS = Path(__file__).parent / "results"
TPOT_SLO_S = {"h200": 0.016}  # where the SLO binds (module doc); other profiles: their own


def tpot_slo_of(args: argparse.Namespace, p: Profile) -> float:
    slo: float = args.tpot_slo or TPOT_SLO_S.get(p.name, p.tpot_slo_s)
    return slo


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--profile", choices=sorted(PROFILES), default="h200")
    add("--minutes", type=float, default=24 * 60, help="length of the simulated day")
    add("--step", type=float, default=10.0, help="control interval, seconds")
    add("--peak-replicas", type=int, default=1000, help="replicas the peak needs at capacity")
    add("--min-replicas", type=int, help="default: 1%% of --peak-replicas (at least 1)")
    add("--max-replicas", type=int, help="default: twice --peak-replicas")
    add("--trough", type=float, default=0.2, help="lowest arrival rate over the peak's")
    add("--noise", type=float, default=0.05, help="std. dev. of the log of the rate's bursts")
    add("--noise-tau", type=float, default=300.0, help="the bursts' correlation time, seconds")
    add("--mix-levels", type=int, default=11, help="mixes between copy-heavy and creative")
    add(
        "--tpot-slo",
        type=float,
        help="seconds; default: 16 ms at h200 (module doc), else the profile's",
    )
    add("--ttft-slo", type=float, help="seconds a request may wait; default: the profile's")
    add("--spread", type=float, default=0.5, help="replicas' streams: std. dev. / sqrt(mean)")
    add("--upscale-delay", type=float, default=30.0)
    add("--downscale-delay", type=float, default=600.0)
    add("--startup", type=float, default=120.0, help="seconds from added to serving")
    add("--look-back", type=float, default=30.0, help="seconds Serve averages metrics over")
    add("--goal", type=float, default=0.99, help="attainment the tuned knobs must reach")
    add("--band", type=float, default=0.3, help="goodput: target minus downscale utilization")
    add("--tune-bands", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3], help="tried bands")
    add("--requests-target", type=float, default=48.0, help="untuned target_ongoing_requests")
    add("--utilization", type=float, default=0.8, help="untuned goodput target_utilization")
    add("--seed", type=int, default=0, help="the day's bursts (the day tuned on)")
    add("--check-days", type=int, default=2, help="days of the next seeds run at tuned knobs")
    add("--label", help="default: the profile's name")
    add("--out", type=Path, help="JSON path; default bench/results/autoscale_sim-<label>.json")
    return ap.parse_args(argv)


def day_config(args: argparse.Namespace, seed: int) -> DayConfig:
    return DayConfig(
        minutes=args.minutes,
        step_s=args.step,
        trough=args.trough,
        noise=args.noise,
        noise_tau_s=args.noise_tau,
        mix_levels=args.mix_levels,
        seed=seed,
    )


def curves_for(args: argparse.Namespace, p: Profile) -> tuple[ReplicaCurve, ...]:
    """A replica at each mix level (the slow part: every batch size of every mix)."""
    levels = mix_levels(args.mix_levels)
    return tuple(replica_curve(p, s, tpot_slo_of(args, p), args.spread) for s in levels)


def world_for(
    args: argparse.Namespace, p: Profile, cfg: DayConfig, curves: tuple[ReplicaCurve, ...]
) -> tuple[World, DayLoad]:
    """``cfg``'s day at the peak rate ``--peak-replicas`` replicas hold at the peak's mix."""
    load = day_load(cfg)
    ttft_slo_s = args.ttft_slo or p.ttft_slo_s
    rate_rps = load.rate * peak_rps(args, cfg, curves)  # [steps]
    return World(cfg.step_s, rate_rps, load.level, curves, ttft_slo_s, tpot_slo_of(args, p)), load


def peak_rps(args: argparse.Namespace, cfg: DayConfig, curves: tuple[ReplicaCurve, ...]) -> float:
    """The rate at the day's peak before its bursts: ``--peak-replicas`` at capacity."""
    replicas: int = args.peak_replicas
    return replicas * curves[mix_level(cfg, cfg.peak_at)].capacity_rps


def scaling_of(args: argparse.Namespace) -> Scaling:
    return Scaling(
        min_replicas=args.min_replicas or max(1, args.peak_replicas // 100),
        max_replicas=args.max_replicas or 2 * args.peak_replicas,
        upscale_delay_s=args.upscale_delay,
        downscale_delay_s=args.downscale_delay,
        startup_s=args.startup,
        look_back_s=args.look_back,
    )


def tune_all(w: World, s: Scaling, args: argparse.Namespace, max_batch: int) -> dict[Rule, Tuned]:
    """Each rule's knob searched for the fewest replica-hours that reach ``--goal``; goodput's
    at each of ``--tune-bands`` (its second knob: how far under the target it downscales)."""
    slo = w.tpot_slo_s
    spans = {
        Rule.REQUESTS: (8.0, float(max_batch), 11, 1.0),
        Rule.DYNAMO: (0.4 * slo, 1.2 * slo, 17, 0.0001),
        Rule.DYNAMO_PROFILED: (0.4 * slo, 1.2 * slo, 17, 0.0001),
    }
    out = {
        rule: tune(_day_at(w, s, rule, args.band), *span, args.goal) for rule, span in spans.items()
    }
    per_band = [
        tune(_day_at(w, s, Rule.GOODPUT, band), round(band + 0.1, 2), 1.1, 15, 0.005, args.goal)
        for band in args.tune_bands
    ]
    reached = [t for t in per_band if t.reached] or per_band
    out[Rule.GOODPUT] = min(reached, key=lambda t: t.best.replica_hours)
    return out


def policy_at(w: World, rule: Rule, knob: float, band: float) -> Policy:
    """``rule`` at ``knob``; Dynamo's with its profile: the middle mix's forward times, made
    non-decreasing (the guard drafts less in larger batches, so a forward there can be cheaper:
    a profile run at one plan would not see that, and the dips would give its knob cliffs)."""
    mid = w.curves[len(w.curves) // 2]
    if rule not in (Rule.DYNAMO, Rule.DYNAMO_PROFILED):
        return Policy(rule, knob, band)
    steps = np.maximum.accumulate(mid.step_s)  # [most + 1]
    return Policy(rule, knob, band, 48.0, tuple(steps.tolist()), tuple(mid.accept_length.tolist()))


def _day_at(w: World, s: Scaling, rule: Rule, band: float) -> Callable[[float], DayRun]:
    """The day as a function of ``rule``'s knob."""

    def day(knob: float) -> DayRun:
        return simulate(w, policy_at(w, rule, knob, band), s)

    return day


def held_out(
    args: argparse.Namespace,
    p: Profile,
    curves: tuple[ReplicaCurve, ...],
    s: Scaling,
    policy: Policy,
) -> list[dict[str, Any]]:
    """A tuned knob on ``--check-days`` days of other seeds: the same shape, other bursts."""
    out = []
    for seed in range(args.seed + 1, args.seed + 1 + args.check_days):
        w, _ = world_for(args, p, day_config(args, seed), curves)
        r = simulate(w, policy, s)
        out.append({"seed": seed, **{k: v for k, v in summary(r).items() if k != "knob"}})
    return out


def summary(r: DayRun) -> dict[str, Any]:
    out: dict[str, Any] = {"knob": round(r.policy.knob, 4)}
    if r.policy.rule is Rule.GOODPUT:
        out["downscale_utilization"] = round(r.policy.knob - r.policy.band, 4)
    return {
        **out,
        "replica_hours": r.replica_hours,
        "attainment": r.attainment,
        "scale_events": r.scale_events,
        "peak_replicas": r.peak_replicas,
        "hourly_attainment": [round(float(a), 5) for a in r.hourly_attainment],
    }


def level(c: ReplicaCurve) -> dict[str, Any]:
    """A mix level's replica: the capacity found, and the one it reports."""
    return {
        "shares": [round(x, 4) for x in c.shares],
        "capacity_streams": c.capacity,
        "reported_streams": c.reported,
        "capacity_rps": c.capacity_rps,
        "reported_tok_s": c.reported_tok_s,
        "output_tokens": c.output_tokens,
    }


def timeline(w: World, load: DayLoad, runs: dict[str, DayRun]) -> dict[str, Any]:
    """Every five minutes (their first interval): arrivals, mix, demand and each run's pool."""
    every = max(1, round(300 / w.step_s))
    pick = slice(None, None, every)
    return {
        "minute": (np.arange(w.steps)[pick] * w.step_s / 60).round(2).tolist(),
        "rate_rps": w.rate_rps[pick].round(1).tolist(),
        "creative_x": load.creative[pick].round(4).tolist(),
        "demand_replicas": w.oracle_replicas()[pick].tolist(),
        "replicas": {k: r.replicas[pick].tolist() for k, r in runs.items()},
        "running": {k: r.running[pick].tolist() for k, r in runs.items()},
        "streams": {k: r.streams[pick].round(2).tolist() for k, r in runs.items()},
    }


def _held_out_ratios(policies: dict[str, Any]) -> list[dict[str, float]]:
    """Per held-out day, the goodput rule's replica-hours over each other rule's."""
    ours = policies[Rule.GOODPUT]["held_out"]
    return [
        {
            "seed": day["seed"],
            **{
                f"goodput_over_{rule}": day["replica_hours"]
                / policies[rule]["held_out"][i]["replica_hours"]
                for rule in (Rule.REQUESTS, Rule.DYNAMO, Rule.DYNAMO_PROFILED)
            },
            **{f"{rule}_attainment": policies[rule]["held_out"][i]["attainment"] for rule in Rule},
        }
        for i, day in enumerate(ours)
    ]


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    p = PROFILES[args.profile]()
    curves = curves_for(args, p)
    cfg = day_config(args, args.seed)
    w, load = world_for(args, p, cfg, curves)
    s = scaling_of(args)
    print(f"replica curves: {time.perf_counter() - t0:.1f} s", flush=True)
    defaults = {
        rule: simulate(w, policy_at(w, rule, knob, args.band), s)
        for rule, knob in (
            (Rule.REQUESTS, args.requests_target),
            (Rule.GOODPUT, args.utilization),
            (Rule.DYNAMO, tpot_slo_of(args, p)),
            (Rule.DYNAMO_PROFILED, tpot_slo_of(args, p)),
        )
    }
    tuned = tune_all(w, s, args, p.max_batch)
    oracle_hours = float(w.oracle_replicas().sum() * w.step_s / 3600)
    policies = {
        str(rule): {
            "default": summary(defaults[rule]),
            "tuned": summary(t.best),
            "reached_goal": t.reached,
            "held_out": held_out(args, p, curves, s, t.best.policy),
            "tried": [
                {k: v for k, v in summary(r).items() if k != "hourly_attainment"} for r in t.tried
            ],
        }
        for rule, t in tuned.items()
    }
    hours = {rule: t.best.replica_hours for rule, t in tuned.items()}
    runs = {f"{rule}-tuned": t.best for rule, t in tuned.items()}
    runs |= {f"{rule}-default": r for rule, r in defaults.items()}
    return {
        "benchmark": "autoscale_sim",
        "command": " ".join(["python -m bench.autoscale_sim", *sys.argv[1:]]),
        "profile": {k: v for k, v in asdict(p).items() if k != "step_time"},
        "slo": {"tpot_s": tpot_slo_of(args, p), "ttft_s": w.ttft_slo_s},
        "day": asdict(cfg),
        "scaling": asdict(s),
        "spread": args.spread,
        "goal": args.goal,
        "band": args.band,
        "peak_replicas": args.peak_replicas,
        "peak_rps": peak_rps(args, cfg, curves),
        "max_rps": float(w.rate_rps.max()),  # bursts included
        "mix": {
            "classes": [asdict(c) for c in DEFAULT_MIX],
            "copy_heavy": COPY_HEAVY,
            "creative": CREATIVE,
        },
        "levels": [level(c) for c in w.curves],
        "demand_replica_hours": oracle_hours,
        "policies": policies,
        "ratios": {
            "goodput_over_requests": hours[Rule.GOODPUT] / hours[Rule.REQUESTS],
            "goodput_over_dynamo": hours[Rule.GOODPUT] / hours[Rule.DYNAMO],
            "goodput_over_dynamo_profiled": hours[Rule.GOODPUT] / hours[Rule.DYNAMO_PROFILED],
            "goodput_over_demand": hours[Rule.GOODPUT] / oracle_hours,
            "defaults_goodput_over_requests": defaults[Rule.GOODPUT].replica_hours
            / defaults[Rule.REQUESTS].replica_hours,
            "held_out": _held_out_ratios(policies),
        },
        "timeline": timeline(w, load, runs),
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    report = run(args)
    out: Path = args.out or RESULTS / f"autoscale_sim-{args.label or args.profile}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    for rule, r in report["policies"].items():
        for kind in ("default", "tuned"):
            x = r[kind]
            print(
                f"{rule:>15} {kind:>7}: knob {x['knob']:7.3f}  {x['replica_hours']:9.0f} "
                f"replica-hours  attainment {x['attainment']:.4f}  "
                f"{x['scale_events']:4d} scale events  peak {x['peak_replicas']}"
            )
    print(f"demand at capacity: {report['demand_replica_hours']:.0f} replica-hours")
    print(json.dumps(report["ratios"], indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')} in {report['wall_s']:.1f} s")
    return out


if __name__ == "__main__":
    main()

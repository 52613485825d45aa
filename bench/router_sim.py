"""Router simulator: P prefill and D decode replicas, one workload, each decode routing policy.

Discrete-event and vectorised (``bench/routersim/``): prefill replicas serve prompts first come,
first served with prefix caches, placed by power of two choices with prefix affinity; decode
replicas run continuous batching with adaptive speculation (``speculation.goodput.choose_ks``) and a
step time from a profile (``--profile cpu``: measured on this machine; ``h200``: a 70B target
with an 8B draft at TP=4 on paper, see ``bench/routersim/profiles.py``). The decode router runs
``cluster.routing.policies`` on a ``ReplicaTable``, the code the Ray Serve router runs, and each
decision is timed. Loads are fractions of the decode pool's capacity
(``bench/routersim/capacity.py``); every policy at a load sees the same requests and the same
prefill. The peers' routers (``bench/routersim/peers.py``: Ray Serve LLM's prefix-affinity
router and SGLang's cache-aware one) run beside them. The report also gives the pool's capacity
within the TPOT SLO
(``bench/routersim/slo_capacity.py``) and each load as a fraction of it.

    .venv/bin/python -m bench.router_sim --profile h200 --decode-replicas 1000 \\
        --requests 200000 --loads 0.7 0.8 0.9
    .venv/bin/python -m bench.router_sim --decode-replicas 1000 --requests 1000000 \\
        --loads 0.8 --policies acceptance_aware --label scale
    .venv/bin/python -m bench.router_sim --decode-replicas 100 --requests 300000 \\
        --policies power_of_two --split-shares 0.4 0.45 0.5 --label ceiling  # the oracle
    .venv/bin/python -m bench.router_sim --decode-replicas 100 --requests 300000 \\
        --tpot-slo 0.016 --policies power_of_two slo_aware  # slo_aware routes for --tpot-slo
    .venv/bin/python -m bench.router_sim --decode-replicas 100 --requests 100000 \\
        --tpot-slo 0.016 --engine-slo --policies power_of_two  # engines keep drafts within it

Writes ``bench/results/router_sim-<label>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.routersim.capacity import saturation_rps
from bench.routersim.metrics import measure
from bench.routersim.oracle import PREFIX
from bench.routersim.peers import PEERS
from bench.routersim.prefill import prefill_replicas_for, simulate_prefill
from bench.routersim.profiles import PROFILES
from bench.routersim.report import plot, ratios
from bench.routersim.sim import SimConfig, simulate_decode
from bench.routersim.slo_capacity import slo_capacity
from bench.routersim.workload import DEFAULT_MIX, generate
from speculation.goodput import GUARD_MAX_LOSS

RESULTS = Path(__file__).parent / "results"
POLICIES = ("round_robin", "power_of_two", "least_kv", "acceptance_aware", "slo_aware", *PEERS)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--profile", choices=sorted(PROFILES), default="h200")
    add("--decode-replicas", type=int, default=1000)
    add("--prefill-replicas", type=int, help="default: enough for 70%% prefill utilisation")
    add("--requests", type=int, default=200_000)
    add("--loads", type=float, nargs="+", default=[0.7, 0.8, 0.9], help="fractions of capacity")
    add("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    add(
        "--split-shares",
        type=float,
        nargs="*",
        default=[],
        help="also run the class-split oracle (bench/routersim/oracle.py) at these plain shares",
    )
    add("--stats-period", type=float, default=0.5, help="seconds between routing-stats pushes")
    add("--max-staleness", type=float, default=2.0, help="older stats: power of two instead")
    add("--ttft-slo", type=float, help="seconds; default: the profile's")
    add("--tpot-slo", type=float, help="seconds; default: the profile's")
    add(
        "--engine-slo",
        action="store_true",
        help="the replicas' adaptive speculation keeps drafts from pushing a request past "
        "--tpot-slo (decode.speculation_tpot_slo_s)",
    )
    add(
        "--engine-slo-max-loss",
        type=float,
        default=GUARD_MAX_LOSS,
        help="with --engine-slo: the most of a step's goodput keeping to it may give up "
        "(decode.speculation_tpot_slo_max_loss; 1: always keep to it)",
    )
    add("--probe-noise", type=float, default=0.08, help="std. dev. of the acceptance probe")
    add("--burstiness", type=float, default=1.0, help="coefficient of variation of arrival gaps")
    add("--seed", type=int, default=0)
    add("--label", help="default: <profile>-d<decode replicas>")
    add("--out", type=Path, help="JSON path; default bench/results/router_sim-<label>.json")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    p = PROFILES[args.profile]()
    ttft_slo = args.ttft_slo or p.ttft_slo_s
    tpot_slo = args.tpot_slo or p.tpot_slo_s
    d = args.decode_replicas
    capacity = saturation_rps(p, DEFAULT_MIX, d)
    within = slo_capacity(p, DEFAULT_MIX, d, tpot_slo)
    print(
        f"capacity {capacity:.1f} req/s; within {tpot_slo * 1e3:g} ms {within.rps:.1f} req/s "
        f"({within.split_rps / capacity:.3f} of it split by class, "
        f"{within.mixed_rps / capacity:.3f} mixed): loads "
        + " / ".join(f"{load:g} = {load * capacity / within.rps:.2f}" for load in args.loads)
        + " of it",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    for load in args.loads:
        w = generate(
            args.requests,
            load * capacity,
            DEFAULT_MIX,
            length_scale=p.length_scale,
            probe_noise=args.probe_noise,
            burstiness=args.burstiness,
            seed=args.seed,
        )
        n_prefill = args.prefill_replicas or prefill_replicas_for(w, p)
        t0 = time.perf_counter()
        pre = simulate_prefill(w, p, n_prefill, seed=args.seed)
        prefill_wall = time.perf_counter() - t0
        for policy in [*args.policies, *(f"{PREFIX}{s:g}" for s in args.split_shares)]:
            cfg = SimConfig(
                p, d, policy, args.stats_period, args.max_staleness, seed=args.seed,
                tpot_slo_s=tpot_slo, engine_tpot_slo_s=tpot_slo if args.engine_slo else None,
                engine_slo_max_loss=args.engine_slo_max_loss,
            )  # fmt: skip
            out = simulate_decode(w, pre, cfg)
            m = measure(w, DEFAULT_MIX, pre.first_token_s, out.finish_s, ttft_slo, tpot_slo)
            row = {
                "load": load,
                "rate_rps": load * capacity,
                "load_of_slo_capacity": load * capacity / within.rps,
                "policy": policy,
                "prefill_replicas": n_prefill,
                "prefill_busy": pre.busy_fraction,
                "prefix_hit_rate": float((pre.cached_tokens > 0).mean()),
                **m.as_dict(),
                "decision_us_mean": float(out.decision_s.mean() * 1e6),
                "decision_us_p99": float(np.percentile(out.decision_s, 99) * 1e6),
                "decode_steps": out.steps,
                "choose_ks_memo_entries": out.memo_entries,
                "decode_prefix_hit_rate": out.prefix_hits / w.size,
                "wall_s": prefill_wall + out.wall_s,
            }
            runs.append(row)
            print(
                f"load {load:.2f} {policy:>16}: goodput {m.goodput_rps:9.1f} req/s "
                f"({m.slo_attainment:.1%}), TPOT mean {m.tpot_mean_s * 1e3:5.1f} ms "
                f"p99 {m.tpot_p99_s * 1e3:5.1f} ms, TTFT p99 {m.ttft_p99_s:.2f} s, "
                f"decision {row['decision_us_mean']:6.1f} us, wall {row['wall_s']:6.1f} s, "
                f"TPOT drift {m.tpot_drift:+.1%}",
                flush=True,
            )
    return {
        "benchmark": "router_sim",
        "command": " ".join(["python -m bench.router_sim", *sys.argv[1:]]),
        "profile": {
            **{k: v for k, v in asdict(p).items() if k != "step_time"},
            "step_time_points": [list(pt) for pt in p.step_time.points],
        },
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
        "engine_tpot_slo_s": tpot_slo if args.engine_slo else None,
        "engine_slo_max_loss": args.engine_slo_max_loss if args.engine_slo else None,
        "decode_replicas": d,
        "requests": args.requests,
        "stats_period_s": args.stats_period,
        "max_staleness_s": args.max_staleness,
        "probe_noise": args.probe_noise,
        "burstiness": args.burstiness,
        "mix": [asdict(c) for c in DEFAULT_MIX],
        "capacity_rps": capacity,
        "slo_capacity": {**asdict(within), "rps": within.rps},
        "runs": runs,
        "ratios": ratios(runs),
        "slo_aware_ratios": ratios(runs, "slo_aware"),
        "split_ratios": {
            f"{PREFIX}{s:g}": ratios(runs, f"{PREFIX}{s:g}") for s in args.split_shares
        },
    }


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    label = args.label or f"{args.profile}-d{args.decode_replicas}"
    report = run(args)
    out: Path = args.out or RESULTS / f"router_sim-{label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(json.dumps(report["ratios"], indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return out


if __name__ == "__main__":
    main()

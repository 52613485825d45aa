"""Live decode autoscaling under a shifting mix: when each policy scales, against when the SLO
is first missed.

A multi-node Ray cluster on this machine (``bench.node_chaos.PoolCluster``: a head, a prefill
node, two decode nodes, each its own raylet) serves the embedded SmolLM2-135M with n-gram lookup
(adaptive), decode autoscaling between one and two replicas. Open-loop Poisson arrivals at a
fixed rate; each request is copy-heavy (a prompt to repeat or edit, greedy: lookup accepts most
drafts) or creative (a ShareGPT prompt sampled at 0.9: lookup finds little), the creative
share ramping from 0 to 1 between ``--shift-start`` and ``--shift-end`` seconds. The same
arrivals run once per policy, on a fresh deployment:

- ``goodput``: ``decode.autoscaling.policy: goodput`` (``cluster/capacity_policy.py``), which
  sees each replica's capacity within the TPOT SLO fall as the mix turns creative;
- ``requests``: Ray Serve's request count with ``target_ongoing_requests`` streams a replica.

Reported per policy: the first scale-up (the controller adding a decode replica, seen in
``serve.status()``) and the first SLO miss (the first request to finish with its time per
output token over the SLO), both in seconds from the start of the load, and the misses before
the scale-up. Serve's replicas push their metrics every 10 s, so no policy reacts faster than
that; on two cores a second replica adds no compute, so the run compares when each policy
reacts, not what the reaction buys.

    .venv/bin/python -m bench.autoscale_live --out bench/results/autoscale_live.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
from ray import serve
from ray.serve._private.common import ReplicaState

from bench.copy_prompts import COPY_PROMPTS
from bench.http_client import Timing, timed_chat
from bench.node_chaos import HEAD_RESOURCE, PoolCluster
from cluster.config import TandemConfig
from distill.sharegpt import first_prompts

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Arrival:
    at_s: float  # from the start of the load
    creative: bool
    prompt: str


@dataclass(frozen=True)
class Outcome:
    at_s: float
    creative: bool
    finished_s: float  # from the start of the load
    ttft_s: float
    tpot_s: float  # (total - ttft) / (tokens - 1)
    tokens: int
    error: str | None = None


def arrivals(args: argparse.Namespace) -> list[Arrival]:
    """Poisson arrivals at ``--rate`` for ``--seconds``; creative with the ramp's share."""
    rng = np.random.default_rng(args.seed)
    chat = first_prompts(200, max_chars=400)
    out: list[Arrival] = []
    t, i = 0.0, 0
    while True:
        t += float(rng.exponential(1.0 / args.rate))
        if t >= args.seconds:
            return out
        share = np.clip((t - args.shift_start) / (args.shift_end - args.shift_start), 0.0, 1.0)
        creative = bool(rng.random() < share)
        prompt = chat[i % len(chat)] if creative else COPY_PROMPTS[i % len(COPY_PROMPTS)]
        out.append(Arrival(t, creative, prompt))
        i += 1


def config(args: argparse.Namespace, policy: str) -> TandemConfig:
    scaling: dict[str, Any] = {
        "policy": policy,
        "min_replicas": 1,
        "max_replicas": 2,
        "initial_replicas": 1,
        "upscale_delay_s": 0,
        "downscale_delay_s": 600,
        "look_back_period_s": 11,
        "target_ongoing_requests": args.target_streams,
        "target_utilization": args.target_utilization,
        "downscale_utilization": args.target_utilization / 2,
    }
    return TandemConfig.model_validate(
        {
            "mode": "disaggregated",
            "model": {"source": "embedded", "name": "m"},
            "draft": {"kind": "ngram", "num_speculative_tokens": 4},
            "prefill": {"replicas": 1, "num_blocks": 512, "num_threads": 1},
            "decode": {
                "num_blocks": 1024,
                "num_threads": 1,
                "routing_tpot_slo_s": args.tpot_slo,
                "autoscaling": scaling,
            },
            "http": {"ingress_resource": HEAD_RESOURCE},
            "auth": {"required": False},  # a cluster on loopback, for the run only
        }
    )


def _replicas() -> int:
    """Decode replicas the controller has, starting ones included."""
    status = serve.status().applications["tandem"].deployments["decode"].replica_states
    live = (ReplicaState.STARTING, ReplicaState.UPDATING, ReplicaState.RUNNING)
    return sum(n for s, n in status.items() if s in live)


def run_policy(args: argparse.Namespace, policy: str, load: list[Arrival]) -> dict[str, Any]:
    pc = PoolCluster(config(args, policy))
    try:
        base = pc.deploy(args.port)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        timed_chat(client, "m", "Say hello.", 8)  # warm: both pools have served once
        scaled: list[float] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def watch() -> None:
            while not stop.is_set():
                if not scaled and _replicas() > 1:
                    scaled.append(time.monotonic() - t0)
                stop.wait(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()

        def one(a: Arrival) -> Outcome:
            sp: dict[str, Any] = {"temperature": 0.9, "seed": 1} if a.creative else {}
            if not a.creative:
                sp["temperature"] = 0.0
            try:
                t: Timing = timed_chat(client, "m", a.prompt, args.max_tokens, **sp)
            except openai.APIError as e:
                return Outcome(a.at_s, a.creative, time.monotonic() - t0, 0.0, 0.0, 0, str(e))
            tpot = (t.total_s - t.ttft_s) / max(t.completion_tokens - 1, 1)
            done = time.monotonic() - t0
            return Outcome(a.at_s, a.creative, done, t.ttft_s, tpot, t.completion_tokens)

        futures: list[Future[Outcome]] = []
        with ThreadPoolExecutor(max_workers=64) as pool:
            for a in load:
                time.sleep(max(0.0, a.at_s - (time.monotonic() - t0)))
                futures.append(pool.submit(one, a))
            outcomes = [f.result() for f in futures]
        stop.set()
        watcher.join(5)
    finally:
        pc.close()
    done = sorted((o for o in outcomes if o.error is None), key=lambda o: o.finished_s)
    misses = [o for o in done if o.tpot_s > args.tpot_slo]
    first_miss = misses[0].finished_s if misses else None
    first_scale = scaled[0] if scaled else None
    before = sum(1 for o in misses if first_scale is None or o.finished_s < first_scale)
    return {
        "policy": policy,
        "first_scale_up_s": first_scale,
        "first_slo_miss_s": first_miss,
        "scaled_before_first_miss": first_scale is not None
        and (first_miss is None or first_scale < first_miss),
        "misses_before_scale_up": before,
        "misses": len(misses),
        "requests": len(outcomes),
        "errors": sum(o.error is not None for o in outcomes),
        "outcomes": [asdict(o) for o in outcomes],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=0.5, help="arrivals per second")
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--shift-start", type=float, default=40.0)
    ap.add_argument("--shift-end", type=float, default=100.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tpot-slo", type=float, default=0.09)
    ap.add_argument("--target-streams", type=float, default=4.0)
    ap.add_argument("--target-utilization", type=float, default=0.8)
    ap.add_argument("--policies", nargs="+", default=["goodput", "requests"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--out", type=Path, default=RESULTS / "autoscale_live.json")
    args = ap.parse_args()
    load = arrivals(args)
    runs = [run_policy(args, p, load) for p in args.policies]
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for r in runs:
        print(
            f"{r['policy']}: first scale-up {r['first_scale_up_s']}, first SLO miss "
            f"{r['first_slo_miss_s']}, misses before the scale-up {r['misses_before_scale_up']} "
            f"of {r['misses']} ({r['requests']} requests, {r['errors']} errors)"
        )


if __name__ == "__main__":
    main()

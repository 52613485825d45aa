"""Throughput at capacity and at 3x capacity: does overload turn into fast 429s while the
accepted requests keep the server at its capacity, with no 5xx?

Launches a local cluster from ``--config`` (its ``limits.max_inflight`` is the admission bound),
then runs two phases of the same synthetic workload:

1. capacity: a closed loop of ``limits.max_inflight`` clients; its completed requests per second
   is the measured capacity;
2. overload: Poisson arrivals at ``--factor`` (3) times that capacity, for the same time.

Reports completed req/s and output tok/s of both phases and their ratio, status counts (429s,
5xx), and TTFT/e2e of the requests that were admitted.

    .venv/bin/python -m bench.overload --config bench/configs/overload.yaml [--seconds 120]

Writes bench/results/overload.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.load_metrics import Outcome, summarize
from bench.serve import drive, launched, parse_args, workload

RESULTS = Path(__file__).parent / "results"


def _phase(base: argparse.Namespace, arrivals: list[str], seconds: float) -> argparse.Namespace:
    argv = [
        "--launch",
        "colocated",
        "--config",
        str(base.config),
        "--dataset",
        "synthetic",
        "--input-len",
        "64",
        "--output-len",
        str(base.output_len),
        "--num-requests",
        "100000",
        "--max-seconds",
        str(seconds),
        "--warmup",
        "0",
        *arrivals,
    ]
    return parse_args(argv)


async def _measure(phase: argparse.Namespace, url: str) -> dict[str, Any]:
    _, result = await drive(phase, url, workload(phase))
    s = summarize(result.records, result.duration_s)
    row = asdict(s)
    row["status_counts"] = dict(s.errors)
    row["server_errors"] = sum(
        n for k, n in s.errors.items() if (k.isdigit() and int(k) >= 500) or k == "stream_error"
    )
    row["cancelled_at_time_limit"] = sum(
        1 for r in result.records if r.outcome is Outcome.CANCELLED
    )
    keys = (
        "completed",
        "request_throughput",
        "output_throughput",
        "status_counts",
        "server_errors",
    )
    print(json.dumps({k: row[k] for k in keys}), flush=True)
    return row


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from cluster.config import TandemConfig

    cap = TandemConfig.from_yaml(args.config).limits.max_inflight
    first = _phase(args, ["--concurrency", str(cap)], args.seconds)
    report: dict[str, Any] = {"max_inflight": cap, "seconds": args.seconds, "phases": {}}
    with launched(first) as (url, cfg):
        report["config"] = cfg
        warm = _phase(args, ["--concurrency", "1"], 30)
        await drive(warm, url, workload(warm)[:2])
        report["phases"]["capacity"] = await _measure(first, url)
        rate = report["phases"]["capacity"]["request_throughput"] * args.factor
        report["overload_rate"] = rate
        overload = _phase(args, ["--request-rate", f"{rate:.3f}"], args.seconds)
        report["phases"]["overload"] = await _measure(overload, url)
    cap_row, over = report["phases"]["capacity"], report["phases"]["overload"]
    report["throughput_ratio"] = over["request_throughput"] / cap_row["request_throughput"]
    report["token_throughput_ratio"] = over["output_throughput"] / cap_row["output_throughput"]
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", type=Path, default=Path("bench/configs/overload.yaml"))
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    report = asyncio.run(run(args))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "overload.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: v for k, v in report.items() if k not in ("phases", "config")}))


if __name__ == "__main__":
    main()

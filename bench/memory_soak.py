"""Memory and latency over a sustained load: replica RSS and KV blocks, sampled from /health
while bench/serve.py's load client drives a local cluster, and each minute's time to first
token and time per output token.

    .venv/bin/python -m bench.memory_soak --minutes 10 --concurrency 4 [--ingress-replicas 2]
        [--threads 1] [--out bench/results/memory_soak.json]

Writes the JSON and a PNG beside it. Reports each replica's RSS growth between the end of the
first minute (warm: allocator pools, caches) and the end of the run, the latency of the last
full minute against the first warm one, and whether the KV blocks all came back once the load
stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve import drive, launched, parse_args, workload

RESULTS = Path(__file__).parent / "results"
WARM_S = 60.0


async def _poll(
    base: str, samples: list[dict[str, Any]], misses: list[str], stop: asyncio.Event, t0: float
) -> None:
    """Sample /health every 10 s; an unhealthy answer (a pool too busy to answer its stats in
    time, under full load on 2 cores) is counted in ``misses``, not fatal."""
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            try:
                r = await client.get(base.removesuffix("/v1") + "/health")
                h = r.json() if r.status_code == 200 else None
            except httpx.HTTPError as e:
                h, r = None, None
                misses.append(f"{type(e).__name__}")
            if h is not None:
                samples.append(
                    {
                        "t": time.monotonic() - t0,
                        "decode_rss": h["decode"]["rss_bytes"],
                        "prefill_rss": h["prefill"]["rss_bytes"],
                        "decode_free_blocks": h["decode"]["free_blocks"],
                        "prefill_free_blocks": h["prefill"]["free_blocks"],
                        "prefill_leases": h["prefill"]["active_leases"],
                        "running": h["decode"]["running"],
                    }
                )
            elif r is not None:
                misses.append(f"HTTP {r.status_code}")
            if stop.is_set():
                if h is not None or len(misses) > 100:
                    return
                await asyncio.sleep(2.0)  # the final sample must be a real one
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 10.0)


def _per_minute(records: Any) -> list[dict[str, float]]:
    """Median TTFT and TPOT of the requests that finished, by the minute they were sent in."""
    by: dict[int, list[Any]] = {}
    for r in records:
        if r.outcome.value == "ok" and r.ttft_s is not None and r.output_tokens > 1:
            by.setdefault(int(r.start_s // 60), []).append(r)
    out = []
    for minute in sorted(by):
        rs = by[minute]
        tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in rs]
        out.append(
            {
                "minute": float(minute),
                "requests": float(len(rs)),
                "ttft_ms_median": 1000 * statistics.median(r.ttft_s for r in rs),
                "tpot_ms_median": 1000 * statistics.median(tpot),
            }
        )
    return out


async def run(
    minutes: float, concurrency: int, max_tokens: int, ingress: int, threads: int | None
) -> dict[str, Any]:
    sets = [f"ingress.replicas={ingress}"]
    if threads is not None:
        sets += [f"prefill.num_threads={threads}", f"decode.num_threads={threads}"]
    args = parse_args(
        [
            "--launch",
            "disaggregated",
            "--draft",
            "ngram",
            "--dataset",
            "sharegpt",
            "--num-requests",
            "100000",
            "--concurrency",
            str(concurrency),
            "--max-tokens",
            str(max_tokens),
            "--max-seconds",
            str(minutes * 60),
            *(x for s in sets for x in ("--set", s)),
        ]
    )
    items = workload(args)
    samples: list[dict[str, Any]] = []
    misses: list[str] = []
    with launched(args) as (base, _cfg):
        stop = asyncio.Event()
        t0 = time.monotonic()
        poller = asyncio.create_task(_poll(base, samples, misses, stop, t0))
        _, result = await drive(args, base, items)
        await asyncio.sleep(5)  # let cancelled streams and leases settle
        stop.set()
        await poller
        total = {"decode": _cfg["decode"]["num_blocks"], "prefill": _cfg["prefill"]["num_blocks"]}
    warm = [s for s in samples if s["t"] >= WARM_S] or samples
    last = samples[-1]
    done = sum(1 for r in result.records if r.outcome.value == "ok")
    latency = _per_minute(result.records)
    full = [m for m in latency if m["minute"] >= 1 and m["minute"] < int(minutes)]
    first, final = (full[0], full[-1]) if full else (None, None)
    return {
        "minutes": minutes,
        "concurrency": concurrency,
        "ingress_replicas": ingress,
        "latency_by_minute": latency,
        "tpot_last_over_first_warm_minute": final["tpot_ms_median"] / first["tpot_ms_median"]
        if first and final
        else None,
        "ttft_last_over_first_warm_minute": final["ttft_ms_median"] / first["ttft_ms_median"]
        if first and final
        else None,
        "requests_completed": done,
        "samples": samples,
        "health_misses": misses,
        "decode_rss_growth_mb": (last["decode_rss"] - warm[0]["decode_rss"]) / 2**20,
        "prefill_rss_growth_mb": (last["prefill_rss"] - warm[0]["prefill_rss"]) / 2**20,
        "decode_rss_mb": [warm[0]["decode_rss"] / 2**20, last["decode_rss"] / 2**20],
        "prefill_rss_mb": [warm[0]["prefill_rss"] / 2**20, last["prefill_rss"] / 2**20],
        "blocks_back_after_load": last["decode_free_blocks"] == total["decode"]
        and last["prefill_free_blocks"] == total["prefill"]
        and last["prefill_leases"] == 0,
    }


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["samples"]
    t = [x["t"] / 60 for x in s]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(t, [x["decode_rss"] / 2**20 for x in s], label="decode replica")
    a.plot(t, [x["prefill_rss"] / 2**20 for x in s], label="prefill replica")
    a.set(xlabel="minutes", ylabel="RSS (MiB)", title="replica memory under load")
    a.legend()
    b.plot(t, [x["decode_free_blocks"] for x in s], label="decode free blocks")
    b.plot(t, [x["prefill_free_blocks"] for x in s], label="prefill free blocks")
    b.set(xlabel="minutes", ylabel="KV blocks", title="free KV blocks")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ingress-replicas", type=int, default=1)
    ap.add_argument("--threads", type=int, help="torch threads of each pool (default: all cores)")
    ap.add_argument("--out", type=Path, default=RESULTS / "memory_soak.json")
    a = ap.parse_args()
    report = asyncio.run(run(a.minutes, a.concurrency, a.max_tokens, a.ingress_replicas, a.threads))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2))
    _plot(report, a.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()

"""Memory over a sustained load: replica RSS and KV blocks, sampled from /health while
bench/serve.py's load client drives a local cluster.

    .venv/bin/python -m bench.memory_soak --minutes 10 --concurrency 4

Writes bench/results/memory_soak.json and .png. Reports each replica's RSS growth between the
end of the first minute (warm: allocator pools, caches) and the end of the run, and whether the
KV blocks all came back once the load stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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


async def run(minutes: float, concurrency: int, max_tokens: int) -> dict[str, Any]:
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
    return {
        "minutes": minutes,
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
    a = ap.parse_args()
    report = asyncio.run(run(a.minutes, a.concurrency, a.max_tokens))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "memory_soak.json").write_text(json.dumps(report, indent=2))
    _plot(report, RESULTS / "memory_soak.png")
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()

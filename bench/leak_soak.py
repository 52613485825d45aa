"""Leak check under hostile traffic: ``bench.chaos`` mixes (good, bad, abandoned, cancelled
requests) against a local disaggregated cluster of the embedded model for ``--minutes``, then
compares each pool's free KV blocks, leases and RSS with their values before the load.

    .venv/bin/python -m bench.leak_soak --minutes 5 --concurrency 4

Writes bench/results/leak_soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

from bench.chaos import mixed_traffic
from bench.serve import launched, parse_args

RESULTS = Path(__file__).parent / "results"


def _pools(base: str) -> dict[str, Any]:
    h = httpx.get(base.removesuffix("/v1") + "/health", timeout=60).json()
    return {
        "decode_free_blocks": h["decode"]["free_blocks"],
        "decode_requests": h["decode"]["running"] + h["decode"]["waiting"] + h["decode"]["pulling"],
        "prefill_free_blocks": h["prefill"]["free_blocks"],
        "prefill_leases": h["prefill"]["active_leases"],
        "decode_rss_mb": h["decode"]["rss_bytes"] / 2**20,
        "prefill_rss_mb": h["prefill"]["rss_bytes"] / 2**20,
    }


def _blocks(p: dict[str, Any]) -> tuple[int, ...]:
    keys = ("decode_free_blocks", "decode_requests", "prefill_free_blocks", "prefill_leases")
    return tuple(p[k] for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--lease-wait-s", type=float, default=45.0, help="for abandoned handoffs")
    a = ap.parse_args()
    args = parse_args(["--launch", "disaggregated", "--draft", "ngram"])
    with launched(args) as (base, cfg):
        model = httpx.get(f"{base}/models", timeout=30).json()["data"][0]["id"]
        before = _pools(base)
        t0 = time.monotonic()
        outcomes = asyncio.run(
            mixed_traffic(base.removesuffix("/v1"), a.minutes * 60, a.concurrency, model)
        )
        load_s = time.monotonic() - t0
        deadline = time.monotonic() + a.lease_wait_s  # leases of abandoned handoffs expire
        after = _pools(base)
        while _blocks(after) != _blocks(before) and time.monotonic() < deadline:
            time.sleep(2)
            after = _pools(base)
    report = {
        "minutes": a.minutes,
        "load_seconds": load_s,
        "concurrency": a.concurrency,
        "requests": sum(outcomes.values()),
        "outcomes": dict(sorted(outcomes.items())),
        "server_errors": sum(n for k, n in outcomes.items() if k.split(":")[1].startswith("5")),
        "before": before,
        "after": after,
        "blocks_leaked": {
            "decode": before["decode_free_blocks"] - after["decode_free_blocks"],
            "prefill": before["prefill_free_blocks"] - after["prefill_free_blocks"],
            "leases": after["prefill_leases"],
        },
        "config": cfg,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "leak_soak.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))


if __name__ == "__main__":
    main()

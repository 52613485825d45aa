"""How many NIXL descriptors a KV handoff takes once the pools have been reused for a while.

A handoff whose blocks are consecutive on both sides reads one descriptor per layer and run
(``kvtransfer.read_plan.block_runs``); a block that jumps on either side starts a new run.
This runs the same churn through a prefill pool and a decode pool twice: with
``kvtransfer.allocator.BlockAllocator`` (several blocks at once come from a run of consecutive
free blocks where there is one) and with the allocator it replaced, one free list in the order
blocks were freed (``FreeListOrder``, kept here as the baseline), and reports the runs per
handoff block: 1.0 means a descriptor per block, 1 / n one per handoff of n blocks.

The churn is synthetic and seeded: requests arrive while fewer than ``--concurrency`` decode;
each brings a prompt of a log-normal length (median ``--median-prompt`` tokens, at least one
block), which the prefill pool holds until decode has pulled it, and then decodes a uniform
32-512 tokens, a block at a time, freeing its whole table when it ends.

    .venv/bin/python -m bench.block_runs [--requests 4000] [--concurrency 32]
        [--out bench/results/block_runs.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.load_report import write_json
from kvtransfer.allocator import BlockAllocator
from kvtransfer.read_plan import block_runs

RESULTS = Path(__file__).parent / "results"
BLOCK = 16


class FreeListOrder:
    """The allocator before runs (no prefix caching, which this churn does not use): blocks
    handed out in the order they were freed, a sequence's last-first."""

    def __init__(self, num_blocks: int) -> None:
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    def allocate(self, n: int) -> list[int]:
        return [self._free.popitem(last=False)[0] for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self._free[b] = None


Allocator = BlockAllocator | FreeListOrder


@dataclass
class _Decoding:
    table: list[int]
    left: int  # tokens still to decode
    filled: int  # tokens in the last block


@dataclass
class _Churn:
    """One pass of the churn; the runs per block of every handoff."""

    prefill: Allocator
    decode: Allocator
    per_block: list[float] = field(default_factory=list)
    merged: int = 0  # handoffs that read fewer runs than blocks

    def run(self, rng: random.Random, requests: int, concurrency: int, median: float) -> None:
        active: list[_Decoding] = []
        arrived = 0
        while arrived < requests or active:
            while arrived < requests and len(active) < concurrency:
                arrived += 1
                prompt = max(BLOCK, int(rng.lognormvariate(np.log(median), 0.9)))
                n = -(-prompt // BLOCK)
                src = self.prefill.allocate(n)
                dst = self.decode.allocate(n)
                starts, _lengths = block_runs(np.array(src), np.array(dst))
                self.per_block.append(len(starts) / n)
                self.merged += len(starts) < n
                self.prefill.free(src)  # pulled: the lease ends
                active.append(_Decoding(dst, rng.randint(32, 512), prompt - (n - 1) * BLOCK))
            for r in active:  # one step: every sequence writes a token
                r.left -= 1
                if r.filled == BLOCK:
                    r.table += self.decode.allocate(1)
                    r.filled = 0
                r.filled += 1
            for r in [r for r in active if r.left <= 0]:
                self.decode.free(r.table)
                active.remove(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--median-prompt", type=float, default=250.0)
    ap.add_argument("--prefill-blocks", type=int, default=1024)
    ap.add_argument("--decode-blocks", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "block_runs.json")
    args = ap.parse_args()
    report: dict[str, Any] = {"benchmark": "block_runs", "args": vars(args) | {"out": None}}
    for name, kind in (("runs", BlockAllocator), ("free_list_order", FreeListOrder)):
        churn = _Churn(kind(args.prefill_blocks), kind(args.decode_blocks))
        churn.run(random.Random(args.seed), args.requests, args.concurrency, args.median_prompt)
        late = churn.per_block[len(churn.per_block) // 2 :]  # once the pools have cycled
        report[name] = {
            "runs_per_block_mean": statistics.mean(churn.per_block),
            "runs_per_block_mean_second_half": statistics.mean(late),
            "handoffs_merged": churn.merged / len(churn.per_block),
        }
        print(name, json.dumps(report[name]), flush=True)
    base = report["free_list_order"]["runs_per_block_mean_second_half"]
    report["descriptors_ratio_second_half"] = (
        report["runs"]["runs_per_block_mean_second_half"] / base
    )
    print(f"descriptors, runs over free-list order: {report['descriptors_ratio_second_half']}")
    write_json(args.out, report)


if __name__ == "__main__":
    main()

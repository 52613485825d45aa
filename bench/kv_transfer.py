"""KV handoff speed between two processes on this machine, against a memcpy of the same bytes.

Two Ray actors hold pools laid out for the embedded model (30 layers, 3 KV heads of 64, fp32,
16-token blocks: 737,280 bytes a block, block-major: every layer of a block is one range). The
destination pulls handoffs of 1 and 16 blocks, of 256 blocks scattered over the source's pool
(no two consecutive: a descriptor per block) and of 1k-, 4k- and 16k-token prompts
(consecutive blocks on both sides, as an unfragmented pool gives them: one descriptor) over
NIXL and over the object-store fallback; an in-process
``copy_`` of the same bytes is the ceiling. Then the raw-READ ceiling of ``bench.nixl_ceiling``
in the same run (handoffs of 16 MB or more are reported against its best), and the prefill of
a 1k-token prompt, to put the 1k handoff in proportion.

    .venv/bin/python -m bench.kv_transfer [--repeats 5]

Writes bench/results/kv_transfer.json. UCX is tuned by UCX_* environment variables, passed
through to the actors (e.g. UCX_TLS).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import ray
import torch

from bench.nixl_ceiling import measure
from kvtransfer.handoff import KVCompat, KVHandoff
from kvtransfer.pool import KVGroupSpec, KVPool, KVPoolSpec
from kvtransfer.transport import PullState

RESULTS = Path(__file__).parent / "results"
CEILING_BYTES = 180 * 2**20  # what bench.nixl_ceiling reads by default
BLOCK = 16
SPEC = KVPoolSpec(1100, BLOCK, (KVGroupSpec("target", 30, 3, 64, "float32"),))
COMPAT = KVCompat("bench", "float32", BLOCK, "x", 1, "none", "nixl")
SIZES = {  # blocks, and the stride between the source's block ids
    "1 block": (1, 1),
    "16 blocks": (16, 1),
    # every other block on the source: no two consecutive, one descriptor per block
    "256 blocks, scattered": (256, 2),
    "1k-token prompt": (64, 1),
    "4k-token prompt": (256, 1),
    "16k-token prompt": (1024, 1),
}


class Side:
    """One end of the transfer: a pool and a transport (run as a Ray actor)."""

    def __init__(self, transport: str, role: str) -> None:
        torch.set_num_threads(1)
        self.pool = KVPool(SPEC)
        self.pool.tensor("target").normal_()
        if transport == "nixl":
            from kvtransfer.nixl_transport import NixlTransport

            self.t: Any = NixlTransport(self.pool, role)
        else:
            from kvtransfer.object_store_transport import ObjectStoreTransport

            self.t = ObjectStoreTransport(self.pool, role)
        self.serving = False

    def handoff(self, rid: str, n: int, stride: int = 1) -> KVHandoff:
        blocks = tuple(range(0, n * stride, stride))
        payload = self.t.export(rid, blocks, ("target",))
        return KVHandoff(
            rid,
            self.t.sources(),
            blocks,
            ("target",),
            n * BLOCK,
            0,
            COMPAT,
            60.0,
            payload=payload,
        )

    def serve(self, seconds: float) -> int:
        """Source side: drive progress (serve reads, collect notices) for a while."""
        end, n = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            n += len(self.t.completed())
        return n

    def pull(self, h: KVHandoff) -> float:
        t0 = time.perf_counter()
        p = self.t.start_pull(h, list(range(len(h.block_ids))))
        while (s := self.t.poll(p)) is PullState.PENDING:
            pass
        self.t.release(p)
        assert s is PullState.DONE
        return time.perf_counter() - t0


def memcpy_seconds(n: int, repeats: int) -> float:
    src, dst = KVPool(SPEC), KVPool(SPEC)
    a, b = src.tensor("target")[:, :n], dst.tensor("target")[:, :n]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill_seconds_1k() -> float:
    from models.kv_layout import kv_pool_shape
    from models.spec import ModelSpec
    from models.weights import resolve_checkpoint
    from runtime.runner import LocalRunner, SeqInput

    torch.set_num_threads(2)
    model = ModelSpec(str(resolve_checkpoint("embedded"))).load()
    c = model.cfg
    pool = torch.zeros(kv_pool_shape(64, c.num_kv_heads, c.num_layers, BLOCK, c.head_dim))
    batch = [SeqInput(list(range(64)), 0, list(range(100, 1124)), [1023])]
    runner = LocalRunner(model, pool, BLOCK)  # its modules, the attention chosen for the CPU
    runner.run(batch)
    t0 = time.perf_counter()
    runner.run(batch)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", nargs="*", default=list(SIZES), help="a subset, for tuning runs")
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_transfer.json")
    args = ap.parse_args()
    ucx = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": ucx} if ucx else None)
    side: Any = ray.remote(Side).options(num_cpus=0)
    report: dict[str, Any] = {
        "benchmark": "kv_transfer",
        "block_bytes": SPEC.groups[0].block_bytes(BLOCK),
        "ucx_env": ucx,
        "sizes": {},
    }
    try:
        pairs: dict[str, Any] = {
            t: (side.remote(t, "prefill"), side.remote(t, "decode"))
            for t in ("nixl", "object_store")
        }
        for name, (n, stride) in ((s, SIZES[s]) for s in args.sizes):
            nbytes = n * report["block_bytes"]
            row: dict[str, Any] = {"blocks": n, "source_stride": stride, "bytes": nbytes}
            for t, (src, dst) in pairs.items():
                times: list[float] = []
                for r in range(args.repeats):
                    h = ray.get(src.handoff.remote(f"{t}-{name}-{r}", n, stride))
                    serving = src.serve.remote(2.0 + nbytes / 2e8)  # keep the source progressing
                    times.append(ray.get(dst.pull.remote(h)))
                    ray.get(serving)
                s = statistics.median(times)
                row[t] = {"ms": 1000 * s, "gb_s": nbytes / s / 1e9}
            c = memcpy_seconds(n, args.repeats)
            row["memcpy"] = {"ms": 1000 * c, "gb_s": nbytes / c / 1e9}
            row["nixl_over_memcpy"] = row["nixl"]["gb_s"] / row["memcpy"]["gb_s"]
            report["sizes"][name] = row
            print(name, json.dumps(row), flush=True)
    finally:
        ray.shutdown()
    # the raw-READ ceiling of bench.nixl_ceiling, in this run: handoffs of >= 16 MB against it
    ceiling = measure(CEILING_BYTES, "cpu", args.repeats, 0)
    best = max(v for k, v in ceiling.items() if k.endswith("descriptors_gb_s"))
    report["ceiling"] = ceiling | {"best_gb_s": best}
    for row in report["sizes"].values():
        if row["bytes"] >= 16 * 2**20:
            row["nixl_over_ceiling"] = row["nixl"]["gb_s"] / best
    print("ceiling", json.dumps(report["ceiling"]), flush=True)
    if "1k-token prompt" in report["sizes"]:
        prefill = prefill_seconds_1k()
        report["prefill_1k_s"] = prefill
        report["handoff_1k_over_prefill"] = (
            report["sizes"]["1k-token prompt"]["nixl"]["ms"] / 1000 / prefill
        )
        print("1k prefill", prefill, "handoff/prefill", report["handoff_1k_over_prefill"])
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

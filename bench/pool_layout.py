"""What the pool's layout and pages cost the forward step: the served pool (block-major,
``models.kv_layout``, on transparent huge pages where the system gives them on request)
against a contiguous layer-major pool of the same blocks and values on ordinary pages (the
pool before it was block-major) and on huge pages, and the block-major pool on ordinary pages.

Block-major puts a block of every layer in one range, for the transfer; a layer's blocks are
then a whole block of every layer apart instead of one slab apart, so on 4 KiB pages attention
walks the page tables for nearly every block it reads. For each (batch, context) and model
dtype, the same decode step of the embedded model (every sequence brings one token after
``context`` cached ones) runs over each pool, the pools taking turns for ``--repeats`` rounds
after a warm-up step each; medians per pool, their ratios to the layer-major pool on ordinary
pages, and whether the logits are bit-identical.

    .venv/bin/python -m bench.pool_layout [--shapes 8x256 32x512 8x2048] [--dtypes float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.cpu_serving import serve_on_cpu
from models.cpu.backend import CpuBackend
from models.cpu.row_ops import CpuRowOps
from models.host_memory import huge_page_mapping
from models.kv_layout import kv_pool_shape, new_kv_pool
from models.spec import ModelSpec
from models.weights import resolve_checkpoint
from runtime.runner import SeqInput, run_step

RESULTS = Path(__file__).parent / "results"
BLOCK = 16


def _measure(served: CpuBackend, batch: int, context: int, repeats: int) -> dict[str, Any]:
    model = served.model
    c = model.cfg
    nb = (context + 1 + BLOCK - 1) // BLOCK
    shape = (batch * nb, c.num_kv_heads, c.num_layers, BLOCK, c.head_dim)
    block_major = new_kv_pool(*shape, model.dtype)
    block_major.normal_(generator=torch.Generator().manual_seed(0))
    size = block_major.numel() * block_major.element_size()
    huge = torch.frombuffer(huge_page_mapping(size), dtype=model.dtype).view(kv_pool_shape(*shape))
    small_pages = torch.empty(block_major.transpose(0, 1).shape, dtype=model.dtype)
    pools = {
        "layer_major": torch.empty(kv_pool_shape(*shape), dtype=model.dtype),
        "layer_major_huge_pages": huge,
        "block_major_small_pages": small_pages.transpose(0, 1),
        "block_major": block_major,
    }
    for pool in pools.values():
        if pool is not block_major:
            pool.copy_(block_major)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    steps = [SeqInput(t, context, [5], [0]) for t in tables]
    times: dict[str, list[float]] = {k: [] for k in pools}
    logits: dict[str, torch.Tensor] = {}
    for name, pool in pools.items():
        logits[name] = run_step(served, pool, steps).logits  # warm-up
    for _ in range(repeats):
        for name, pool in pools.items():
            t0 = time.perf_counter()
            run_step(served, pool, steps)
            times[name].append(time.perf_counter() - t0)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    base = ms["layer_major"]
    out: dict[str, Any] = {
        "batch": batch,
        "context": context,
        "dtype": str(model.dtype).removeprefix("torch."),
        **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
        **{f"{k}_over_layer_major": round(ms[k] / base, 3) for k in list(ms)[1:]},
        "logits_identical": all(torch.equal(logits["layer_major"], x) for x in logits.values()),
    }
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="*", default=["8x256", "32x512", "8x2048"])
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "pool_layout.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtypes:
        model = ModelSpec(str(resolve_checkpoint("embedded")), dtype).load(ops=CpuRowOps())
        served = serve_on_cpu(model, BLOCK)
        for shape in args.shapes:
            batch, context = (int(x) for x in shape.split("x"))
            rows.append(_measure(served, batch, context, args.repeats))
    report = {"benchmark": "pool_layout", "threads": args.threads, "steps": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

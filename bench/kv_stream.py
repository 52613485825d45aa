"""What reading the KV from memory costs a decode step on this CPU, and what the layer program's
optional fetch of the next layer's KV during the MLP (``models/cpu/csrc/layer_program.c``, off
as served) does to it.

For each (batch, context), the embedded model's decode step (every sequence one greedy token
after ``context`` cached ones, ``run_step``) runs twice over the same pool, taking turns for
``--repeats`` rounds after a warm-up: once as served, each sequence's context in blocks of its
own (``batch x context`` tokens of KV streamed from memory every step), and once with every
sequence's context in the same blocks (only the last, written, block its own), so the KV a
layer reads is a few hundred kilobytes that stay in cache. The arithmetic is the same in both:
the same rows, matmuls and attention lengths. The difference is what the memory traffic of the
KV adds to the step. The served step also runs with the fetch on (``fetch``: the CPU backend's
program's ``fetch_next_kv``), so the report gives the KV stream's cost both ways.

    .venv/bin/python -m bench.kv_stream [--shapes 8x150 32x150 32x512] [--repeats 25]
        [--out bench/results/kv_stream.json]
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
from bench.load_report import write_json
from models.cpu.backend import CpuBackend
from models.cpu.row_ops import CpuRowOps
from models.kv_layout import new_kv_pool
from models.spec import ModelSpec
from models.weights import resolve_checkpoint
from runtime.runner import SeqInput, run_step

RESULTS = Path(__file__).parent / "results"
BLOCK = 16


def _measure(served: CpuBackend, batch: int, context: int, repeats: int) -> dict[str, Any]:
    model = served.model
    c = model.cfg
    nb = -(-(context + 1) // BLOCK)
    pool = new_kv_pool(batch * nb, c.num_kv_heads, c.num_layers, BLOCK, c.head_dim, model.dtype)
    pool.normal_(generator=torch.Generator().manual_seed(0))
    own = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    shared = [[*range(nb - 1), t[-1]] for t in own]  # the last block: where it writes
    steps = {
        name: [SeqInput(t, context, [5 + i], [0], argmax_only=True) for i, t in enumerate(ts)]
        for name, ts in (("own_blocks", own), ("fetch", own), ("shared_blocks", shared))
    }
    program = served.program
    assert program is not None
    times: dict[str, list[float]] = {name: [] for name in steps}
    tokens: dict[str, torch.Tensor] = {}
    for _ in range(repeats + 1):  # the first round warms up
        for name, seqs in steps.items():
            program.fetch_next_kv = name == "fetch"
            t0 = time.perf_counter()
            tokens[name] = run_step(served, pool, seqs).argmax(slice(None))
            times[name].append(time.perf_counter() - t0)
    program.fetch_next_kv = False
    ms = {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}
    kv_bytes = batch * context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    out = {
        "batch": batch,
        "context": context,
        "kv_mb_read": round(kv_bytes / 1e6, 1),
        "own_blocks_ms": round(ms["own_blocks"], 2),
        "own_blocks_fetch_ms": round(ms["fetch"], 2),
        "shared_blocks_ms": round(ms["shared_blocks"], 2),
        "kv_stream_ms": round(ms["own_blocks"] - ms["shared_blocks"], 2),
        "kv_stream_fetch_ms": round(ms["fetch"] - ms["shared_blocks"], 2),
        "fetch_over_no_fetch": round(ms["fetch"] / ms["own_blocks"], 3),
        "tokens_identical": torch.equal(tokens["own_blocks"], tokens["fetch"]),
    }
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=["8x150", "32x150", "32x512"])
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "kv_stream.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = ModelSpec(str(resolve_checkpoint("embedded")), "float32").load(ops=CpuRowOps())
    served = serve_on_cpu(model, BLOCK)
    rows = []
    for shape in args.shapes:
        batch, context = (int(x) for x in shape.split("x"))
        rows.append(_measure(served, batch, context, args.repeats))
    write_json(
        args.out,
        {
            "benchmark": "kv_stream",
            "model": "embedded, float32",
            "threads": args.threads,
            "steps": rows,
        },
    )


if __name__ == "__main__":
    main()

"""The start-up warm-up at the 8B shape (``bench.gpu_check`` section ``warm_up_8b_bf16``): every
bucket of a 64-sequence, 8k-token, k = 4 decode replica stepped once (a CUDA graph captured and
the flex kernels compiled for each on a GPU), timed; then a mixed run of decodes and
verifications at random batch sizes and contexts, counting what traffic still compiles or
captures, and a few ragged prompt chunks after it, counted apart.

    python -m bench.gpu_warm_up [--small]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from bench.gpu_models import LLAMA_8B, SMALL_8B, random_model, served_backend
from runtime.runner import synchronize


def measure(dev: str, small: bool) -> dict[str, Any]:
    from models.attention.flex_kernel import FlexKernel
    from models.kv_layout import new_kv_pool
    from runtime.bucketed import BucketedRunner
    from runtime.runner import SeqInput
    from runtime.warm_up import warm_up

    model = random_model(SMALL_8B if small else LLAMA_8B, dev)
    c = model.cfg
    seqs, query, max_len = (4, 5, 512) if small else (64, 5, 8192)
    max_blocks = max_len // 16
    num_blocks = 2 * max_blocks if small else 2048  # tables overlap: only shapes matter here
    pool = new_kv_pool(num_blocks, c.num_kv_heads, c.num_layers, 16, c.head_dim, model.dtype, dev)
    runner = BucketedRunner(
        model,
        pool,
        16,
        seqs,
        query,
        max_blocks,
        dev == "cuda",
        served_backend(model, pool, FlexKernel()),
    )
    done = warm_up(runner, runner)
    runner.serving()
    rng = random.Random(0)
    steps = 40 if small else 200
    hit = set()
    t0 = time.perf_counter()
    for _ in range(steps):
        batch = []
        for _ in range(rng.randint(1, seqs)):
            q = rng.randint(1, query)
            cached = rng.randint(1, max_len - q)
            blocks = -(-(cached + q) // 16)
            start = rng.randint(0, num_blocks - blocks)
            table = list(range(start, start + blocks))
            batch.append(SeqInput(table, cached, list(range(q)), list(range(q))))
        hit.add(runner.buffers.fill(batch).bucket)
        runner.run(batch)
    synchronize(dev)
    mixed_s = time.perf_counter() - t0
    compiles, captures = runner.during_traffic()
    # prompt chunks: ragged, outside the warm-up's grid
    for tokens in (50, 200, 500) if small else (300, 1000, 2048):
        table = list(range(-(-tokens // 16)))
        runner.run([SeqInput(table, 0, list(range(tokens)), [tokens - 1])])
    synchronize(dev)
    prompt_compiles, _ = runner.during_traffic()
    return {
        "shape": "small" if small else "llama-3.1-8b",
        "buckets": done.buckets,
        "warm_up_s": done.seconds,
        "warm_up_compiles": done.compiles,
        "warm_up_captures": done.captures,
        "mixed_steps": steps,
        "mixed_buckets_hit": len(hit),
        "mixed_s": mixed_s,
        "compiles_during_mixed_run": compiles,
        "captures_during_mixed_run": captures,
        "ragged_steps": runner.ragged_steps,
        "compiles_by_prompt_chunks": prompt_compiles - compiles,
        "attention": runner.backend.attention.describe(),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(json.dumps(measure(dev, args.small), indent=2))


if __name__ == "__main__":
    main()

"""Where a prefill replica's memory goes under prompts of ever new lengths: a diagnostic.

A lone ``PrefillWorker`` of the default configuration (the embedded model, its drafter,
the object-store transport, leases ended at once) runs ``--rounds`` rounds of 1–4 prompts of
random tokens, each round's length drawn from 20–200, 200–900 or 900–1,800 tokens. Every 10
rounds it records the process's anonymous memory, then again after ``malloc_trim(0)`` (what
glibc's arenas held free and gave back), with the live CPU tensors and Python objects. Flat
tensors and objects under rising memory mean native memory: the allocator's arenas, or
caches keyed by shape. ``--onednn-cache N`` caps oneDNN's primitive cache (one entry per
shape) and ``--lru-cache N`` PyTorch's cache of oneDNN computations (``LRU_CACHE_CAPACITY``)
to see their shares; ``--arena-max N`` limits glibc's malloc arenas. It also records the
prompt tokens per second of the forwards, to price each setting.

    .venv/bin/python -m bench.prefill_memory [--rounds 60] [--onednn-cache N]
        [--lru-cache N] [--arena-max N] [--out bench/results/prefill_memory.json]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.load_report import write_json
from models.host_memory import anon_bytes  # imports no torch: the cache sizes still apply

RESULTS = Path(__file__).parent / "results"
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def _anon_mib() -> float:
    return anon_bytes() / 2**20


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--onednn-cache", type=int, default=None, help="oneDNN primitive cache size")
    ap.add_argument("--lru-cache", type=int, default=None, help="PyTorch's oneDNN LRU cache size")
    ap.add_argument("--arena-max", type=int, default=None, help="glibc malloc arenas at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "prefill_memory.json")
    args = ap.parse_args(argv)
    if args.onednn_cache is not None:  # read when oneDNN starts: before torch is imported
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(args.onednn_cache)
    if args.lru_cache is not None:
        os.environ["LRU_CACHE_CAPACITY"] = str(args.lru_cache)
    libc = ctypes.CDLL("libc.so.6")
    if args.arena_max is not None:
        libc.mallopt(_M_ARENA_MAX, args.arena_max)

    import torch

    from cluster.builder import engine_configs, resolve_models
    from cluster.config import TandemConfig
    from models.request import Request
    from models.sampling import SamplingParams
    from prefill.worker import PrefillWorker

    torch.set_num_threads(1)
    cfg = TandemConfig.model_validate({})
    _, wc = engine_configs(cfg, resolve_models(cfg))
    assert wc is not None
    worker = PrefillWorker(replace(wc, transport="object_store", lease_seconds=0.0))
    trim = libc.malloc_trim
    rng = random.Random(args.seed)
    vocab = wc.target.config().vocab_size
    trim(0)
    base = _anon_mib()
    rows: list[dict[str, Any]] = []
    busy_s, tokens = 0.0, 0
    for i in range(args.rounds):
        lo, hi = rng.choice([(20, 200), (200, 900), (900, 1800)])
        n = rng.randint(lo, hi)
        reqs = [
            Request(
                f"r{i}-{j}",
                [rng.randint(3, vocab - 1) for _ in range(n)],
                SamplingParams(max_tokens=8),
            )
            for j in range(rng.randint(1, 4))
        ]
        done: list[object] = []
        for r in reqs:
            worker.submit(r, done.append)
        t0 = time.perf_counter()
        while len(done) < len(reqs):
            worker.step()
        busy_s += time.perf_counter() - t0
        tokens += n * len(reqs)
        worker.reap(now=time.monotonic() + 1e6)  # no decode pulls: end the leases now
        if i % 10 == 9:
            grown = _anon_mib() - base
            trim(0)
            tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
            row = {
                "rounds": i + 1,
                "anon_growth_mib": round(grown, 1),
                "after_trim_growth_mib": round(_anon_mib() - base, 1),
                "live_tensors": len(tensors),
                "python_objects": len(gc.get_objects()),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    worker.close()
    doc = {
        "rounds": args.rounds,
        "onednn_cache": args.onednn_cache,
        "lru_cache": args.lru_cache,
        "arena_max": args.arena_max,
        "prompt_tokens_per_s": round(tokens / busy_s, 1),
        "samples": rows,
    }
    print(f"{doc['prompt_tokens_per_s']} prompt tokens/s")
    out: Path = args.out
    write_json(out, doc)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()

"""One layer's paged attention at Llama-3.1-8B's KV shape (8 KV heads of 128, 4 query heads each,
a block-major pool of 32 layers, tables above block 2,048), for every kind of step: flex reading
the pool in place against gathering (SDPA), each timed with its K/V write, and their largest
difference. What the flex backend's rule (``FlexKernel.min_context_tokens``: which steps gather
on a GPU) is measured on; ``bench.gpu_check``'s section ``attention_8b_bf16``.

    python -m bench.gpu_attention [--small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from models.attention.backend import AttentionBackend, paged_attention
from models.attention.flex import FlexBackend, FlexGroup
from models.attention.flex_kernel import FlexKernel
from models.attention.metadata import AttentionSpec, SeqSlice
from models.attention.reference import ReferenceBackend
from models.kv_layout import block_chunks, new_kv_pool
from models.layers import RotaryEmbedding
from models.tree import TreeSpan
from runtime.runner import synchronize

BS = 16
# a width-4 draft tree, 4 deep, under the last accepted token: 17 nodes
TREE = (-1, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)


@dataclass(frozen=True)
class Shape:
    kv_heads: int
    group: int
    head_dim: int
    layers: int
    num_blocks: int
    scale: int  # contexts and prompts are divided by it


FULL = Shape(8, 4, 128, 32, 4096, 1)
SMALL = Shape(2, 4, 32, 3, 320, 16)
# the dry run's cases (each compiles a kernel on a CPU): a decode, a tree and a prompt chunk
# over a context; tests/models/attention covers verifications and windows in place
SMALL_CASES = ("decode_b1_1k", "tree_w4_b8_1k", "prompt_2k_after_6k")


def cases(scale: int) -> dict[str, tuple[list[tuple[int, int, bool]], int | None]]:
    """Each case's sequences (cached, new, tree?) and sliding window."""
    k = 1000 // scale
    return {
        "decode_b1_1k": ([(k, 1, False)], None),
        "decode_b64_1k": ([(k, 1, False)] * 64, None),
        "verify_k4_b32_1k": ([(k, 5, False)] * 32, None),
        "tree_w4_b8_1k": ([(k, len(TREE), True)] * 8, None),
        "prompt_2k": ([(0, 2048 // scale, False)], None),
        "prompt_2k_after_6k": ([(6144 // scale, 2048 // scale, False)], None),
        "decode_b8_6k_window_4k": ([(6000 // scale, 1, False)] * 8, 4096 // scale),
    }


def _seqs(kinds: list[tuple[int, int, bool]], num_blocks: int) -> list[SeqSlice]:
    """Tables from the top of the pool down (past block 2,048 first)."""
    out, top = [], num_blocks
    for cached, new, tree in kinds:
        n = -(-(cached + new) // BS)
        table = list(range(top - n, top))
        top -= n
        span = TreeSpan(cached, TREE) if tree else None
        out.append(SeqSlice(table, cached, new, span))
    if top < 1:
        raise ValueError("the case does not fit the pool")
    return out


def _time(dev: str, fn: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()
    for _ in range(2):  # the first calls compile
        out = fn()
    times = []
    for _ in range(repeats):
        synchronize(dev)
        t0 = time.perf_counter()
        out = fn()
        synchronize(dev)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times), out


def measure(dev: str, small: bool, repeats: int | None = None) -> dict[str, Any]:
    """``repeats``: timed calls per path and case (default 10; 2 for the small dry run)."""
    shape = SMALL if small else FULL
    repeats = repeats or (2 if small else 10)
    pool = new_kv_pool(
        shape.num_blocks, shape.kv_heads, shape.layers, BS, shape.head_dim, torch.bfloat16, dev
    )
    layer = pool[shape.layers // 2]
    layer.normal_(0.0, 1.0)
    rope = RotaryEmbedding(shape.head_dim, 1 << 16, 500000.0, torch.device(dev))
    base = AttentionSpec(
        block_size=BS,
        group_size=shape.group,
        head_dim=shape.head_dim,
        num_kv_heads=shape.kv_heads,
        num_blocks=shape.num_blocks,
        block_chunks=block_chunks(layer),
        rope_cos=rope.cos,
        rope_sin=rope.sin,
        device=torch.device(dev),
    )
    kernel = FlexKernel(min_context_tokens=0, max_view_elements=None)
    gen = torch.Generator(device=dev).manual_seed(0)
    out: dict[str, Any] = {"shape": "small" if small else "llama-3.1-8b", "cases": {}}
    for name, (kinds, window) in cases(shape.scale).items():
        if small and name not in SMALL_CASES:
            continue
        spec = replace(base, window=window)
        seqs = _seqs(kinds, shape.num_blocks)
        t = sum(s.num_new for s in seqs)
        hq, d = shape.kv_heads * shape.group, shape.head_dim
        q = torch.randn(t, hq, d, generator=gen, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(2, t, shape.kv_heads, d, generator=gen, device=dev, dtype=torch.bfloat16)
        row: dict[str, Any] = {"tokens": t, "context": sum(s.num_cached for s in seqs)}
        results: dict[str, torch.Tensor] = {}
        backends: dict[str, AttentionBackend] = {
            "inplace": FlexBackend(spec, kernel),
            "gather": ReferenceBackend(spec),
        }
        for path, backend in backends.items():
            t0 = time.perf_counter()
            meta = backend.plan(seqs)
            row[f"{path}_plan_ms"] = 1000 * (time.perf_counter() - t0)
            if path == "inplace":
                row["in_place"] = all(isinstance(g, FlexGroup) for g in meta.groups)
            step = partial(paged_attention, q, kv[0], kv[1], layer, meta, d**-0.5)
            row[f"{path}_ms"], results[path] = _time(dev, step, repeats)
        row["gather_over_inplace"] = row["gather_ms"] / row["inplace_ms"]
        diff = (results["inplace"].float() - results["gather"].float()).abs().max()
        row["max_abs_diff"] = diff.item()
        out["cases"][name] = row
        print(name, json.dumps(row), flush=True)
    out["flex_fallbacks"] = kernel.fallbacks
    out["flex_failed_shapes"] = list(kernel.failed_shapes.values())
    out["flex_plan_failures"] = kernel.plan_failures
    out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true", help="a small shape (CPU dry run)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(json.dumps(measure(dev, args.small), indent=2))


if __name__ == "__main__":
    main()

"""The panel matmul kernel (``models/cpu/csrc/panel_linear.c``) with and without fetching weights
ahead, over the embedded model's weights, from one row to a prompt chunk.

The kernel multiplies a group of panels by the rows a tile at a time. fp32 from a few rows on
goes in blocks of K steps: the tiles after a block's first fetch the next block's weights into
L2 while they compute from L1. bf16 tiles after a group's first fetch the next group's weights
while they compute from cache. Either way the memory streams while the tiles compute.
The baseline is the same source built with ``-DTANDEM_NO_FETCH_AHEAD`` (the fetch compiled
out); both builds run the same calls in turns, ``--repeats`` rounds: every decoder layer's
four matmuls (qkv, o, gate-up, down: the 30 layers' shapes), and the ``lm_head`` apart. Reports
each median, their ratio, and whether the outputs are bit-identical.

Each row also gives the kernel's rate in multiply-adds a second and its fraction of the CPU's
ceiling for its kind, measured in the same run by ``bench/csrc/fma_ceiling.c`` (every thread
issuing the kind's instruction on registers alone: fp32 fused multiply-adds, or the bf16
dot product, two multiply-adds a lane): how far the kernel is from what the cores can do, not
an estimate of it.

    .venv/bin/python -m bench.panel_matmul [--rows 1 8 16 32 64 1400] [--kinds F32 BF16]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from models.cpu import native
from models.cpu.linear import FLAGS, SOURCE, PanelKind, pack_panels

RESULTS = Path(__file__).parent / "results"
CEILING = Path(__file__).parent / "csrc" / "fma_ceiling.c"
HIDDEN, INTER, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152  # the embedded model
LAYER_SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def _load(flags: tuple[str, ...]) -> Callable[..., int]:
    lib = ctypes.CDLL(str(native.build_library(SOURCE, flags)))
    fn: Callable[..., int] = lib.tandem_panel_linear
    fn.restype = ctypes.c_int  # type: ignore[attr-defined]
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ctypes.c_int, p, i64, p, p, p, i64, i64, i64, i64]  # type: ignore[attr-defined]
    return fn


def fma_ceiling(kind: PanelKind, iters: int = 50_000_000) -> float:
    """The cores' multiply-adds a second on registers alone (``bench/csrc/fma_ceiling.c``): fp32
    fused multiply-adds, or the bf16 dot-product instruction for the bf16 kind (0 where the CPU
    lacks it); best of three, on torch's OpenMP threads."""
    lib = ctypes.CDLL(str(native.build_library(CEILING, FLAGS)))
    fn = lib.tandem_bf16_ceiling if kind is PanelKind.BF16 else lib.tandem_fma_ceiling
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int64]
    return max(float(fn(iters)) for _ in range(3))


def _measure(
    fns: dict[str, Callable[..., int]],
    kind: PanelKind,
    shapes: list[tuple[int, int]],
    m: int,
    repeats: int,
    ceiling: float,
) -> dict[str, Any]:
    dt = torch.bfloat16 if kind is PanelKind.BF16 else torch.float32
    gen = torch.Generator().manual_seed(0)
    weights = [
        (pack_panels(torch.randn(n, k, generator=gen).to(dt), kind), n, k) for n, k in shapes
    ]
    xs = {k: torch.randn(m, k, generator=gen).to(dt) for _, k in shapes}
    ys = {name: [torch.empty(m, n, dtype=dt) for _, n, _ in weights] for name in fns}

    def run(name: str) -> float:
        t0 = time.perf_counter()
        for (w, n, k), y in zip(weights, ys[name], strict=True):
            x = xs[k]
            rc = fns[name](int(kind), x.data_ptr(), k, w.data_ptr(), None, y.data_ptr(), n, m, n, k)
            assert rc == 0, rc
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name in fns}
    for name in fns:
        run(name)  # warm-up
    for _ in range(repeats):
        for name in fns:
            times[name].append(run(name))
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    flops = 2 * m * sum(n * k for n, k in shapes)
    return {
        "rows": m,
        **{f"{name}_ms": round(v, 3) for name, v in ms.items()},
        "fetch_ahead_over_baseline_time": round(ms["fetch_ahead"] / ms["baseline"], 3),
        "fetch_ahead_gflops": round(flops / ms["fetch_ahead"] / 1e6, 1),
        "fetch_ahead_of_fma_ceiling": (
            round(flops / 2 / (ms["fetch_ahead"] / 1e3) / ceiling, 3) if ceiling else None
        ),
        "identical": all(
            torch.equal(a, b) for a, b in zip(ys["fetch_ahead"], ys["baseline"], strict=True)
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 1400])
    ap.add_argument("--kinds", nargs="+", default=["F32", "BF16"])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "panel_matmul.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fns = {
        "fetch_ahead": _load(FLAGS),
        "baseline": _load((*FLAGS, "-DTANDEM_NO_FETCH_AHEAD")),
    }
    ceilings: dict[str, float] = {}
    rows = []
    for kind_name in args.kinds:
        kind = PanelKind[kind_name]
        ceiling = ceilings[kind_name] = fma_ceiling(kind)
        print(f"{kind_name} multiply-add ceiling: {ceiling / 1e9:.1f} G/s", flush=True)
        for what, shapes in (("layers", LAYER_SHAPES * LAYERS), ("lm_head", [(VOCAB, HIDDEN)])):
            for m in args.rows:
                row = {
                    "kind": kind_name,
                    "weights": what,
                    **_measure(fns, kind, shapes, m, args.repeats, ceiling),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    report = {
        "benchmark": "panel_matmul",
        "threads": args.threads,
        "fma_ceiling_g_per_s": {k: round(v / 1e9, 1) for k, v in ceilings.items()},
        "calls": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Where a CPU decode forward's time goes, by taking its kernels away one at a time.

The embedded model, readied as a CPU replica serves it (``models.cpu.backend.CpuBackend``), one
sequence after a 200-token prompt, one-token decode forwards (``run_step``, logits included),
median of ``--steps``:

1. the forward as served: the decoder layers in one C call (``models.cpu.program``);
2. the same forward with the layers run as modules (the backend's program off), alternated
   with 1;
3. the modules with the panel matmul kernel's calls made no-ops (``models.cpu.linear``): what
   is left is everything but the matmuls' arithmetic and weight stream;
4. the same with the CPU attention kernel's calls made no-ops too (``models.cpu.paged``): what
   is left is the modules' host work (module calls, views, the KV write, norms, rotation,
   residual adds, sampling-free logits plumbing).

Outputs of 3 and 4 are garbage; only their times are kept. The differences are the matmuls'
and attention's share of a step run as modules; ``program_saves_ms`` is 2 less 1.

    .venv/bin/python -m bench.step_breakdown [--dtypes float32 bfloat16] [--steps 40]
        [--out bench/results/step_breakdown.json]
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
from models.cpu.linear import CpuLinear
from models.cpu.paged import CpuPagedAttention
from models.cpu.row_ops import CpuRowOps
from models.kv_layout import kv_pool_shape
from models.spec import ModelSpec
from models.weights import resolve_checkpoint
from runtime.runner import SeqInput, run_step

RESULTS = Path(__file__).with_name("results")
BLOCK = 16


def _median_ms(step: Any, steps: int) -> float:
    for i in range(5):
        step(i)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def breakdown(dtype: str, steps: int) -> dict[str, float]:
    model = ModelSpec(str(resolve_checkpoint("embedded")), dtype).load(ops=CpuRowOps())
    backend = serve_on_cpu(model, BLOCK)
    assert backend.packed, "this benchmark measures the CPU's packed path"
    c = model.cfg
    shape = kv_pool_shape(64, c.num_kv_heads, c.num_layers, BLOCK, c.head_dim)
    pool = torch.zeros(shape, dtype=model.dtype)
    table = list(range(64))
    run_step(backend, pool, [SeqInput(table, 0, list(range(100, 300)), [199])])

    def step(i: int) -> None:
        run_step(backend, pool, [SeqInput(table, 200 + i % 400, [5], [0])])

    program = backend.program
    assert program is not None, "this benchmark measures the layer program"
    served, modules = [], []
    for _ in range(5):  # alternated: this machine's speed drifts
        backend.program = program
        served.append(_median_ms(step, max(steps // 5, 3)))
        backend.program = None  # the layers as modules from here on
        modules.append(_median_ms(step, max(steps // 5, 3)))
    out = {"served_ms": statistics.median(served), "modules_ms": statistics.median(modules)}
    out["program_saves_ms"] = out["modules_ms"] - out["served_ms"]
    linear_run, attend = CpuLinear.run, CpuPagedAttention.attend
    try:
        setattr(CpuLinear, "run", lambda self, kind, x, data, scale, y: None)  # noqa: B010
        out["without_matmuls_ms"] = _median_ms(step, steps)

        def no_attention(self: Any, q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

        setattr(CpuPagedAttention, "attend", no_attention)  # noqa: B010
        out["host_work_ms"] = _median_ms(step, steps)
    finally:
        setattr(CpuLinear, "run", linear_run)  # noqa: B010
        setattr(CpuPagedAttention, "attend", attend)  # noqa: B010
        backend.program = program
    out["matmuls_ms"] = out["modules_ms"] - out["without_matmuls_ms"]
    out["attention_ms"] = out["without_matmuls_ms"] - out["host_work_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "step_breakdown.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"benchmark": "step_breakdown", "threads": args.threads}
    for dt in args.dtypes:
        report[dt] = breakdown(dt, args.steps)
        print(dt, json.dumps({k: round(v, 2) for k, v in report[dt].items()}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

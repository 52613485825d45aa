"""What a CPU replica's matmuls cost by the panel kernel against oneDNN, on this machine.

The panel kernel (``models.cpu.linear``) tiles in 16-float registers; built without AVX-512F
its tiles spill, and ``PanelUse.AUTO`` then serves through oneDNN instead. This times one
served step of the embedded model (fp32, one thread, context 128) both ways, interleaved round
by round, at decode batches 1/8/32, an 8 x 5 verification and a 128-token prompt, and reports
each step's oneDNN time over the panel kernel's (below 1: oneDNN is faster here).

    .venv/bin/python -m bench.panel_fallback [--rounds 3] [--out bench/results/panel_fallback.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from models.cpu.backend import CpuBackend
from models.cpu.linear import CpuLinear, PanelUse
from models.cpu.row_ops import CpuRowOps
from models.kv_layout import new_kv_pool
from models.spec import ModelSpec
from models.weights import resolve_checkpoint
from runtime.backends import model_backend
from runtime.runner import LocalRunner, SeqInput, device_name

RESULTS = Path(__file__).parent / "results"
CONTEXT = 128
PER_SEQ = 9  # blocks of 16 for 128 tokens of context and a few new ones
SHAPES = ((1, 1), (8, 1), (32, 1), (8, 5))  # (batch, new tokens per sequence)


def _runner(folder: Path, use: PanelUse) -> LocalRunner:
    model = ModelSpec(str(folder), "float32").load(ops=CpuRowOps())
    c = model.cfg
    pool = new_kv_pool(32 * PER_SEQ, c.num_kv_heads, c.num_layers, 16, c.head_dim, model.dtype)
    backend = model_backend(model, pool, 16, panel=use)
    assert isinstance(backend, CpuBackend)
    return LocalRunner(model, pool, 16, backend)


def _cases() -> dict[str, list[SeqInput]]:
    tables = [list(range(i * PER_SEQ, (i + 1) * PER_SEQ)) for i in range(32)]
    cases = {
        f"b{b}x{w}": [SeqInput(t, CONTEXT, [1] * w, list(range(w))) for t in tables[:b]]
        for b, w in SHAPES
    }
    cases["prompt128"] = [SeqInput(tables[0], 0, [1] * CONTEXT, [CONTEXT - 1])]
    return cases


def measure(rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    folder = resolve_checkpoint("embedded")
    runners = {use.value: _runner(folder, use) for use in (PanelUse.ALWAYS, PanelUse.NEVER)}
    tables = [list(range(i * PER_SEQ, (i + 1) * PER_SEQ)) for i in range(32)]
    for r in runners.values():  # every sequence's context, once
        r.run([SeqInput(t, 0, [1] * CONTEXT, []) for t in tables])
    cases = _cases()
    times: dict[str, dict[str, list[float]]] = {u: {c: [] for c in cases} for u in runners}
    for _ in range(rounds):
        for case, step in cases.items():
            for use, r in runners.items():
                t0 = time.perf_counter()
                r.run(step)
                times[use][case].append(time.perf_counter() - t0)
    ms = {u: {c: 1e3 * statistics.median(v) for c, v in t.items()} for u, t in times.items()}
    return {
        "cpu": device_name(torch.device("cpu")),
        "panel_vector_tiles": CpuLinear().vector(),
        "auto_takes": "cpu_panel" if CpuLinear().vector() else "onednn",
        "rounds": rounds,
        "ms": ms,
        "onednn_over_panel": {c: ms["never"][c] / ms["always"][c] for c in cases},
        "describe": {u: r.describe()["matmul"] for u, r in runners.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "panel_fallback.json")
    args = ap.parse_args()
    report = measure(args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

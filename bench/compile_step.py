"""Eager against ``torch.compile`` for the same decode step on this CPU (issue 26, item 2).

The embedded model, fp32, decode steps of ``--batches`` sequences after 128 cached tokens each,
median of ``--repeats`` after warm-up (compilation is reported apart):

- ``eager``: the served path (``models.cpu.backend.CpuBackend``: weights packed for the CPU,
  ``models.cpu.linear``);
- ``eager_plain``: eager on the plain weights, the baseline of what inductor compiles;
- ``compiled_layers``: every decoder layer's MLP and norms through ``torch.compile``
  (``dynamic=True``; attention stays eager: its metadata is Python);
- ``compiled_model``: the whole forward through ``torch.compile`` (``dynamic=True``), graph
  breaks where it must.

    .venv/bin/python -m bench.compile_step [--batches 1 8] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from models.cpu.row_ops import CpuRowOps
from models.kv_layout import kv_pool_shape
from models.llama import LlamaModel
from models.spec import ModelSpec
from models.weights import resolve_checkpoint
from runtime.backends import model_backend
from runtime.runner import LocalRunner, SeqInput

RESULTS = Path(__file__).parent / "results"
MODES = ("eager", "eager_plain", "compiled_layers", "compiled_model")


def _model(mode: str) -> LlamaModel:
    """The model of ``mode``; ``eager``'s with the CPU row ops it is served with (``_measure``
    packs it)."""
    ops = CpuRowOps() if mode == "eager" else None
    model = ModelSpec(str(resolve_checkpoint("embedded"))).load(ops=ops)
    if mode == "compiled_layers":
        layers: list[Any] = list(model.layers)
        for layer in layers:
            layer.mlp = torch.compile(layer.mlp, dynamic=True)
            layer.input_layernorm = torch.compile(layer.input_layernorm, dynamic=True)
            layer.post_attention_layernorm = torch.compile(
                layer.post_attention_layernorm, dynamic=True
            )
    elif mode == "compiled_model":  # what the step calls (``TorchBackend.forward``)
        model.forward_with_features = torch.compile(  # type: ignore[method-assign]
            model.forward_with_features, dynamic=True
        )
    return model


def _measure(mode: str, batches: list[int], repeats: int) -> dict[str, Any]:
    model = _model(mode)
    c = model.cfg
    pool = torch.zeros(
        kv_pool_shape(16 * max(batches), c.num_kv_heads, c.num_layers, 16, c.head_dim)
    )
    # ``eager`` as a CPU replica serves it (weights packed, ``CpuBackend.apply``); the others
    # run the model's own modules around the same attention backend
    runner = LocalRunner(model, pool, 16, model_backend(model, pool, 16, mode == "eager"))
    out: dict[str, Any] = {}
    for b in batches:
        tables = [list(range(i * 16, i * 16 + 16)) for i in range(b)]
        runner.run([SeqInput(t, 0, [1] * 128, []) for t in tables])  # the prompts

        def step(tables: list[list[int]] = tables) -> None:
            runner.run([SeqInput(t, 128, [5], [0]) for t in tables])

        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        for _ in range(3):
            step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out[str(b)] = {
            "first_step_s": round(first, 2),
            "step_ms": round(1e3 * statistics.median(times), 2),
        }
        print(mode, b, out[str(b)], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "compile_step.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"model": "embedded SmolLM2-135M fp32", "threads": args.threads}
    for mode in MODES:
        try:
            report[mode] = _measure(mode, args.batches, args.repeats)
        except Exception as e:  # a mode inductor cannot compile here is a result too
            report[mode] = {"error": f"{type(e).__name__}: {e}"[:400]}
            print(mode, report[mode], flush=True)
    base = report["eager"]
    for mode in MODES[1:]:
        if "error" not in report[mode]:
            report[mode]["vs_eager"] = {
                b: round(base[b]["step_ms"] / v["step_ms"], 3) for b, v in report[mode].items()
            }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Reading the KV pool in place (``models.flex_paged``) against gathering it (``models.attention``),
inside whole forward steps of the embedded model.

For each (batch, context) every sequence brings ``--new`` tokens (5: a k = 4 verification) after
``context`` cached ones; the same step runs with every group on the in-place kernel and with
every group on the gather path, median of ``--repeats`` after a warm-up step (the first in-place
step compiles its shape bucket; its time is reported apart). Logits of the two are compared.

    .venv/bin/python -m bench.paged_attention [--shapes 2x2048 8x1024 8x2048 32x2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from models.attention import kv_pool_shape
from models.spec import ModelSpec
from models.weights import resolve_checkpoint
from runtime.runner import SeqInput, StepResult, run_step

RESULTS = Path(__file__).parent / "results"
BLOCK = 16


def _measure(model: Any, batch: int, context: int, new: int, repeats: int) -> dict[str, Any]:
    c = model.cfg
    nb = (context + new + BLOCK - 1) // BLOCK
    pool = torch.zeros(kv_pool_shape(batch * nb, c.num_kv_heads, c.num_layers, BLOCK, c.head_dim))
    pool.normal_()
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    steps = [SeqInput(t, context, list(range(5, 5 + new)), list(range(new))) for t in tables]
    out: dict[str, Any] = {"batch": batch, "context": context, "new_tokens": new}
    logits: dict[str, torch.Tensor] = {}
    for path, threshold in (("in_place", 0), ("gather", 1 << 62)):
        model.paged_flex.min_context_tokens = threshold
        t0 = time.perf_counter()
        r: StepResult = run_step(model, pool, BLOCK, steps)
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = run_step(model, pool, BLOCK, steps)
            times.append(time.perf_counter() - t0)
        logits[path] = r.logits
        out[path] = {
            "first_step_s": round(first, 3),
            "step_ms": round(1e3 * statistics.median(times), 1),
        }
        print(path, out[path], flush=True)
    out["speedup"] = round(out["gather"]["step_ms"] / out["in_place"]["step_ms"], 3)
    out["max_logit_diff"] = float((logits["in_place"] - logits["gather"]).abs().max())
    out["same_argmax"] = bool(
        torch.equal(logits["in_place"].argmax(-1), logits["gather"].argmax(-1))
    )
    out["fallbacks"] = model.paged_flex.fallbacks
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["2x2048", "8x1024", "8x2048", "32x2048"])
    ap.add_argument("--new", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "paged_attention.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = ModelSpec(str(resolve_checkpoint("embedded"))).load()
    model.pack_for_cpu()
    rows = []
    for shape in args.shapes:
        batch, context = (int(x) for x in shape.split("x"))
        rows.append(_measure(model, batch, context, args.new, args.repeats))
        print(rows[-1], flush=True)
    report = {"model": "embedded SmolLM2-135M fp32", "threads": args.threads, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Reading the KV pool in place against gathering it (``models.attention``), inside whole forward
steps of the embedded model: the CPU kernel (``models.cpu_paged``, the default on a CPU) and
``flex_attention`` (``models.flex_paged``, the GPU's path, compiled by inductor here).

For each (batch, context) and each ``--new`` (1: a decode; 5: a k = 4 verification) every
sequence brings that many tokens after ``context`` cached ones; the same step runs on each path,
median of ``--repeats`` after a warm-up step (the first flex step compiles its shape bucket; its
time is reported apart). Logits are compared with the gather path's.

``--prompts BxN``: B prompts of N tokens each in one step (no context; logits at each prompt's
last token), on the CPU kernel (which chunks a prompt's rows to what one call holds) and on the
gather path; ``--prompt-dtypes`` the model dtypes to run them in (a bf16 model's gathered
attention runs in float64, ``LlamaModel.invariant_attention``).

    .venv/bin/python -m bench.paged_attention [--shapes 8x256 32x256 8x2048 32x2048] [--new 1 5]
        [--prompts 8x128 1x512 1x2048] [--prompt-dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from models.kv_layout import new_kv_pool
from models.spec import ModelSpec
from models.weights import resolve_checkpoint
from runtime.runner import SeqInput, StepResult, run_step

RESULTS = Path(__file__).parent / "results"
BLOCK = 16


def _measure(
    model: Any, batch: int, context: int, new: int, repeats: int, flex: bool = True
) -> dict[str, Any]:
    """One step's time on each path; ``context`` 0: ``batch`` prompts of ``new`` tokens
    (logits at their last token)."""
    c = model.cfg
    nb = (context + new + BLOCK - 1) // BLOCK
    pool = new_kv_pool(batch * nb, c.num_kv_heads, c.num_layers, BLOCK, c.head_dim, model.dtype)
    pool.normal_()
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    wanted = [new - 1] if context == 0 else list(range(new))
    steps = [SeqInput(t, context, list(range(5, 5 + new)), wanted) for t in tables]
    out: dict[str, Any] = {"batch": batch, "context": context, "new_tokens": new}
    logits: dict[str, torch.Tensor] = {}
    native = model.paged_native
    paths = [("cpu_paged", native, 1 << 62), ("flex", None, 0), ("gather", None, 1 << 62)]
    if not flex:
        paths.pop(1)
    for path, kernel, threshold in paths:
        model.paged_native = kernel
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
    model.paged_native = native
    for path in ("cpu_paged", "flex") if flex else ("cpu_paged",):
        out[path]["speedup"] = round(out["gather"]["step_ms"] / out[path]["step_ms"], 3)
        out[path]["max_logit_diff"] = float((logits[path] - logits["gather"]).abs().max())
        out[path]["same_argmax"] = bool(
            torch.equal(logits[path].argmax(-1), logits["gather"].argmax(-1))
        )
    if flex:
        out["flex"]["fallbacks"] = model.paged_flex.fallbacks
    out["cpu_paged"]["fallbacks"] = native.fallbacks
    out["cpu_paged"]["failed"] = native.failed
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="*", default=["8x256", "32x256", "8x2048", "32x2048"])
    ap.add_argument("--new", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--prompts", nargs="*", default=["8x128", "1x512", "1x2048"])
    ap.add_argument("--prompt-dtypes", nargs="*", default=["float32", "bfloat16"])
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
        for new in args.new:
            rows.append(_measure(model, batch, context, new, args.repeats))
            print(rows[-1], flush=True)
    prompts = []
    for dtype in args.prompt_dtypes:
        m = ModelSpec(str(resolve_checkpoint("embedded")), dtype).load()
        m.pack_for_cpu()
        for shape in args.prompts:
            batch, length = (int(x) for x in shape.split("x"))
            prompts.append({"dtype": dtype, **_measure(m, batch, 0, length, args.repeats, False)})
            print(prompts[-1], flush=True)
    report = {
        "model": "embedded SmolLM2-135M fp32 (prompts: each dtype)",
        "threads": args.threads,
        "rows": rows,
        "prompts": prompts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

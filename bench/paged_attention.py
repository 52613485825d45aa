"""Reading the KV pool in place against gathering it (``models.attention``), inside whole forward
steps of the embedded model: the CPU kernel (``models.cpu.attention.CpuAttentionBackend``, the
default on a CPU) and ``flex_attention`` (``models.attention.flex.FlexBackend``, the GPU's path,
compiled by inductor here), against the reference gather path
(``models.attention.reference.ReferenceBackend``). Each path is the model as a CPU replica
serves it (``models.cpu.backend.CpuBackend``: weights packed, the layer program where the CPU
kernel attends) around that attention backend.

For each (batch, context) and each ``--new`` (1: a decode; 5: a k = 4 verification) every
sequence brings that many tokens after ``context`` cached ones; the same step runs on each path,
median of ``--repeats`` after a warm-up step (the first flex step compiles its shape bucket; its
time is reported apart). Logits are compared with the gather path's.

``--prompts BxN``: B prompts of N tokens each in one step (no context; logits at each prompt's
last token), on the CPU kernel (which chunks a prompt's rows to what one call holds) and on the
gather path; ``--prompt-dtypes`` the model dtypes to run them in (a bf16 model's gathered
attention runs in float64, ``runtime.backends.exact_attention``).

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

from bench.cpu_serving import serve_on_cpu, with_attention
from models.attention.backend import AttentionBackend
from models.attention.flex import FlexBackend
from models.attention.flex_kernel import FlexKernel
from models.attention.reference import ReferenceBackend
from models.cpu.attention import CpuAttentionBackend
from models.cpu.backend import CpuBackend
from models.cpu.row_ops import CpuRowOps
from models.kv_layout import new_kv_pool
from models.spec import ModelSpec
from models.weights import resolve_checkpoint
from runtime.backends import exact_attention, model_attention_spec
from runtime.runner import SeqInput, StepResult, run_step

RESULTS = Path(__file__).parent / "results"
BLOCK = 16


def _measure(
    served: CpuBackend,
    batch: int,
    context: int,
    new: int,
    repeats: int,
    flex: FlexKernel | None = None,
) -> dict[str, Any]:
    """One step's time on each path; ``context`` 0: ``batch`` prompts of ``new`` tokens
    (logits at their last token). ``flex``: the kernel of the flex path (None: no flex path)."""
    model = served.model
    c = model.cfg
    nb = (context + new + BLOCK - 1) // BLOCK
    pool = new_kv_pool(batch * nb, c.num_kv_heads, c.num_layers, BLOCK, c.head_dim, model.dtype)
    pool.normal_()
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    wanted = [new - 1] if context == 0 else list(range(new))
    steps = [SeqInput(t, context, list(range(5, 5 + new)), wanted) for t in tables]
    out: dict[str, Any] = {"batch": batch, "context": context, "new_tokens": new}
    logits: dict[str, torch.Tensor] = {}
    cpu = served.attention
    assert isinstance(cpu, CpuAttentionBackend), cpu.describe()
    native = cpu.kernel
    spec = model_attention_spec(model, pool, BLOCK)
    exact = exact_attention(model)  # float64 where the reference path serves a bf16 model
    paths: dict[str, AttentionBackend] = {"cpu_paged": CpuAttentionBackend(spec, exact, native)}
    if flex is not None:
        paths["flex"] = FlexBackend(spec, flex)
    paths["gather"] = ReferenceBackend(spec, exact)
    for path, attention in paths.items():
        backend = with_attention(served, attention)
        t0 = time.perf_counter()
        r: StepResult = run_step(backend, pool, steps)
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = run_step(backend, pool, steps)
            times.append(time.perf_counter() - t0)
        logits[path] = r.logits
        out[path] = {
            "first_step_s": round(first, 3),
            "step_ms": round(1e3 * statistics.median(times), 1),
        }
        print(path, out[path], flush=True)
    for path in ("cpu_paged", "flex") if flex is not None else ("cpu_paged",):
        out[path]["speedup"] = round(out["gather"]["step_ms"] / out[path]["step_ms"], 3)
        out[path]["max_logit_diff"] = float((logits[path] - logits["gather"]).abs().max())
        out[path]["same_argmax"] = bool(
            torch.equal(logits[path].argmax(-1), logits["gather"].argmax(-1))
        )
    if flex is not None:
        out["flex"]["fallbacks"] = flex.fallbacks
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
    model = ModelSpec(str(resolve_checkpoint("embedded"))).load(ops=CpuRowOps())
    served = serve_on_cpu(model, BLOCK)
    # the model's one flex kernel (its compiled shapes and fallbacks, over every shape), taking
    # every group it fits whatever its context
    flex = FlexKernel(min_context_tokens=0)
    rows = []
    for shape in args.shapes:
        batch, context = (int(x) for x in shape.split("x"))
        for new in args.new:
            rows.append(_measure(served, batch, context, new, args.repeats, flex))
            print(rows[-1], flush=True)
    prompts = []
    for dtype in args.prompt_dtypes:
        m = ModelSpec(str(resolve_checkpoint("embedded")), dtype).load(ops=CpuRowOps())
        served_m = serve_on_cpu(m, BLOCK)
        for shape in args.prompts:
            batch, length = (int(x) for x in shape.split("x"))
            prompts.append({"dtype": dtype, **_measure(served_m, batch, 0, length, args.repeats)})
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

"""What the bf16 screen of the LM head (``models.cpu.greedy_head``) saves: the head alone, and a
whole decode step, each against the full fp32 head in the same run, taking turns.

The head: the embedded model's final hidden states at every position of ShareGPT chat prompts
(real rows, whose logits are as peaked as served ones), ``--rows`` at a time, the full head's
``argmax`` against the screen's; it also reports how many 16-column panels the screen kept per
row and checks the tokens are identical. The step: ``run_step`` over ``--batch`` sequences of
``--context`` tokens with every row greedy (``argmax_only``) against the same step with the
screen taken away (the CPU backend's ``screen`` unset: the full head, then ``argmax``).

    .venv/bin/python -m bench.greedy_head [--rows 1 8 32] [--batch 1 32] [--context 150]
        [--repeats 30] [--out bench/results/greedy_head.json]
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
from bench.load_report import write_json
from bench.sharegpt import chat_prompts, first_prompts
from models.cpu.backend import CpuBackend
from models.cpu.greedy_head import GreedyHead
from models.cpu.linear import PANEL
from models.cpu.row_ops import CpuRowOps
from models.kv_layout import new_kv_pool
from models.llama import LlamaModel
from models.spec import ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint
from runtime.runner import SeqInput, run_step

RESULTS = Path(__file__).parent / "results"
BLOCK = 16


def _hidden_states(served: CpuBackend, prompts: list[list[int]], limit: int) -> torch.Tensor:
    """[N, hidden] the final hidden states at every position of ``prompts``, up to ``limit``."""
    model = served.model
    c = model.cfg
    rows: list[torch.Tensor] = []
    for p in prompts:
        nb = -(-len(p) // BLOCK)
        pool = new_kv_pool(nb, c.num_kv_heads, c.num_layers, BLOCK, c.head_dim, model.dtype)
        seq = SeqInput(list(range(nb)), 0, p, list(range(len(p))))
        rows.append(run_step(served, pool, [seq]).hidden)
        if sum(r.shape[0] for r in rows) >= limit:
            break
    return torch.cat(rows)[:limit]


def _head(model: LlamaModel, screen: GreedyHead, h: torch.Tensor, m: int, repeats: int) -> Any:
    full_s, screen_s = [], []
    same = True
    for i in range(repeats):
        x = h[(i * m) % (h.shape[0] - m) :][:m]  # [m, hidden]
        t0 = time.perf_counter()
        want = model.logits(x).argmax(dim=-1)
        t1 = time.perf_counter()
        got = screen.argmax(x)
        t2 = time.perf_counter()
        full_s.append(t1 - t0)
        screen_s.append(t2 - t1)
        same = same and torch.equal(want, got)
    full, fast = 1e3 * statistics.median(full_s), 1e3 * statistics.median(screen_s)
    return {
        "rows": m,
        "full_ms": round(full, 3),
        "screen_ms": round(fast, 3),
        "screen_over_full": round(fast / full, 3),
        "tokens_identical": same,
    }


def _panels_kept(screen: GreedyHead, h: torch.Tensor) -> dict[str, float]:
    """Per row: the 16-column panels whose exact logits the screen computed."""
    kept: list[float] = []
    for i in range(0, h.shape[0], 32):
        x = h[i : i + 32]
        s = screen.screen.matmul(x)  # [n, V] bf16
        low = screen.threshold(x, s.amax(dim=1).float())
        rows, _ = screen.exact.kernel.panels_at_least(s, low)
        kept += torch.bincount(rows, minlength=x.shape[0]).tolist()
    return {
        "mean": round(statistics.mean(kept), 2),
        "median": statistics.median(kept),
        "max": max(kept),
        "of": -(-screen.exact.out_features // PANEL),
    }


def _step(served: CpuBackend, screen: GreedyHead, batch: int, context: int, repeats: int) -> Any:
    model = served.model
    c = model.cfg
    nb = -(-(context + 1) // BLOCK)
    pool = new_kv_pool(batch * nb, c.num_kv_heads, c.num_layers, BLOCK, c.head_dim, model.dtype)
    pool.normal_(generator=torch.Generator().manual_seed(0))
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    steps = [SeqInput(t, context, [5 + i], [0], argmax_only=True) for i, t in enumerate(tables)]
    times: dict[str, list[float]] = {"full": [], "screen": []}
    tokens: dict[str, torch.Tensor] = {}
    for _ in range(repeats + 1):  # the first round warms up
        for name, kept in times.items():
            served.screen = screen if name == "screen" else None
            t0 = time.perf_counter()
            out = run_step(served, pool, steps)
            tokens[name] = out.argmax(slice(None))
            kept.append(time.perf_counter() - t0)
    served.screen = screen
    ms = {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}
    return {
        "batch": batch,
        "context": context,
        "full_head_ms": round(ms["full"], 2),
        "screen_ms": round(ms["screen"], 2),
        "screen_over_full": round(ms["screen"] / ms["full"], 3),
        "tokens_identical": torch.equal(tokens["full"], tokens["screen"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "greedy_head.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_checkpoint("embedded")
    model = ModelSpec(str(folder), "float32").load(ops=CpuRowOps())
    served = serve_on_cpu(model, BLOCK)
    screen = served.screen
    if screen is None:
        raise SystemExit("this CPU gives the fp32 head no screen (no bf16 dot product)")
    prompts = chat_prompts(Tokenizer(folder), first_prompts(64))
    h = _hidden_states(served, prompts, 1024)
    report: dict[str, Any] = {
        "benchmark": "greedy_head",
        "model": "embedded SmolLM2-135M, float32",
        "threads": args.threads,
        "hidden_rows": h.shape[0],
        "panels_kept_per_row": _panels_kept(screen, h),
        "head": [_head(model, screen, h, m, args.repeats) for m in args.rows],
        "step": [_step(served, screen, b, args.context, args.repeats) for b in args.batch],
    }
    print(json.dumps(report, indent=1), flush=True)
    write_json(args.out, report)


if __name__ == "__main__":
    main()

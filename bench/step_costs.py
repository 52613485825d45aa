"""What drafting and planning cost a decode step: the planner (``choose_ks``, through the
speculation policy) and the drafter's proposals, timed inside real engine steps, as a share of
the step.

Batches of 1, 32 and 64 greedy requests, each with a prompt of ``--context`` tokens of ShareGPT
text, on the embedded model with the default drafter (the shipped EAGLE head behind n-gram
lookup, k = 4, adaptive); after every prompt is computed, ``--steps`` decode steps are timed:

    .venv/bin/python -m bench.step_costs [--batches 1 32 64] [--context 2048] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from bench.sharegpt import iter_conversations
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.embedded import embedded_eagle_path
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"
F = TypeVar("F", bound=Callable[..., Any])


class Stopwatch:
    """Seconds spent inside the functions it wraps, since the last ``take``."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: F) -> F:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed  # type: ignore[return-value]

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def _prompts(tok: Tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, each ShareGPT conversations run together."""
    out: list[list[int]] = []
    ids: list[int] = []
    for conv in iter_conversations():
        ids += tok.encode(" ".join(turn for _, turn in conv.turns))
        while len(ids) >= length and len(out) < count:
            out.append(ids[:length])
            ids = ids[length:]
        if len(out) == count:
            return out
    raise RuntimeError("ShareGPT ran out of text")


def measure(folder: Path, batch: int, context: int, steps: int) -> dict[str, Any]:
    draft = DraftSpec(
        DraftKind.EAGLE,
        model=ModelSpec(str(embedded_eagle_path())),
        num_speculative_tokens=4,
        lookup_first=True,
    )
    per_seq = (context + 6 * steps + 32) // 16 + 1
    cfg = DecodeEngineConfig(
        "m", ModelSpec(str(folder)), draft, num_blocks=batch * per_seq, max_batch_size=batch
    )
    engine = DecodeEngine(cfg)
    try:
        tok = Tokenizer(folder)
        sp = SamplingParams(temperature=0.0, max_tokens=8 * steps, stop_token_ids=())
        reqs = [Request(uuid.uuid4().hex, p, sp) for p in _prompts(tok, batch, context)]
        for r in reqs:
            engine.add(r, None)
        while any(not r.output_token_ids for r in reqs):
            engine.step()  # the prompts
        plan, draft_w = Stopwatch(), Stopwatch()
        assert engine.speculation is not None and engine.drafter is not None
        engine.speculation.choose = plan.wrap(engine.speculation.choose)  # type: ignore[method-assign]
        engine.drafter.propose = draft_w.wrap(engine.drafter.propose)  # type: ignore[method-assign]
        rows = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            step = time.perf_counter() - t0
            rows.append({"step_s": step, "plan_s": plan.take(), "draft_s": draft_w.take()})
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        return {
            "batch": batch,
            "context": context,
            "median": med,
            "plan_share": med["plan_s"] / med["step_s"],
            "draft_share": med["draft_s"] / med["step_s"],
            "draft_plus_plan_share": (med["plan_s"] + med["draft_s"]) / med["step_s"],
            "steps": rows,
        }
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", type=Path, default=RESULTS / "step_costs.json")
    args = ap.parse_args(argv)
    folder = resolve_checkpoint("embedded")
    runs = []
    for b in args.batches:
        r = measure(folder, b, args.context, args.steps)
        m = r["median"]
        print(
            f"batch {b:3d}: step {1e3 * m['step_s']:7.1f} ms, plan {1e3 * m['plan_s']:6.2f} ms, "
            f"draft {1e3 * m['draft_s']:6.2f} ms: {100 * r['draft_plus_plan_share']:.1f} % of it",
            flush=True,
        )
        runs.append(r)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs}, indent=1))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()

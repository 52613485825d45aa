"""Host time per decode step at batch 1, 32 and 64 (issue 53, item 3): the engine's step wall
time less its target forward (timed around the runner's ``run`` and a device synchronisation
after it, so on a GPU the forward includes the device's time). What is left is the host's own
work per step: scheduling, drafting by lookup, laying out the step's inputs, acceptance, each
request's bookkeeping and its outputs. The synchronisation after the forward undoes any
overlap with the device's step (the intake beside it, ``decode.overlap``), so these modes run
with ``decode.overlap`` off.

Plain decoding and n-gram drafting (k = 4, fixed), greedy, prompts computed first and not
timed; the median of ``--steps`` steady steps per batch. ``plain_overlap`` times plain steps
with ``decode.overlap`` on (step n + 1 planned and launched beside step n), nothing
synchronised but each step's own read: its ``step_ms`` against ``plain``'s is what the
overlap hides (on a CPU the forward has ended before the host plans: about 1.0).

    python -m bench.host_time [--device cpu] [--model embedded] [--steps 30]
        [--out bench/results/host_time.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.weights import resolve_checkpoint
from runtime.runner import ModelRunner, SeqInput, StepResult, synchronize

RESULTS = Path(__file__).parent / "results"
BATCHES = (1, 32, 64)
PROMPT_LEN = 64


class _Timed(ModelRunner):
    """The engine's target runner, its forwards timed to the device's end."""

    def __init__(self, inner: ModelRunner, device: str) -> None:
        self.inner, self.device, self.spent = inner, device, 0.0
        self.takes_device_ids = inner.takes_device_ids

    def run(self, batch: Sequence[SeqInput], ids: torch.Tensor | None = None) -> StepResult:
        t0 = time.perf_counter()
        out = self.inner.run(batch, ids)
        synchronize(self.device)
        self.spent += time.perf_counter() - t0
        return out

    def describe(self) -> dict[str, str | int]:
        return self.inner.describe()


def measure(
    target: ModelSpec, draft: DraftSpec, device: str, batch: int, steps: int, overlap: bool = False
) -> dict[str, float]:
    """Median step, forward and host milliseconds over ``steps`` decode steps at ``batch``
    (``overlap``: the step only, its forward not timed apart)."""
    blocks = batch * ((PROMPT_LEN + steps * 6 + 15) // 16 + 2)
    # no start-up warm-up: each run steps one or two buckets, captured in its first steps
    cfg = DecodeEngineConfig(
        "m",
        target,
        draft,
        num_blocks=blocks,
        max_batch_size=batch,
        device=device,
        warm_up="off",
        overlap="on" if overlap else "off",
    )
    engine = DecodeEngine(cfg)
    timed = _Timed(engine.target, device)
    if not overlap:
        engine.target = timed
    g = torch.Generator().manual_seed(batch)
    vocab = target.config().vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=steps * 6 + 8)
    reqs = [
        Request(uuid.uuid4().hex, torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist(), sp)
        for _ in range(batch)
    ]
    for r in reqs:
        engine.add(r, None)
    while any(not r.output_token_ids for r in reqs):  # prompts and first tokens
        engine.step()
        if not engine.has_work:
            raise RuntimeError(f"requests ended before decoding: {[r.status for r in reqs]}")
    walls, forwards = [], []
    for _ in range(steps):
        timed.spent = 0.0
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        forwards.append(timed.spent)
    engine.close()
    if overlap:
        return {"step_ms": 1000 * statistics.median(walls)}
    hosts = [w - f for w, f in zip(walls, forwards, strict=True)]
    return {
        "step_ms": 1000 * statistics.median(walls),
        "forward_ms": 1000 * statistics.median(forwards),
        "host_ms": 1000 * statistics.median(hosts),
        "host_fraction": statistics.median(h / w for h, w in zip(hosts, walls, strict=True)),
    }


def measure_all(
    target: ModelSpec, device: str, batches: Sequence[int], steps: int
) -> dict[str, Any]:
    """Plain decoding and n-gram drafting at each batch size; plain overlapped, its step time
    over plain's (``vs_plain``)."""
    modes = {
        "plain": (DraftSpec(), False),
        "ngram_k4": (DraftSpec(DraftKind.NGRAM, num_speculative_tokens=4, adaptive=False), False),
        "plain_overlap": (DraftSpec(), True),
    }
    rows: dict[str, Any] = {}
    for name, (draft, overlap) in modes.items():
        rows[name] = {}
        for batch in batches:
            rows[name][batch] = got = measure(target, draft, device, batch, steps, overlap)
            if overlap:
                got["vs_plain"] = got["step_ms"] / rows["plain"][batch]["step_ms"]
            print(name, batch, json.dumps(got), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="embedded", help="a checkpoint folder, or 'embedded'")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--out", type=Path, default=RESULTS / "host_time.json")
    args = ap.parse_args()
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    target = ModelSpec(str(resolve_checkpoint(args.model)), dtype)
    rows = measure_all(target, args.device, args.batches, args.steps)
    report = {
        "benchmark": "host_time",
        "device": args.device,
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
        "model": args.model,
        "steps": args.steps,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Bucketed against ragged decode steps (``decode.step_shapes``), in-process, in one run.

The embedded model in float32 decodes ShareGPT prompts (computed in-engine first, then timed)
at several batch sizes, once with every step laid out as it comes (``ragged``) and once with
decodes and verifications in fixed buckets through persistent buffers (``bucketed``,
``runtime.bucketed``; a GPU would also replay CUDA graphs), with no drafter and with the
served drafter (the shipped EAGLE head behind n-gram lookup, k = 4 adaptive). The two runs of
a case alternate, and each engine's greedy tokens must equal the other's. What this measures
on a CPU decides ``step_shapes: auto`` there.

    .venv/bin/python -m bench.step_shapes [--batches 1 8 32] [--new-tokens 64]
        [--out bench/results/step_shapes.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import uuid
from pathlib import Path
from typing import Any

from bench.sharegpt import chat_prompts, first_prompts
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.embedded import embedded_eagle_path
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint
from runtime.bucketed import BucketedRunner

RESULTS = Path(__file__).parent / "results"


def _draft(kind: str) -> DraftSpec:
    if kind == "none":
        return DraftSpec()
    head = ModelSpec(str(embedded_eagle_path()), "float16")
    return DraftSpec(DraftKind.EAGLE, head, num_speculative_tokens=4, lookup_first=True)


def _decode(engine: DecodeEngine, prompts: list[list[int]], new: int) -> tuple[float, list[Any]]:
    """Decode tokens/s once every prompt is computed, and the outputs."""
    sp = SamplingParams(temperature=0.0, max_tokens=new)
    reqs = [Request(uuid.uuid4().hex, p, sp) for p in prompts]
    for r in reqs:
        engine.add(r, None)
    while any(not r.output_token_ids for r in reqs):
        engine.step()
    t0, before = time.perf_counter(), sum(len(r.output_token_ids) for r in reqs)
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - t0
    return (sum(len(r.output_token_ids) for r in reqs) - before) / seconds, [
        r.output_token_ids for r in reqs
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--drafts", nargs="+", default=["none", "eagle+lookup"])
    ap.add_argument("--out", type=Path, default=RESULTS / "step_shapes.json")
    args = ap.parse_args()
    folder = resolve_checkpoint("embedded")
    tok = Tokenizer(folder)
    texts = first_prompts(max(args.batches), max_chars=600)
    prompts = chat_prompts(tok, texts)
    engines = {
        (kind, shapes): DecodeEngine(
            DecodeEngineConfig(
                "m",
                ModelSpec(str(folder)),
                _draft(kind),
                num_blocks=2048,
                num_threads=2,
                max_batch_size=max(args.batches),
                step_shapes=shapes,
            )
        )
        for kind in args.drafts
        for shapes in ("ragged", "bucketed")
    }
    for e in engines.values():  # warm up: first steps, and the head's first rounds
        _decode(e, prompts[:2], 8)
    rows: list[dict[str, Any]] = []
    for kind in args.drafts:
        for batch in args.batches:
            speed: dict[str, float] = {}
            outs: dict[str, list[Any]] = {}
            for shapes in ("ragged", "bucketed"):
                speed[shapes], outs[shapes] = _decode(
                    engines[(kind, shapes)], prompts[:batch], args.new_tokens
                )
            row = {
                "drafter": kind,
                "batch": batch,
                "ragged_tok_s": speed["ragged"],
                "bucketed_tok_s": speed["bucketed"],
                "bucketed_over_ragged": speed["bucketed"] / speed["ragged"],
                "identical": outs["ragged"] == outs["bucketed"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    fell_back = {
        kind: e.target.ragged_steps
        for (kind, shapes), e in engines.items()
        if shapes == "bucketed" and isinstance(e.target, BucketedRunner)
    }
    report = {
        "benchmark": "step_shapes",
        "machine": {"cpus": 2, "platform": platform.platform()},
        "model": "embedded SmolLM2-135M-Instruct, float32, 2 threads",
        "new_tokens": args.new_tokens,
        "rows": rows,
        "bucketed_engines_ragged_steps": fell_back,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

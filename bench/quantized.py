"""Quantized weights on this machine: decode speed and greedy agreement, in one run.

For the embedded model served as float32, bfloat16, and with int8 weights
(``model.quantization: int8``) in a float32 and in a bfloat16 model, speculation off, through
the decode engine as a worker runs it:

1. Batch-1 greedy decode tokens/s, the configurations alternated ``--trials`` times (medians;
   this machine is noisy), and int8's ratio to each of the others.
2. Decode throughput at batch 8 and 32.
3. Greedy agreement with float32 on held-out ShareGPT prompts (the distillation's held-out
   split): the share of prompts whose ``--agree-tokens`` greedy tokens are identical, and the
   mean share of tokens before the first difference; bfloat16 against float32 alongside, as
   the yardstick of what a change of number format alone does.
4. The bytes of weights each configuration keeps.

    .venv/bin/python -m bench.quantized [--tokens 64] [--trials 3] [--prompts 24]
        [--out bench/results/quantized.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import uuid
from pathlib import Path
from typing import Any

import torch

from bench.draft_acceptance import held_out_prompts
from bench.engine_step import engine_tokens_per_s
from bench.sharegpt import chat_prompts
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.cpu.linear import PanelWeight
from models.cpu.onednn import PackedWeight
from models.quant import QuantizedWeight
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint
from runtime.runner import LocalRunner

RESULTS = Path(__file__).parent / "results"
CONFIGS = {  # name -> (dtype, quantization)
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
    # int8 weights in a bfloat16 model: the int8 kernel's activation dtype end to end, so no
    # matmul converts its input and output (gpt-fast and torchao serve int8 this way)
    "bfloat16+int8": ("bfloat16", "int8"),
}
QUANTIZED = ("int8", "bfloat16+int8")


def _engine(folder: Path, name: str, batch: int = 32) -> DecodeEngine:
    dtype, quant = CONFIGS[name]
    spec = ModelSpec(str(folder), dtype, quant)
    return DecodeEngine(
        DecodeEngineConfig("m", spec, DraftSpec(), num_blocks=2048, max_batch_size=batch)
    )


def weight_bytes(engine: DecodeEngine) -> int:
    """Bytes of the target's weights as served: plain, reordered or quantized."""
    runner = engine.shard.target
    assert isinstance(runner, LocalRunner)
    seen: set[int] = set()
    total = 0
    for m in runner.model.modules():
        tensors: list[torch.Tensor] = list(m.parameters(recurse=False))
        kernel = getattr(m, "kernel", None)  # a served linear's or the LM head's weight kernel
        if isinstance(kernel, PanelWeight):
            tensors += [kernel.data] + ([kernel.scale] if kernel.scale is not None else [])
        elif isinstance(kernel, PackedWeight):
            tensors += list(kernel.chunks)
        elif isinstance(kernel, QuantizedWeight):
            tensors += [kernel.data, kernel.scale]
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def greedy_outputs(engine: DecodeEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=tokens)
    reqs = [Request(uuid.uuid4().hex, p, sp) for p in prompts]
    for r in reqs:
        engine.add(r, None)
    while engine.has_work:
        engine.step()
    return [list(r.output_token_ids) for r in reqs]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    """Identical outputs, and the mean share of tokens before the first difference."""
    same, prefix = 0, []
    for a, b in zip(ref, got, strict=True):
        n = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        same += a == b
        prefix.append(n / max(len(a), 1))
    return {"identical": same / len(ref), "mean_prefix_share": statistics.mean(prefix)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per timed run")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts for agreement")
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "quantized.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_checkpoint("embedded")
    engines = {name: _engine(folder, name) for name in CONFIGS}
    runs: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.trials):  # alternate: a burst of load lands on one trial of each
        for name, engine in engines.items():
            runs[name].append(engine_tokens_per_s(engine, 1, args.tokens))
    batch1 = {name: statistics.median(v) for name, v in runs.items()}
    print(f"batch-1 tok/s {json.dumps({k: round(v, 1) for k, v in batch1.items()})}", flush=True)
    throughput = {
        name: {b: engine_tokens_per_s(e, b, args.tokens) for b in args.batches}
        for name, e in engines.items()
    }
    print(f"throughput {json.dumps(throughput)}", flush=True)

    tok = Tokenizer(folder)
    texts = held_out_prompts(30, args.prompts, max_chars=600)
    prompts = chat_prompts(tok, texts)
    outputs = {name: greedy_outputs(e, prompts, args.agree_tokens) for name, e in engines.items()}
    agree = {n: agreement(outputs["float32"], outputs[n]) for n in CONFIGS if n != "float32"}
    print(f"greedy agreement with float32 {json.dumps(agree)}", flush=True)

    report: dict[str, Any] = {
        "benchmark": "quantized",
        "threads": args.threads,
        "model": "embedded SmolLM2-135M-Instruct",
        "batch1_tok_s": batch1,
        "batch1_runs": runs,
        "int8_ratio": {
            name: {
                "to_float32": batch1[name] / batch1["float32"],
                "to_bfloat16": batch1[name] / batch1["bfloat16"],
            }
            for name in QUANTIZED
        },
        "throughput_tok_s": throughput,
        "greedy_agreement_with_float32": agree,
        "agreement_prompts": len(prompts),
        "agreement_tokens": args.agree_tokens,
        "weight_bytes": {name: weight_bytes(e) for name, e in engines.items()},
    }
    print(json.dumps(report["int8_ratio"]), flush=True)
    for e in engines.values():
        e.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

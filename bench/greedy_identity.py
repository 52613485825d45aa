"""Greedy speculation against plain decoding, token for token, per number format.

Speculation must not change a greedy output: verifying k + 1 tokens has to give each row the
logits a one-token decode gives it. For the embedded model served as float32, bfloat16, and
float32 and bfloat16 with int8 weights, through the decode engine with the weights as a CPU
replica serves them, each held-out ShareGPT prompt (the distillation's held-out split, chat
template) is decoded greedily alone with speculation off and with each drafter (the shipped
EAGLE head behind n-gram lookup, as chains and as trees 4 wide, and n-gram lookup alone), and
the report counts the outputs identical to off.

    .venv/bin/python -m bench.greedy_identity [--prompts 8] [--max-tokens 96]
        [--out bench/results/greedy_identity.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import uuid
from pathlib import Path
from typing import Any

import torch

from bench.draft_acceptance import held_out_prompts
from bench.load_report import write_json
from bench.sharegpt import chat_prompts
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"
HEAD = Path(__file__).parent.parent / "models" / "drafts" / "smollm2-135m-eagle"
FORMATS = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
    "bfloat16+int8": ("bfloat16", "int8"),  # int8 multiplied by digits where the CPU has VNNI
}


def _drafts(dtype: str, quant: str) -> dict[str, DraftSpec]:
    head = ModelSpec(str(HEAD), dtype, quant)
    return {
        "off": DraftSpec(),
        "eagle+lookup": DraftSpec(DraftKind.EAGLE, head, 4, lookup_first=True),
        "eagle+lookup+tree4": DraftSpec(DraftKind.EAGLE, head, 4, lookup_first=True, tree_width=4),
        "ngram": DraftSpec(DraftKind.NGRAM, None, 4),
    }


def _greedy(spec: ModelSpec, draft: DraftSpec, prompts: list[list[int]], tokens: int) -> list[Any]:
    engine = DecodeEngine(DecodeEngineConfig("m", spec, draft, num_blocks=1024))
    out = []
    for p in prompts:  # one at a time: batch 1, as a single client sees it
        r = Request(uuid.uuid4().hex, p, SamplingParams(temperature=0.0, max_tokens=tokens))
        engine.add(r, None)
        while engine.has_work:
            engine.step()
        out.append(list(r.output_token_ids))
    engine.close()
    return out


def _digest(outputs: list[Any]) -> str:
    """A digest of every prompt's greedy tokens: equal digests across code changes mean
    bit-identical outputs."""
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "greedy_identity.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_checkpoint("embedded")
    tok = Tokenizer(folder)
    texts = held_out_prompts(30, args.prompts, max_chars=600)
    prompts = chat_prompts(tok, texts)
    report: dict[str, Any] = {
        "benchmark": "greedy_identity",
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "formats": {},
    }
    for name in args.formats:
        dtype, quant = FORMATS[name]
        spec = ModelSpec(str(folder), dtype, quant)
        drafts = _drafts(dtype, quant)
        off = _greedy(spec, drafts.pop("off"), prompts, args.max_tokens)
        row = {}
        digests = {"off": _digest(off)}
        for draft_name, draft in drafts.items():
            got = _greedy(spec, draft, prompts, args.max_tokens)
            row[draft_name] = sum(a == b for a, b in zip(off, got, strict=True))
            digests[draft_name] = _digest(got)
            print(f"{name} {draft_name}: {row[draft_name]} of {len(prompts)} identical", flush=True)
        report["formats"][name] = {"identical_to_off": row, "outputs_sha256": digests}
    write_json(args.out, report)


if __name__ == "__main__":
    main()

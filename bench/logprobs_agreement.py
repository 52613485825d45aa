"""Reported log-probabilities under speculation against plain decoding, in-process, in one run.

The embedded model (fp32) answers ShareGPT and copy-heavy prompts greedily with logprobs and 5
alternatives, once with no drafter and once per drafter (n-gram lookup; the shipped EAGLE head
behind lookup; EAGLE trees 4 wide), k = 4 fixed so every drafter drafts at every step. Greedy
tokens are identical, so each token's reported log-probability and its alternatives can be
compared position by position: reports the largest absolute difference (the goal: ≤ 1e-4),
and how many tokens came out of multi-token verification steps.

    .venv/bin/python -m bench.logprobs_agreement [--sharegpt 8] [--max-tokens 64]
        [--out bench/results/logprobs_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import uuid
from pathlib import Path
from typing import Any

from bench.copy_prompts import COPY_PROMPTS
from bench.sharegpt import chat_prompts, first_prompts
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.embedded import embedded_eagle_path
from models.logprobs import TokenLogprob
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"


def _drafts() -> dict[str, DraftSpec]:
    head = ModelSpec(str(embedded_eagle_path()))
    return {
        "none": DraftSpec(),
        "ngram": DraftSpec(DraftKind.NGRAM, num_speculative_tokens=4, adaptive=False),
        "eagle+lookup": DraftSpec(DraftKind.EAGLE, head, 4, adaptive=False, lookup_first=True),
        "eagle+tree4": DraftSpec(DraftKind.EAGLE, head, 4, adaptive=False, tree_width=4),
    }


def _run(
    target: ModelSpec, draft: DraftSpec, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[TokenLogprob]], int, int]:
    """Per prompt, its logprobs; and the tokens emitted by steps that tested drafts, of all."""
    engine = DecodeEngine(DecodeEngineConfig("m", target, draft, num_blocks=1024))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5)
    reqs = [Request(uuid.uuid4().hex, p, sp) for p in prompts]
    got: dict[str, list[TokenLogprob]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add(r, None)
    while engine.has_work:
        for o in engine.step():
            assert o.error is None, o.error
            got[o.request_id] += o.logprobs
    engine.close()
    spec_tokens = sum(r.stats.num_emitted_tokens for r in reqs)
    return [got[r.request_id] for r in reqs], spec_tokens, sum(len(v) for v in got.values())


def _max_diff(a: list[list[TokenLogprob]], b: list[list[TokenLogprob]]) -> dict[str, Any]:
    token = top = 0.0
    same_tokens = True
    for xs, ys in zip(a, b, strict=True):
        same_tokens &= [x.token for x in xs] == [y.token for y in ys]
        for x, y in zip(xs, ys, strict=False):
            token = max(token, abs(x.logprob - y.logprob))
            ref = dict(y.top)
            top = max([top, *(abs(v - ref[t]) for t, v in x.top if t in ref)])
    return {"tokens_identical": same_tokens, "max_abs_logprob": token, "max_abs_top": top}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sharegpt", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=RESULTS / "logprobs_agreement.json")
    args = ap.parse_args()
    folder = resolve_checkpoint("embedded")
    tok = Tokenizer(folder)
    texts = first_prompts(args.sharegpt, max_chars=600) + list(COPY_PROMPTS)
    prompts = chat_prompts(tok, texts)
    target = ModelSpec(str(folder))
    t0 = time.time()
    runs = {name: _run(target, d, prompts, args.max_tokens) for name, d in _drafts().items()}
    base = runs["none"][0]
    results = {
        name: _max_diff(lps, base) | {"tokens_from_spec_steps": spec, "tokens": total}
        for name, (lps, spec, total) in runs.items()
        if name != "none"
    }
    report = {
        "benchmark": "logprobs_agreement",
        "machine": {"cpus": 2, "platform": platform.platform()},
        "dtype": "float32",
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "against_no_drafter": results,
        "wall_s": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

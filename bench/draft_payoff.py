"""Whether adaptive speculation pays at a batch size, in-process, drafters against none.

The embedded model in float32 decodes ShareGPT first prompts (chat template; computed
in-engine first, then timed) at ``--batch`` sequences, greedy, with no
drafter and with each drafter as served (k = 4 adaptive): the shipped EAGLE head behind n-gram
lookup, and n-gram lookup alone.
The engines alternate ``--trials`` times. Per run: decode tokens/s, and per step the tokens
the target scored, the tokens the drafter's model computed (its rounds), and the tokens
emitted. Adaptive speculation should never be much slower than none: where a drafter's
tokens/s fall below none's, the planner granted drafts that did not pay.

With ``--closed-loop N``, the engines instead serve ``N`` prompts as ``--batch`` clients
would, each sending its next prompt when its last request ends, so prompts are computed in
the steps between decodes as a colocated replica computes them; the clock covers the whole
run, prompts included (output tokens over it, as ``vllm bench serve`` reports).

    .venv/bin/python -m bench.draft_payoff [--batch 8] [--new-tokens 64] [--trials 2]
        [--closed-loop 32] [--out bench/results/draft_payoff.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.load_report import write_json
from bench.sharegpt import chat_prompts, first_prompts
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from decode.outputs import EngineStats
from models.embedded import embedded_eagle_path
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"


def drafts() -> dict[str, DraftSpec]:
    head = ModelSpec(str(embedded_eagle_path()), "float32")
    return {
        "none": DraftSpec(),
        "eagle+lookup": DraftSpec(DraftKind.EAGLE, head, 4, lookup_first=True),
        "ngram": DraftSpec(DraftKind.NGRAM, None, 4),
    }


def _report(s0: EngineStats, s1: EngineStats, emitted: int, seconds: float) -> dict[str, float]:
    """A run's tokens/s, and per step: tokens scored by the target and by the drafter's model
    (its rounds), tokens emitted; from the engine's counters before and after it."""
    steps = max(s1.steps - s0.steps, 1)
    return {
        "tok_s": emitted / seconds,
        "steps": steps,
        "target_tokens_per_step": (s1.target_tokens_fed - s0.target_tokens_fed) / steps,
        "draft_tokens_per_step": (s1.draft_tokens_fed - s0.draft_tokens_fed) / steps,
        "emitted_per_step": emitted / steps,
    }


def _run(engine: DecodeEngine, prompts: list[list[int]], new: int) -> dict[str, float]:
    reqs = [
        Request(uuid.uuid4().hex, p, SamplingParams(temperature=0.0, max_tokens=new))
        for p in prompts
    ]
    for r in reqs:
        engine.add(r, None)
    while any(not r.output_token_ids for r in reqs):  # prompts and first tokens: not timed
        engine.step()
    s0, before = engine.stats(), sum(len(r.output_token_ids) for r in reqs)
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - t0
    emitted = sum(len(r.output_token_ids) for r in reqs) - before
    return _report(s0, engine.stats(), emitted, seconds)


def closed_loop(
    engine: DecodeEngine, prompts: Sequence[list[int]], clients: int, sampling: SamplingParams
) -> dict[str, float]:
    """``prompts`` served in order by ``clients`` closed-loop clients (each sends its next prompt
    when its last request ends); output tokens/s over the whole run and per-step counts."""
    queue = list(prompts)
    running: list[Request] = []
    done: list[Request] = []
    s0 = engine.stats()
    t0 = time.perf_counter()
    while queue or running:
        while queue and len(running) < clients:
            r = Request(uuid.uuid4().hex, queue.pop(0), sampling)
            engine.add(r, None)
            running.append(r)
        engine.step()
        done += [r for r in running if r.is_finished]
        running = [r for r in running if not r.is_finished]
    seconds = time.perf_counter() - t0
    emitted = sum(len(r.output_token_ids) for r in done)
    return _report(s0, engine.stats(), emitted, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--closed-loop", type=int, default=0, help="prompts served by --batch clients")
    ap.add_argument("--out", type=Path, default=RESULTS / "draft_payoff.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_checkpoint("embedded")
    tok = Tokenizer(folder)
    prompts = chat_prompts(tok, first_prompts(args.closed_loop or args.batch))
    engines = {
        name: DecodeEngine(
            DecodeEngineConfig(
                "m", ModelSpec(str(folder), "float32"), d, num_blocks=2048, max_batch_size=32
            )
        )
        for name, d in drafts().items()
    }
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for _ in range(args.trials):  # alternate: a burst of load lands on one run of each
        for name, engine in engines.items():
            runs[name].append(
                closed_loop(engine, prompts, args.batch, greedy)
                if args.closed_loop
                else _run(engine, prompts, args.new_tokens)
            )
            print(f"{name}: {runs[name][-1]}", flush=True)
    for engine in engines.values():
        engine.close()
    none = statistics.median(r["tok_s"] for r in runs["none"])
    report: dict[str, Any] = {
        "benchmark": "draft_payoff",
        "batch": args.batch,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "closed_loop_prompts": args.closed_loop,
        "runs": runs,
        "ratio_to_none": {
            name: statistics.median(r["tok_s"] for r in rs) / none for name, rs in runs.items()
        },
    }
    print(report["ratio_to_none"], flush=True)
    write_json(args.out, report)


if __name__ == "__main__":
    main()

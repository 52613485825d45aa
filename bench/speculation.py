"""Speculation on this CPU, each number a ratio against a baseline taken in the same run.

1. ``ngram``: n-gram drafting on copy-heavy prompts (repeat, edit, extract), batch 1, greedy —
   the engine against transformers' prompt-lookup decoding
   (``generate(prompt_lookup_num_tokens=K)``, best of K = 3, 5, 10) on the same weights;
   outputs must be token-identical.
2. ``adaptive``: throughput with adaptive n-gram speculation against speculation off at batch
   sizes 1..32 on ShareGPT prompts (the goal: never below 0.95x), two ways: *steady* — a
   closed loop of ``batch`` clients, each starting its next request when one finishes, 3 x batch
   requests (at least 8), prompts included: the batch stays full as on a serving replica; and
   *closed* — ``batch`` requests started together and run to the last (decode time only), where
   speculation that finishes the predictable requests early leaves the rest at a smaller batch.
3. ``acceptance``: acceptance rate and mean accepted length per drafter on held-out ShareGPT
   prompts (n-gram; and an EAGLE head when ``--eagle`` names one).

    .venv/bin/python -m bench.speculation [--parts ngram adaptive acceptance] [--eagle DIR]

Writes bench/results/speculation.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from bench.copy_prompts import COPY_PROMPTS
from bench.engine_run import decode_after_first, serve_refilling
from bench.sharegpt import chat_prompts
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from distill.sharegpt import first_prompts
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"


def _engine(target: ModelSpec, draft: DraftSpec, batch: int = 64) -> DecodeEngine:
    return DecodeEngine(
        DecodeEngineConfig("m", target, draft, num_blocks=2048, max_batch_size=batch)
    )


def _decode(
    engine: DecodeEngine,
    prompts: list[list[int]],
    max_tokens: int,
    finish_s: dict[str, float] | None = None,
) -> tuple[list[list[int]], float, list[Request]]:
    """Greedy, all at once; returns outputs, decode seconds (after every first token), requests."""
    reqs = _greedy(prompts, max_tokens)
    dt = decode_after_first(engine, reqs, finish_s)
    return [r.output_token_ids for r in reqs], dt, reqs


def ngram_vs_prompt_lookup(folder: Path, max_tokens: int) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    tok = Tokenizer(folder)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in COPY_PROMPTS]
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    target = ModelSpec(str(folder))
    engine = _engine(target, DraftSpec(DraftKind.NGRAM, num_speculative_tokens=8), batch=1)
    ours_tokens, ours_time, identical = 0, 0.0, True
    theirs: dict[int, tuple[int, float]] = dict.fromkeys((3, 5, 10), (0, 0.0))
    for p in prompts:
        out, dt, _ = _decode(engine, [p], max_tokens)
        ours_tokens += len(out[0]) - 1
        ours_time += dt
        ids = torch.tensor([p])
        for k in (3, 5, 10):
            kw: dict[str, Any] = {
                "do_sample": False,
                "max_new_tokens": max_tokens,
                "prompt_lookup_num_tokens": k,
            }
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, do_sample=False)
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            ref = hf.generate(ids, **kw)[0, len(p) :].tolist()
            dt_hf = time.perf_counter() - t0 - t_first  # their decode time, prefill excluded
            n, t = theirs[k]
            theirs[k] = (n + len(ref) - 1, t + dt_hf)
            identical &= ref == out[0]
    ours_rate = ours_tokens / ours_time
    rates = {k: n / t for k, (n, t) in theirs.items()}
    best = max(rates, key=lambda k: rates[k])
    return {
        "engine_tok_s": ours_rate,
        "prompt_lookup_tok_s": rates,
        "best_k": best,
        "ratio_to_best": ours_rate / rates[best],
        "greedy_identical": identical,
    }


def _greedy(prompts: list[list[int]], max_tokens: int) -> list[Request]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=(2,))
    return [Request(uuid.uuid4().hex, p, sp) for p in prompts]


def _steady(engine: DecodeEngine, prompts: list[list[int]], batch: int, max_tokens: int) -> float:
    """Output tokens per second of a closed loop of ``batch`` clients (prompts included)."""
    reqs = _greedy(prompts, max_tokens)
    dt = serve_refilling(engine, reqs, batch)
    return sum(len(r.output_token_ids) for r in reqs) / dt


def adaptive_vs_off(folder: Path, batches: list[int], max_tokens: int) -> dict[str, Any]:
    tok = Tokenizer(folder)
    texts = first_prompts(max(8, 3 * max(batches)), max_chars=500, skip=500)
    prompts = chat_prompts(tok, texts)
    target = ModelSpec(str(folder))
    off = _engine(target, DraftSpec())
    on = _engine(target, DraftSpec(DraftKind.NGRAM, num_speculative_tokens=4, adaptive=True))
    out: dict[str, Any] = {}
    for engine in (off, on):  # untimed: first-run allocations would bias whichever goes first
        _decode(engine, prompts[:2], 16)
    for b in batches:
        runs: dict[str, list[float]] = {"off": [], "on": []}
        per_req: dict[str, list[float]] = {"off": [], "on": []}
        steady: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(2):  # alternate, twice: this machine is noisy
            for name, engine in (("off", off), ("on", on)):
                steady[name].append(_steady(engine, prompts[: max(8, 3 * b)], b, max_tokens))
                done: dict[str, float] = {}
                outs, dt, reqs = _decode(engine, prompts[:b], max_tokens, done)
                runs[name].append(sum(len(o) - 1 for o in outs) / dt)
                rates = [(len(r.output_token_ids) - 1) / done[r.request_id] for r in reqs]
                per_req[name].append(statistics.mean(rates))
        on_rate, off_rate = statistics.median(runs["on"]), statistics.median(runs["off"])
        on_req, off_req = statistics.median(per_req["on"]), statistics.median(per_req["off"])
        on_st, off_st = statistics.median(steady["on"]), statistics.median(steady["off"])
        out[str(b)] = {
            "steady_on_tok_s": on_st,
            "steady_off_tok_s": off_st,
            "steady_ratio": on_st / off_st,
            "on_tok_s": on_rate,
            "off_tok_s": off_rate,
            "ratio": on_rate / off_rate,
            "on_per_request_tok_s": on_req,
            "off_per_request_tok_s": off_req,
            "per_request_ratio": on_req / off_req,
        }
        print(
            f"batch {b}: steady on/off = {on_st / off_st:.2f} ({on_st:.1f} vs {off_st:.1f} "
            f"tok/s); closed {on_rate / off_rate:.2f}; per request {on_req / off_req:.2f}",
            flush=True,
        )
    return out


def acceptance(folder: Path, eagle: Path | None, n: int, max_tokens: int) -> dict[str, Any]:
    tok = Tokenizer(folder)
    texts = first_prompts(n, max_chars=800, skip=2000)  # held out from the other parts
    prompts = chat_prompts(tok, texts)
    target = ModelSpec(str(folder))
    drafts = {"ngram": DraftSpec(DraftKind.NGRAM, num_speculative_tokens=4, adaptive=False)}
    if eagle is not None:
        drafts["eagle"] = DraftSpec(
            DraftKind.EAGLE, model=ModelSpec(str(eagle)), num_speculative_tokens=4, adaptive=False
        )
    out: dict[str, Any] = {}
    for name, spec in drafts.items():
        _, _, reqs = _decode(_engine(target, spec), prompts, max_tokens)
        steps = sum(r.stats.num_steps for r in reqs)
        drafted = sum(r.stats.num_draft_tokens for r in reqs)
        accepted = sum(r.stats.num_accepted_tokens for r in reqs)
        emitted = sum(r.stats.num_emitted_tokens for r in reqs)
        decoded = sum(len(r.output_token_ids) - 1 for r in reqs)
        out[name] = {
            "prompts": len(prompts),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": emitted / steps if steps else None,  # tokens per target forward
            "share_of_steps_with_drafts": steps / max(1, decoded),
        }
        print(name, out[name], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--parts", nargs="+", default=["ngram", "adaptive", "acceptance"])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--held-out", type=int, default=50)
    ap.add_argument("--eagle", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    folder = resolve_checkpoint("embedded")
    path = RESULTS / "speculation.json"
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    if "ngram" in args.parts:
        report["ngram_vs_prompt_lookup"] = ngram_vs_prompt_lookup(folder, args.max_tokens)
        print(json.dumps(report["ngram_vs_prompt_lookup"]), flush=True)
    if "adaptive" in args.parts:
        report["adaptive_vs_off"] = adaptive_vs_off(folder, args.batches, args.max_tokens)
    if "acceptance" in args.parts:
        report["acceptance"] = acceptance(folder, args.eagle, args.held_out, args.max_tokens)
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""xgrammar against llguidance for tandem's constrained decoding, on the embedded tokenizer.

For each library: the one-time tokenizer setup; the cold and the cached compile of each of the
60 schemas of ``bench.json_schemas``; and the time to fill the next-token masks of a batch of
1 and of 32 requests while each walks its schema (a random allowed token per step, 48 steps),
with the library's own batched fill. Also the time to advance along 4 draft tokens and roll
back, which speculation pays per verified chain. The two run one after the other on one core.

    .venv/bin/pip install xgrammar  # the candidate not chosen is no dependency
    .venv/bin/python -m bench.grammar_libs [--out bench/results/grammar_libs.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.json_schemas import json_schemas
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"
STEPS = 48


def _allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    """mask: [W] int32 bitmask words -> the allowed ids below ``vocab``."""
    bits = (mask.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    ids = bits.flatten().nonzero().flatten()
    return [int(i) for i in ids if int(i) < vocab]


def _walk(
    fill: Callable[[list[int], torch.Tensor], None],
    accept: Callable[[int, int], bool],
    batch: int,
    words: int,
    vocab: int,
    rng: random.Random,
) -> list[float]:
    mask = torch.zeros(batch, words, dtype=torch.int32)
    times = []
    live = list(range(batch))
    for _ in range(STEPS):
        t0 = time.perf_counter()
        fill(live, mask)
        times.append(time.perf_counter() - t0)
        live = [b for b in live if accept(b, rng.choice(_allowed(mask[b], vocab)))]
        if not live:
            break
    return times


def _xgrammar(tok: Tokenizer, schemas: list[dict[str, Any]], rng: random.Random) -> dict[str, Any]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=tok.vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0
    cold, warm = [], []
    compiled = []
    for s in schemas:
        text = json.dumps(s)
        t0 = time.perf_counter()
        compiled.append(compiler.compile_json_schema(text, strict_mode=True))
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compiler.compile_json_schema(text, strict_mode=True)
        warm.append(time.perf_counter() - t0)
    words = xgr.get_bitmask_shape(1, info.vocab_size)[1]
    out: dict[str, Any] = {"setup_s": setup, "compile_cold_ms": _ms(cold), "cached_ms": _ms(warm)}
    for batch in (1, 32):
        ms = [xgr.GrammarMatcher(compiled[b % len(compiled)]) for b in range(batch)]
        batcher = xgr.BatchGrammarMatcher(max_threads=1)

        def fill(
            live: list[int], mask: torch.Tensor, ms: list[Any] = ms, bm: Any = batcher
        ) -> None:
            if len(live) == 1:
                ms[live[0]].fill_next_token_bitmask(mask, live[0])
            else:
                bm.batch_fill_next_token_bitmask([ms[b] for b in live], mask, live)

        def accept(b: int, t: int, ms: list[Any] = ms) -> bool:
            ms[b].accept_token(t)
            return not ms[b].is_terminated()

        out[f"fill_batch{batch}_ms"] = _ms(_walk(fill, accept, batch, words, tok.vocab_size, rng))
    m = xgr.GrammarMatcher(compiled[0])
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    draft = []
    for _ in range(4):
        m.fill_next_token_bitmask(mask)
        t = rng.choice(_allowed(mask[0], tok.vocab_size))
        m.accept_token(t)
        draft.append(t)
    m.rollback(4)
    t0 = time.perf_counter()
    for _ in range(20):
        for t in draft:
            m.fill_next_token_bitmask(mask)
            m.accept_token(t)
        m.rollback(len(draft))
    out["draft4_fill_and_rollback_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    return out


def _llguidance(
    tok: Tokenizer, schemas: list[dict[str, Any]], rng: random.Random
) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok.hf, n_vocab=tok.vocab_size)
    setup = time.perf_counter() - t0
    cold, warm = [], []
    grammars = []
    for s in schemas:
        g = llguidance.LLMatcher.grammar_from_json_schema(s)
        t0 = time.perf_counter()
        llguidance.LLMatcher(lltok, g)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llguidance.LLMatcher(lltok, g)
        warm.append(time.perf_counter() - t0)
        grammars.append(g)
    words = lt.get_bitmask_shape(1, lltok.vocab_size)[1]
    out: dict[str, Any] = {"setup_s": setup, "compile_cold_ms": _ms(cold), "cached_ms": _ms(warm)}
    executor = llguidance.LLExecutor(num_threads=1)
    for batch in (1, 32):
        ms = [llguidance.LLMatcher(lltok, grammars[b % len(grammars)]) for b in range(batch)]

        def fill(live: list[int], mask: torch.Tensor, ms: list[Any] = ms) -> None:
            if len(live) == 1:
                lt.fill_next_token_bitmask(ms[live[0]], mask, live[0])
            else:
                lt.fill_next_token_bitmask_par(executor, [(ms[b], b) for b in live], mask)

        def accept(b: int, t: int, ms: list[Any] = ms) -> bool:
            ms[b].consume_token(t)
            return not ms[b].is_stopped()

        out[f"fill_batch{batch}_ms"] = _ms(_walk(fill, accept, batch, words, tok.vocab_size, rng))
    m = llguidance.LLMatcher(lltok, grammars[0])
    mask = lt.allocate_token_bitmask(1, lltok.vocab_size)
    draft = []
    for _ in range(4):
        lt.fill_next_token_bitmask(m, mask)
        t = rng.choice(_allowed(mask[0], tok.vocab_size))
        m.consume_token(t)
        draft.append(t)
    m.rollback(4)
    t0 = time.perf_counter()
    for _ in range(20):
        for t in draft:
            lt.fill_next_token_bitmask(m, mask)
            m.consume_token(t)
        m.rollback(len(draft))
    out["draft4_fill_and_rollback_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    return out


def _ms(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "mean": statistics.fmean(s) * 1e3,
        "p50": s[len(s) // 2] * 1e3,
        "p99": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULTS / "grammar_libs.json")
    ap.add_argument("--schemas", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer(resolve_checkpoint("embedded"))
    schemas = json_schemas(args.schemas)
    result = {
        "host": platform.processor() or platform.machine(),
        "vocab": tok.vocab_size,
        "schemas": len(schemas),
        "xgrammar": _xgrammar(tok, schemas, random.Random(0)),
        "llguidance": _llguidance(tok, schemas, random.Random(0)),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

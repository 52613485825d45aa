"""Per-token cost of incremental detokenization as the output grows, in one run.

``models.tokenizer.IncrementalDetokenizer`` (``tokenizers``' ``DecodeStream``: a short window of
recent ids per token) against the baseline it replaced, which decoded the whole output again on
every token. Both stream the same ids (ShareGPT assistant text, tokenized and repeated to the
length) one token at a time; reported: mean µs per token over the last 256 tokens of outputs of
256, 1,024 and 4,096 tokens.

    .venv/bin/python -m bench.detokenizer [--out bench/results/detokenizer.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.sharegpt import iter_conversations
from models.tokenizer import IncrementalDetokenizer, Tokenizer
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"
LENGTHS = (256, 1024, 4096)
TAIL = 256


def _text(chars: int) -> str:
    parts: list[str] = []
    for conv in iter_conversations():
        parts += [m["content"] for m in conv.messages() if m["role"] == "assistant"]
        if sum(map(len, parts)) >= chars:
            break
    return "\n".join(parts)


def _redecode_us(tok: Tokenizer, ids: list[int]) -> float:
    """The replaced baseline: the whole output decoded again per token."""
    seen: list[int] = []
    emitted = ""
    t0 = 0.0
    for i, t in enumerate(ids):
        if i == len(ids) - TAIL:
            t0 = time.perf_counter()
        seen.append(t)
        text = tok.decode(seen)
        if not text.endswith("\ufffd"):
            emitted = text
    assert emitted or not ids
    return (time.perf_counter() - t0) / TAIL * 1e6


def _stream_us(tok: Tokenizer, ids: list[int]) -> float:
    detok = IncrementalDetokenizer(tok)
    t0 = 0.0
    for i, t in enumerate(ids):
        if i == len(ids) - TAIL:
            t0 = time.perf_counter()
        detok.push([t])
    return (time.perf_counter() - t0) / TAIL * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=RESULTS / "detokenizer.json")
    args = ap.parse_args()
    tok = Tokenizer(resolve_checkpoint("embedded"))
    base = tok.encode(_text(40_000))
    rows = []
    for n in LENGTHS:
        ids = (base * (n // len(base) + 1))[:n]
        stream, redecode = _stream_us(tok, ids), _redecode_us(tok, ids)
        rows.append(
            {
                "tokens": n,
                "stream_us_per_token": stream,
                "redecode_us_per_token": redecode,
                "speedup": redecode / stream,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "detokenizer", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

"""Decode tokens/s of this tree against a git revision, alternated, on the embedded model.

A refactor must leave the CPU figures where they were, and this machine's speed drifts by more
than the difference sought: each round runs the base revision, then this tree, each in a fresh
process over a worktree of its own, and the report is the median of the per-round ratios.

    .venv/bin/python -m bench.engine_ab --base REV [--rounds 3] [--batches 1 8 32]
        [--dtypes float32 bfloat16] [--tokens 48] [--out bench/results/engine_ab.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.load_report import write_json

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# Run in each tree: it uses only what both revisions have (``engine_tokens_per_s``).
CHILD = """
import json, sys, torch
from bench.engine_step import engine_tokens_per_s
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.spec import DraftSpec, ModelSpec
from models.weights import resolve_checkpoint

dtypes, batches, tokens = json.loads(sys.argv[1])
torch.set_num_threads(2)
folder = resolve_checkpoint("embedded")
out = {}
for dt in dtypes:
    spec = ModelSpec(str(folder), dt)
    engine = DecodeEngine(DecodeEngineConfig("m", spec, DraftSpec(), num_blocks=1024))
    engine_tokens_per_s(engine, 1, 8)  # the first steps build and load the kernels
    out[dt] = {str(b): engine_tokens_per_s(engine, b, tokens) for b in batches}
    engine.close()
print("RESULT " + json.dumps(out), flush=True)
"""


def _measure(tree: Path, args: list[Any]) -> dict[str, dict[str, float]]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, dict[str, float]] = json.loads(line.removeprefix("RESULT "))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_ab.json")
    a = ap.parse_args()
    rev = subprocess.run(
        ["git", "rev-parse", a.base], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    spec = [a.dtypes, a.batches, a.tokens]
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base_tree), rev], cwd=ROOT, check=True
        )
        try:
            for i in range(a.rounds):
                rounds.append({"base": _measure(base_tree, spec), "this": _measure(ROOT, spec)})
                print(f"round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
        finally:
            remove = ["git", "worktree", "remove", "--force", str(base_tree)]
            subprocess.run(remove, cwd=ROOT, check=False)
    ratios = {
        dt: {
            str(b): statistics.median(r["this"][dt][str(b)] / r["base"][dt][str(b)] for r in rounds)
            for b in a.batches
        }
        for dt in a.dtypes
    }
    print("median this / base:", json.dumps(ratios))
    write_json(
        a.out,
        {"benchmark": "engine_ab", "base": rev, "args": spec, "rounds": rounds, "ratio": ratios},
    )


if __name__ == "__main__":
    main()

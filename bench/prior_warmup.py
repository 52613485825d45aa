"""How fast a decode replica started mid-traffic plans with the right acceptance estimates:
seeded from its pool's calibration cells (``serving.shared_priors``) against from the default.

The embedded SmolLM2-135M with n-gram lookup, in-process (the seeding itself is the engine's
``SpeculationPolicy.seed``; the Ray path that reads the pool's board is tested in
``tests/cluster/test_goodput_autoscaling.py``). A first replica serves ``--warm`` requests of a
mix: copy-heavy prompts (text to repeat or edit, greedy) and ShareGPT prompts sampled at
temperature 0.8, in turn. Its cells' calibrated estimates at the end are the **steady**
estimates. Then two new replicas serve the next ``--probe`` requests one at a time, each
starting from its cell's estimate: one fresh (the default prior, as today), one seeded from
the first's cells. Reported per request: its starting estimate against its cell's steady one,
and the requests until every later start is within ``--tolerance`` of steady.

    .venv/bin/python -m bench.prior_warmup --out bench/results/prior_warmup.json
"""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path
from typing import Any

from bench.copy_prompts import COPY_PROMPTS
from bench.engine_run import serve_refilling
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from decode.speculation import SpeculationPolicy
from distill.sharegpt import first_prompts
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"


def _mix(tok: Tokenizer, n: int, skip: int, max_tokens: int) -> list[Request]:
    """``n`` requests alternating a greedy copy-heavy prompt and a sampled ShareGPT one."""
    chat = first_prompts(n, max_chars=600, skip=skip)
    out = []
    for i in range(n):
        copy = i % 2 == 0
        text = COPY_PROMPTS[(i // 2 + skip) % len(COPY_PROMPTS)] if copy else chat[i // 2]
        ids = tok.apply_chat_template([{"role": "user", "content": text}])
        sp = SamplingParams(
            temperature=0.0 if copy else 0.8,
            max_tokens=max_tokens,
            stop_token_ids=(2,),
            seed=i,
            seeded=not copy,
        )
        out.append(Request(uuid.uuid4().hex, ids, sp))
    return out


def _engine(folder: Path) -> DecodeEngine:
    draft = DraftSpec(DraftKind.NGRAM, num_speculative_tokens=4)
    return DecodeEngine(DecodeEngineConfig("m", ModelSpec(str(folder)), draft, num_blocks=1024))


def _starts(
    engine: DecodeEngine, reqs: list[Request], steady: dict[tuple[int, int], float]
) -> list[dict[str, Any]]:
    """Serve ``reqs`` one after another; each one's starting estimate against steady."""
    rows = []
    for r in reqs:
        serve_refilling(engine, [r], 1)
        assert r.calibration_key is not None and r.start_estimate is not None
        want = steady.get(r.calibration_key)
        rows.append(
            {
                "cell": list(r.calibration_key),
                "start": round(r.start_estimate, 4),
                "steady": None if want is None else round(want, 4),
                "error": None if want is None else round(abs(r.start_estimate - want), 4),
                "drafted": r.stats.num_draft_tokens,
                "accepted": r.stats.num_accepted_tokens,
            }
        )
    return rows


def _settled_after(rows: list[dict[str, Any]], tolerance: float) -> int | None:
    """Requests served before every later start is within ``tolerance`` (None: never)."""
    errors = [r["error"] for r in rows]
    for i in range(len(errors)):
        if all(e is not None and e <= tolerance for e in errors[i:]):
            return i
    return None


def run(warm: int, probe: int, max_tokens: int, tolerance: float) -> dict[str, Any]:
    folder = resolve_checkpoint("embedded")
    tok = Tokenizer(folder)
    first = _engine(folder)
    serve_refilling(first, _mix(tok, warm, 0, max_tokens), 4)
    spec = first.speculation
    assert spec is not None
    cells = spec.calibration.cells()
    steady = {c.key: spec.calibration.estimate(c.key, spec.prior) for c in cells}
    probes = _mix(tok, probe, warm, max_tokens)
    out: dict[str, Any] = {
        "model": "embedded SmolLM2-135M-Instruct, n-gram lookup k=4",
        "warm_requests": warm,
        "max_tokens": max_tokens,
        "tolerance": tolerance,
        "steady": {f"{k[0]},{k[1]}": round(v, 4) for k, v in steady.items()},
    }
    for name in ("fresh", "seeded"):
        engine = _engine(folder)
        policy: SpeculationPolicy | None = engine.speculation
        assert policy is not None
        seeded = policy.seed(cells) if name == "seeded" else 0.0
        fresh = [Request(uuid.uuid4().hex, list(r.prompt_token_ids), r.sampling) for r in probes]
        rows = _starts(engine, fresh, steady)
        out[name] = {
            "seeded_draft_tokens": seeded,
            "requests": rows,
            "mean_error_first_10": round(
                sum(r["error"] or 0.0 for r in rows[:10]) / min(len(rows), 10), 4
            ),
            "settled_after": _settled_after(rows, tolerance),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", type=int, default=24)
    ap.add_argument("--probe", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=RESULTS / "prior_warmup.json")
    args = ap.parse_args()
    out = run(args.warm, args.probe, args.max_tokens, args.tolerance)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for name in ("fresh", "seeded"):
        r = out[name]
        print(
            f"{name}: mean |start - steady| over the first 10: {r['mean_error_first_10']}, "
            f"settled after {r['settled_after']} requests"
        )


if __name__ == "__main__":
    main()

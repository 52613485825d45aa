"""Structured outputs on the embedded model with speculation on (the shipped EAGLE head, n-gram
lookup first, k = 4), in-process, one engine, one run.

Validity: each of the 60 schemas of ``bench.json_schemas`` is asked for in a chat prompt and
sampled (temperature 0.7) under its grammar, in batches; every output is checked against its
schema with ``jsonschema``. Cost, at batch 1 and batch 32: the time the logits processors and
grammar masks take per output token (every call of ``process_spans`` timed), against the time
per output token of those constrained requests (the goal: at most 10 %). For reference, the same
prompts unconstrained (stopped at the same lengths), interleaved in the same run: their time per
token differs mostly by what speculation accepts on free text, which is reported beside it.

    .venv/bin/python -m bench.structured_outputs [--batch1 6]
        [--out bench/results/structured_outputs.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema

from bench.json_schemas import json_schemas
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from decode.processing import process_spans
from models.embedded import embedded_eagle_path
from models.grammar import GrammarSpec
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"
MAX_TOKENS = 256


def _prompt(tok: Tokenizer, schema: dict[str, Any]) -> list[int]:
    ask = f"Reply with one JSON object following this JSON schema:\n{json.dumps(schema)}"
    return tok.apply_chat_template([{"role": "user", "content": ask}])


def _run(engine: DecodeEngine, reqs: list[Request]) -> tuple[dict[str, list[int]], float]:
    """Every request at once; (tokens per request, seconds of decode steps after the first
    token of each, i.e. the time the output tokens after the first cost)."""
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add(r, None)
    started: float | None = None
    while engine.has_work:
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
        if started is None and all(out.values()):
            started = time.perf_counter()  # every prompt computed: decode steps from here
    return out, time.perf_counter() - (started or time.perf_counter())


class _Timed:
    """``process_spans`` where the step and the drafters call it, with its time summed."""

    def __init__(self) -> None:
        import decode.drafters.draft_model as dm
        import decode.spec_step as step
        from decode.drafters import eagle

        self.seconds = 0.0
        inner = process_spans

        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args)
            finally:
                self.seconds += time.perf_counter() - t0

        for mod in (step, eagle, dm):
            mod.process_spans = timed  # type: ignore[attr-defined]


def _tpot(
    engine: DecodeEngine, reqs: list[Request], timer: _Timed
) -> tuple[float, float, float, dict[str, list[int]]]:
    """(time per output token, processing time per output token, acceptance, outputs)."""
    before = timer.seconds
    out, seconds = _run(engine, reqs)
    tokens = max(sum(max(len(v) - 1, 0) for v in out.values()), 1)
    drafted = sum(r.stats.num_draft_tokens for r in reqs)
    accepted = sum(r.stats.num_accepted_tokens for r in reqs)
    rate = accepted / drafted if drafted else 0.0
    return seconds / tokens, (timer.seconds - before) / tokens, rate, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch1", type=int, default=6, help="schemas timed one at a time")
    ap.add_argument("--out", type=Path, default=RESULTS / "structured_outputs.json")
    args = ap.parse_args()
    folder = resolve_checkpoint("embedded")
    tok = Tokenizer(folder)
    target = ModelSpec(str(folder))
    head = ModelSpec(str(embedded_eagle_path()))
    draft = DraftSpec(DraftKind.EAGLE, head, 4, adaptive=False, lookup_first=True)
    engine = DecodeEngine(
        DecodeEngineConfig("m", target, draft, num_blocks=2048, max_batch_size=32)
    )
    eos = target.config().eos_token_ids
    schemas = json_schemas(60)
    prompts = [_prompt(tok, s) for s in schemas]
    base = SamplingParams(temperature=0.7, max_tokens=MAX_TOKENS, stop_token_ids=eos)

    def constrained(i: int, seed: int) -> Request:
        g = GrammarSpec("json_schema", json.dumps(schemas[i]))
        return Request(uuid.uuid4().hex, prompts[i], replace(base, seed=seed, grammar=g))

    t0 = time.time()
    valid, lengths, drafted, accepted = 0, [], 0, 0
    invalid: list[dict[str, Any]] = []
    for start in range(0, len(schemas), 30):
        reqs = [constrained(i, i) for i in range(start, min(start + 30, len(schemas)))]
        out, _ = _run(engine, reqs)
        for i, r in zip(range(start, start + len(reqs)), reqs, strict=True):
            text = tok.decode(out[r.request_id])
            lengths.append(len(out[r.request_id]))
            drafted += r.stats.num_draft_tokens
            accepted += r.stats.num_accepted_tokens
            try:
                jsonschema.validate(json.loads(text), schemas[i])
                valid += 1
            except (ValueError, jsonschema.ValidationError) as e:
                invalid.append({"schema": i, "text": text[:200], "error": str(e)[:200]})

    cost: dict[str, Any] = {}
    timer = _Timed()
    for label, idx in (("batch1", list(range(args.batch1))), ("batch32", list(range(32)))):
        rows = []
        for rep in range(2):  # constrained and unconstrained interleaved, twice
            groups = [[i] for i in idx] if label == "batch1" else [idx]
            for g in groups:
                con = [constrained(i, 100 + rep) for i in g]
                t_con, t_proc, a_con, out = _tpot(engine, con, timer)
                # the same prompts, free, stopped at the constrained outputs' lengths
                free = [
                    Request(
                        uuid.uuid4().hex,
                        prompts[i],
                        replace(
                            base,
                            seed=100 + rep,
                            stop_token_ids=(),
                            max_tokens=max(len(out[r.request_id]), 2),
                        ),
                    )
                    for i, r in zip(g, con, strict=True)
                ]
                t_free, _, a_free, _ = _tpot(engine, free, timer)
                rows.append((t_con, t_proc, a_con, t_free, a_free))
        mean = [sum(r[k] for r in rows) / len(rows) for k in range(5)]
        cost[label] = {
            "constrained_tpot_ms": mean[0] * 1e3,
            "processing_ms_per_token": mean[1] * 1e3,
            "processing_share": mean[1] / mean[0],
            "constrained_acceptance": mean[2],
            "unconstrained_tpot_ms": mean[3] * 1e3,
            "unconstrained_acceptance": mean[4],
            "tpot_ratio": mean[0] / mean[3],
        }
    engine.close()
    report = {
        "benchmark": "structured_outputs",
        "machine": {"cpus": 2, "platform": platform.platform()},
        "model": "SmolLM2-135M-Instruct (embedded), float32",
        "speculation": "EAGLE head (shipped) with n-gram lookup first, k = 4",
        "schemas": len(schemas),
        "valid": valid,
        "valid_fraction": valid / len(schemas),
        "invalid": invalid,
        "mean_tokens": sum(lengths) / len(lengths),
        "acceptance_rate": accepted / drafted if drafted else None,
        "cost": cost,
        "wall_s": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "invalid"}, indent=2))


if __name__ == "__main__":
    main()

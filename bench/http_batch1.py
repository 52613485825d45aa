"""Batch-1 latency through HTTP: speculation off vs drafting, and the serving path against the
same engine in-process, in one run.

Starts a local disaggregated cluster per configuration (same machine, same prompts, greedy),
streams each prompt alone, and reports time to first token and decode tokens/s per prompt set,
with each drafter's ratio to off. With ``--in-process``, each configuration's prompts also run
through the same prefill worker and decode engine in this process (no Ray, no HTTP, the KV over
NIXL within the process), built from the same config, and the report gives HTTP over in-process
decode tokens/s: what the serving path (decode replica → ingress → proxy → client) costs.

Drafters: ``ngram`` (prompt lookup), ``eagle`` (the shipped distilled head,
``models/drafts/smollm2-135m-eagle``) and ``eagle+lookup`` (the head where prompt lookup finds
no match: ``draft.lookup_first``), k = 4 adaptive, as served; a ``+treeW`` suffix
(``eagle+tree4``, ``eagle+lookup+tree4``) drafts trees ``W`` wide (``draft.tree_width``).

    .venv/bin/python -m bench.http_batch1 [--max-tokens 128] [--sharegpt 8]
        [--drafts ngram eagle eagle+lookup] [--quantization int8] [--dtype bfloat16]
        [--threads 2] [--stream-interval 0.05] [--in-process]
        [--out bench/results/http_batch1.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai

from bench.copy_prompts import COPY_PROMPTS
from bench.http_client import Timing, timed_chat
from bench.local_app import local_app
from bench.sharegpt import first_prompts
from cluster.builder import engine_configs, resolve_models
from cluster.config import TandemConfig
from decode.engine import DecodeEngine
from models.request import Request
from models.sampling import SamplingParams
from models.tokenizer import Tokenizer
from prefill.worker import PrefillWorker

RESULTS = Path(__file__).parent / "results"
EAGLE_HEAD = "models/drafts/smollm2-135m-eagle"


def _config(
    draft: str,
    port: int,
    quantization: str = "none",
    dtype: str = "float32",
    stream_interval_s: float = 0.0,
    threads: int = 2,
) -> TandemConfig:
    """``draft``: a kind, then ``+lookup`` (lookup first) and ``+treeW`` (trees W wide);
    ``quantization`` and ``dtype`` apply to the target and to an EAGLE head;
    ``stream_interval_s`` is ``decode.stream_interval_s`` (tokens coalesce on the hop to the
    ingress); ``threads`` each pool's ``num_threads`` (``deploy/local.yaml`` serves with 1,
    leaving the other core to the serving path)."""
    kind, *extras = draft.split("+")
    trees = [int(e.removeprefix("tree")) for e in extras if e.startswith("tree")]
    return TandemConfig.model_validate(
        {
            "mode": "disaggregated",
            "model": {"quantization": quantization, "dtype": dtype},
            "draft": {"kind": kind, "num_speculative_tokens": 4}
            | (
                {"source": EAGLE_HEAD, "quantization": quantization, "dtype": dtype}
                if kind == "eagle"
                else {}
            )
            | ({"lookup_first": True} if "lookup" in extras else {})
            | ({"tree_width": trees[0]} if trees else {}),
            "prefill": {"num_blocks": 256, "num_threads": threads},
            "decode": {
                "num_blocks": 512,
                "num_threads": threads,
                "stream_interval_s": stream_interval_s,
            },
            "http": {"port": port},
        }
    )


def _summary(ts: list[Timing]) -> dict[str, float]:
    drafted = sum(t.draft_tokens for t in ts)
    return {
        "ttft_ms_median": 1000 * statistics.median(t.ttft_s for t in ts),
        "decode_tok_s_mean": sum(t.completion_tokens - 1 for t in ts)
        / sum(t.total_s - t.ttft_s for t in ts),
        "e2e_tok_s_mean": sum(t.completion_tokens for t in ts) / sum(t.total_s for t in ts),
        "completion_tokens": float(sum(t.completion_tokens for t in ts)),
        "acceptance_rate": sum(t.accepted_tokens for t in ts) / drafted if drafted else 0.0,
    }


def run_config(
    draft: str,
    sets: dict[str, list[str]],
    max_tokens: int,
    port: int,
    quantization: str = "none",
    dtype: str = "float32",
    stream_interval_s: float = 0.0,
    threads: int = 2,
) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Per prompt set: the summary, and the texts (greedy: to compare across drafters)."""
    cfg = _config(draft, port, quantization, dtype, stream_interval_s, threads)
    with local_app(cfg, num_cpus=2) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="x", timeout=600)
        model = resolve_models(cfg).name
        timed_chat(client, model, "Hello!", 8, temperature=0)  # warm-up
        out: dict[str, Any] = {}
        texts: dict[str, list[str]] = {}
        for name, prompts in sets.items():
            ts = [timed_chat(client, model, p, max_tokens, temperature=0) for p in prompts]
            out[name] = _summary(ts)
            texts[name] = [t.text for t in ts]
            print(f"  {draft:12s} {name:9s} {out[name]}", flush=True)
        return out, texts


def run_in_process(
    draft: str,
    sets: dict[str, list[str]],
    max_tokens: int,
    quantization: str = "none",
    dtype: str = "float32",
    threads: int = 2,
) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """``run_config`` without the serving path: the same worker and engine, in this process,
    each prompt alone; time to first token is the prefill, decode time runs from there to the
    last token (as the HTTP client measures it, without the hops)."""
    cfg = _config(draft, 8000, quantization, dtype, threads=threads)  # port unused here
    m = resolve_models(cfg)
    engine_cfg, worker_cfg = engine_configs(cfg, m)
    assert worker_cfg is not None
    worker, engine = PrefillWorker(worker_cfg), DecodeEngine(engine_cfg)
    tok = Tokenizer(Path(m.target.folder))
    sp = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, stop_token_ids=m.target.config().eos_token_ids
    )
    try:
        _one_in_process(worker, engine, tok.apply_chat_template([_user("Hello!")]), sp)  # warm
        out: dict[str, Any] = {}
        texts: dict[str, list[str]] = {}
        for name, prompts in sets.items():
            ts = []
            for p in prompts:
                t, ids = _one_in_process(worker, engine, tok.apply_chat_template([_user(p)]), sp)
                ts.append(replace(t, text=tok.decode(ids, skip_special_tokens=True)))
            out[name] = _summary(ts)
            texts[name] = [t.text for t in ts]
            print(f"  {draft:12s} {name:9s} in-process {out[name]}", flush=True)
        return out, texts
    finally:
        engine.close()
        worker.close()


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _one_in_process(
    worker: PrefillWorker, engine: DecodeEngine, prompt: list[int], sp: SamplingParams
) -> tuple[Timing, list[int]]:
    req = Request(uuid.uuid4().hex, prompt, sp)
    t0 = time.perf_counter()
    handoff = worker.prefill(req)
    first = time.perf_counter()
    ids = [handoff.first_token]
    done = handoff.finish_reason is not None
    if not done:
        engine.add(req, handoff)
    while not done:
        for o in engine.step():
            if o.error is not None:
                raise RuntimeError(o.error)
            ids.extend(o.new_token_ids)
            done = done or o.finished
    end = time.perf_counter()
    while engine.has_work:  # the pull's notice, so the prefill lease ends
        engine.step()
    worker.reap()
    s = req.stats
    return Timing(first - t0, end - t0, len(ids), s.num_draft_tokens, s.num_accepted_tokens), ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sharegpt", type=int, default=8, help="ShareGPT prompts in the chat set")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument(
        "--drafts",
        nargs="+",
        default=["ngram"],
        help="ngram, eagle or eagle+lookup, an eagle one with +treeW (e.g. eagle+lookup+tree4)",
    )
    ap.add_argument(
        "--quantization", default="none", help="model.quantization (and an EAGLE head's)"
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model.dtype (and an EAGLE head's)",
    )
    ap.add_argument("--threads", type=int, default=2, help="each pool's num_threads")
    ap.add_argument(
        "--stream-interval",
        type=float,
        default=0.0,
        help="decode.stream_interval_s: seconds a stream's tokens may wait to travel together",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="also run each configuration in-process (the serving path's baseline)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "http_batch1.json")
    args = ap.parse_args()
    sets = {"sharegpt": first_prompts(args.sharegpt, max_chars=600), "copy": list(COPY_PROMPTS)}
    t0 = time.time()
    runs = {
        d: run_config(
            d,
            sets,
            args.max_tokens,
            args.port,
            args.quantization,
            args.dtype,
            args.stream_interval,
            args.threads,
        )
        for d in ["none", *args.drafts]
    }
    results = {d: r[0] for d, r in runs.items()}
    identical = {d: runs[d][1] == runs["none"][1] for d in args.drafts}
    serving: dict[str, Any] = {}
    if args.in_process:
        local = {
            d: run_in_process(d, sets, args.max_tokens, args.quantization, args.dtype, args.threads)
            for d in ["none", *args.drafts]
        }
        serving = {
            "in_process": {d: r[0] for d, r in local.items()},
            "http_over_in_process": {
                d: {
                    name: results[d][name]["decode_tok_s_mean"]
                    / local[d][0][name]["decode_tok_s_mean"]
                    for name in sets
                }
                for d in local
            },
            # the same greedy tokens in-process as through HTTP (text as each path decodes it)
            "in_process_identical_to_http": {d: local[d][1] == runs[d][1] for d in local},
        }
    ratios = {
        f"{d}_over_off": {
            name: {
                "decode_tok_s": results[d][name]["decode_tok_s_mean"]
                / results["none"][name]["decode_tok_s_mean"],
                "ttft": results[d][name]["ttft_ms_median"]
                / results["none"][name]["ttft_ms_median"],
            }
            for name in sets
        }
        for d in args.drafts
    }
    report = {
        "benchmark": "http_batch1",
        "machine": {"cpus": 2, "platform": platform.platform()},
        "max_tokens": args.max_tokens,
        "quantization": args.quantization,
        "dtype": args.dtype,
        "stream_interval_s": args.stream_interval,
        "threads": args.threads,
        "prompts": {k: len(v) for k, v in sets.items()},
        "results": results,
        **ratios,
        "greedy_identical_to_off": identical,
        **serving,
        "wall_s": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    extra = {k: v for k, v in serving.items() if k != "in_process"}
    print(json.dumps({**ratios, "greedy_identical_to_off": identical, **extra}, indent=2))


if __name__ == "__main__":
    main()

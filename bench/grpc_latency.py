"""Batch-1 streaming through gRPC against HTTP, on one app, in one run.

One local disaggregated app (n-gram drafting, k = 4 adaptive, as served) answers each prompt
alone, greedy, through both APIs in turn (HTTP first for even rounds, gRPC first for odd ones,
so neither always runs warm): the official ``openai`` client streaming a chat completion, and
a grpcio client streaming ``tandem.v1.Tandem/Generate`` with the same messages. Reports per API
the time to first token and the time per output token after the first, and gRPC's ratio to
HTTP (the goal: ≤ 1.05 time per output token).

    .venv/bin/python -m bench.grpc_latency [--sharegpt 8] [--rounds 2] [--max-tokens 128]
        [--out bench/results/grpc_latency.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import grpc
import openai

from bench.copy_prompts import COPY_PROMPTS
from bench.http_client import Timing, timed_chat
from bench.local_app import local_app
from bench.sharegpt import first_prompts
from cluster.builder import resolve_models
from cluster.config import TandemConfig
from cluster.proto import tandem_pb2 as pb
from cluster.proto import tandem_pb2_grpc

RESULTS = Path(__file__).parent / "results"


def timed_grpc(stub: Any, model: str, prompt: str, max_tokens: int) -> Timing:
    request = pb.GenerateRequest(
        model=model,
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
        sampling=pb.SamplingOptions(temperature=0.0, max_tokens=max_tokens),
        stream=True,
    )
    t0 = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    last: Any = None
    for r in stub.Generate(request, timeout=600):
        if r.text:
            parts.append(r.text)
            if first is None:
                first = time.perf_counter()
        last = r
    end = time.perf_counter()
    spec = last.usage.speculative
    return Timing(
        ttft_s=(first or end) - t0,
        total_s=end - t0,
        completion_tokens=int(last.usage.completion_tokens),
        draft_tokens=int(spec.draft_tokens),
        accepted_tokens=int(spec.accepted_tokens),
        text="".join(parts),
    )


def _summary(ts: list[Timing]) -> dict[str, float]:
    decode_s = sum(t.total_s - t.ttft_s for t in ts)
    return {
        "ttft_ms_median": 1000 * statistics.median(t.ttft_s for t in ts),
        "tpot_ms_mean": 1000 * decode_s / sum(t.completion_tokens - 1 for t in ts),
        "completion_tokens": float(sum(t.completion_tokens for t in ts)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sharegpt", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--grpc-port", type=int, default=9124)
    ap.add_argument("--out", type=Path, default=RESULTS / "grpc_latency.json")
    args = ap.parse_args()
    prompts = first_prompts(args.sharegpt, max_chars=600) + list(COPY_PROMPTS)
    cfg = TandemConfig.model_validate(
        {
            "mode": "disaggregated",
            "draft": {"kind": "ngram", "num_speculative_tokens": 4},
            "prefill": {"num_blocks": 256, "num_threads": 2},
            "decode": {"num_blocks": 512, "num_threads": 2},
            "http": {"port": args.port},
            "grpc": {"port": args.grpc_port},
        }
    )
    t0 = time.time()
    timings: dict[str, list[Timing]] = {"http": [], "grpc": []}
    same_text = True
    with local_app(cfg, num_cpus=2) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="x", timeout=600)
        model = resolve_models(cfg).name
        with grpc.insecure_channel(f"127.0.0.1:{args.grpc_port}") as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            timed_chat(client, model, "Hello!", 8, temperature=0)  # warm-up, both paths
            timed_grpc(stub, model, "Hello!", 8)
            for rnd in range(args.rounds):
                for p in prompts:
                    order = ("http", "grpc") if rnd % 2 == 0 else ("grpc", "http")
                    got = {}
                    for api in order:
                        got[api] = (
                            timed_chat(client, model, p, args.max_tokens, temperature=0)
                            if api == "http"
                            else timed_grpc(stub, model, p, args.max_tokens)
                        )
                        timings[api].append(got[api])
                    same_text &= got["http"].text == got["grpc"].text
    results = {api: _summary(ts) for api, ts in timings.items()}
    ratio = {
        "tpot": results["grpc"]["tpot_ms_mean"] / results["http"]["tpot_ms_mean"],
        "ttft": results["grpc"]["ttft_ms_median"] / results["http"]["ttft_ms_median"],
    }
    report = {
        "benchmark": "grpc_latency",
        "machine": {"cpus": 2, "platform": platform.platform()},
        "max_tokens": args.max_tokens,
        "requests_per_api": len(timings["http"]),
        "results": results,
        "grpc_over_http": ratio,
        "greedy_text_identical": same_text,
        "wall_s": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({**results, "grpc_over_http": ratio, "identical": same_text}, indent=2))


if __name__ == "__main__":
    main()

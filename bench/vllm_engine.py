"""Decode throughput at batch 8 and 32: tandem's engine against vLLM's CPU build offline
(``LLM.generate``), the same weights, prompts and lengths, both cores, in one run.

Why: ``bench.vllm_serve`` compares the two as served, where each server's serving path is part
of the figure. This compares the engines alone. Both compute the same ``B`` prompts (the first
ShareGPT first prompts under the chat template, handed to both as token ids) and write exactly
``--new-tokens`` tokens each (end-of-sequence ignored), greedy, float32, every core. A batch's
figure is its output tokens over the wall time of the whole batch, prompts included, median of
every trial. The engines take turns ``--rounds`` times, ``--trials`` trials each turn (this
machine's memory speed moves from minute to minute; one engine measured first and the other
after would carry that into the ratio): vLLM in its own venv (one subprocess a round keeps its
``LLM`` across trials; ``--enforce-eager``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), then tandem's
engine in this process without drafts, and with the served drafter (the shipped EAGLE head
behind n-gram lookup, adaptive k = 4). The report also counts the prompts whose greedy tokens
agree with vLLM's. vLLM's venv is set up as ``bench/vllm_serve.py`` says.

    .venv/bin/python -m bench.vllm_engine [--batches 8 32] [--new-tokens 128] [--trials 1]
        [--rounds 3] [--out bench/results/vllm_engine.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from bench.draft_payoff import drafts
from bench.load_report import write_json
from bench.sharegpt import chat_prompts, first_prompts
from bench.vllm_serve import VLLM_PYTHON, vllm_env, vllm_version
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"
# Runs in vLLM's venv: argv[1] the job (JSON), argv[2] where its timings and tokens go.
VLLM_JOB = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
job = json.load(open(sys.argv[1]))
llm = LLM(model=job["checkpoint"], dtype="float32", enforce_eager=True,
          gpu_memory_utilization=job["memory_utilization"], seed=0)
sp = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], ignore_eos=True)
llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], sp, use_tqdm=False)
out = {}
for b in job["batches"]:
    batch = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"][:b]]
    seconds = []
    for _ in range(job["trials"]):
        t0 = time.perf_counter()
        res = llm.generate(batch, sp, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
    out[str(b)] = {"seconds": seconds, "tokens": [list(r.outputs[0].token_ids) for r in res]}
json.dump(out, open(sys.argv[2], "w"))
"""


def run_vllm(
    python: Path,
    checkpoint: Path,
    prompts: list[list[int]],
    batches: list[int],
    new_tokens: int,
    trials: int,
    memory_utilization: float,
) -> dict[str, Any]:
    """vLLM's timings (seconds per trial) and greedy tokens per batch size."""
    tmp = Path(tempfile.mkdtemp(prefix="tandem-vllm-engine-"))
    job = {
        "checkpoint": str(checkpoint),
        "prompts": prompts,
        "batches": batches,
        "new_tokens": new_tokens,
        "trials": trials,
        "memory_utilization": memory_utilization,
    }
    (tmp / "job.json").write_text(json.dumps(job))
    subprocess.run(
        [str(python), "-c", VLLM_JOB, str(tmp / "job.json"), str(tmp / "out.json")],
        env=vllm_env({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
        cwd=tmp,  # not this repo: its packages would shadow vLLM's imports
        check=True,
    )
    out: dict[str, Any] = json.loads((tmp / "out.json").read_text())
    return out


def run_tandem(
    folder: Path,
    draft: DraftSpec,
    prompts: list[list[int]],
    batches: list[int],
    new_tokens: int,
    trials: int,
) -> dict[str, Any]:
    """The engine's timings and greedy tokens per batch size (one engine across trials)."""
    need = max(batches) * (max(len(p) for p in prompts) + new_tokens) // 16 + max(batches) + 64
    engine = DecodeEngine(
        DecodeEngineConfig(
            "m", ModelSpec(str(folder), "float32"), draft, num_blocks=need, max_batch_size=64
        )
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens)  # no stop: ignore EOS

    def batch(ps: list[list[int]]) -> tuple[float, list[list[int]]]:
        reqs = [Request(uuid.uuid4().hex, p, sampling) for p in ps]
        t0 = time.perf_counter()
        for r in reqs:
            engine.add(r, None)
        while engine.has_work:
            engine.step()
        return time.perf_counter() - t0, [list(r.output_token_ids) for r in reqs]

    try:
        batch(prompts[:1])  # warm-up
        out: dict[str, Any] = {}
        for b in batches:
            runs = [batch(prompts[:b]) for _ in range(trials)]
            out[str(b)] = {"seconds": [s for s, _ in runs], "tokens": runs[-1][1]}
    finally:
        engine.close()
    return out


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Prompts whose tokens are identical, and the mean length of the common prefix."""
    prefix = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), len(x))
        prefix.append(n)
    return {
        "identical": sum(x == y for x, y in zip(a, b, strict=True)),
        "prompts": len(a),
        "mean_common_prefix": statistics.mean(prefix),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--trials", type=int, default=1, help="trials per engine per round")
    ap.add_argument("--rounds", type=int, default=3, help="turns each engine takes")
    ap.add_argument("--threads", type=int, default=2, help="tandem's torch threads")
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    ap.add_argument("--vllm-memory-utilization", type=float, default=0.3)
    ap.add_argument("--out", type=Path, default=RESULTS / "vllm_engine.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_checkpoint("embedded")
    tok = Tokenizer(folder)
    prompts = chat_prompts(tok, first_prompts(max(args.batches)))
    common = (prompts, args.batches, args.new_tokens, args.trials)
    served = drafts()
    results: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):  # the engines take turns: each round adds trials to each
        turn = {"vllm": run_vllm(args.vllm_python, folder, *common, args.vllm_memory_utilization)}
        for name in ("none", "eagle+lookup"):
            turn[name] = run_tandem(folder, served[name], *common)
        for name, res in turn.items():
            for b, r in res.items():
                kept = results.setdefault(name, {}).setdefault(b, {"seconds": []})
                kept["seconds"] += r["seconds"]
                kept["tokens"] = r["tokens"]
    report: dict[str, Any] = {
        "benchmark": "vllm_engine",
        "vllm": "vllm-cpu " + vllm_version(args.vllm_python),
        "model": "embedded SmolLM2-135M, float32",
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "prompt_tokens": {str(b): sum(len(p) for p in prompts[:b]) for b in args.batches},
        "trials": args.trials,
        "rounds": args.rounds,
        "tok_s": {},
        "over_vllm": {},
        "agreement_with_vllm": {},
    }
    for b in map(str, args.batches):
        tokens = int(b) * args.new_tokens
        tok_s = {k: tokens / statistics.median(r[b]["seconds"]) for k, r in results.items()}
        report["tok_s"][b] = tok_s
        report["over_vllm"][b] = {k: v / tok_s["vllm"] for k, v in tok_s.items() if k != "vllm"}
        report["agreement_with_vllm"][b] = _agreement(
            results["none"][b]["tokens"], results["vllm"][b]["tokens"]
        )
        print(f"batch {b}: tok/s {tok_s}, over vLLM {report['over_vllm'][b]}", flush=True)
    report["seconds"] = {k: {b: r[b]["seconds"] for b in r} for k, r in results.items()}
    write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

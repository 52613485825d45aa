"""The engine's step costs on this machine, each against a baseline taken in the same run.

1. Batch-1 greedy decode: the engine (speculation off) vs transformers ``generate`` on the same
   weights and dtype (fp32, bf16): tokens/s and their ratio; and the step's time against
   reading the bytes of weights it streams once (the memory wall), alternated in the same run.
2. Decode throughput at batch 1..32 (speculation off): tokens/s per batch size, ratio to batch 1.
3. Verification cost: one target forward over k + 1 tokens per sequence, k = 0..8, at batch 1
   and 8, relative to k = 0 (the curve adaptive speculation uses).
4. Ragged steps: one forward carrying 32 decodes and a prompt chunk (or 16 one-token decodes
   and 16 k = 4 verifications) against the two parts run as separate forwards, and 32 decodes
   over contexts of 100-900 tokens against 32 at their mean context: attention groups
   sequences by new-token count and context length, so raggedness should cost nothing extra.
5. Memory: KV pool bytes and the process's peak RSS.

    .venv/bin/python -m bench.engine_step [--dtypes float32 bfloat16] [--tokens 64]
        [--verify-only | --mixed-only] [--baselines plain onednn]
        [--out bench/results/engine_step.json]

Writes ``--out`` (default ``bench/results/engine_step.json``, which the simulator's CPU profile
reads) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.kv_layout import new_kv_pool
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftSpec, ModelSpec
from models.weights import resolve_checkpoint
from runtime.backends import model_backend, row_ops_for
from runtime.runner import LocalRunner, SeqInput

RESULTS = Path(__file__).parent / "results"
PROMPT_LEN = 128


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def engine_tokens_per_s(engine: DecodeEngine, batch: int, tokens: int) -> float:
    """Decode tokens/s at a fixed batch: prompts are computed first and not timed."""
    reqs = [
        Request(uuid.uuid4().hex, p, SamplingParams(temperature=0.0, max_tokens=tokens + 1))
        for p in _prompts(batch, seed=batch)
    ]
    for r in reqs:
        engine.add(r, None)
    while any(not r.output_token_ids for r in reqs):  # prompts and first tokens
        engine.step()
    t0 = time.perf_counter()
    start = sum(len(r.output_token_ids) for r in reqs)
    while engine.has_work:
        engine.step()
    dt = time.perf_counter() - t0
    return (sum(len(r.output_token_ids) for r in reqs) - start) / dt


def streamed_bytes(spec: ModelSpec) -> int:
    """Bytes of weights a batch-1 decode step must read once: every matmul weight and the LM
    head (the embedding lookup reads one row; an untied table is not streamed)."""
    model = spec.load()
    skip = set() if model.cfg.tie_word_embeddings else {"embed_tokens.weight"}
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in skip)


def stream_ms(buffer: torch.Tensor, rounds: int = 5) -> float:
    """The fastest of ``rounds`` reads of ``buffer`` (a sum over it, on the benchmark's
    threads): the memory wall a batch-1 step of that many weight bytes stands against,
    measured in the same run as the step. The fastest, since a wall is what the machine can
    do, and a shared machine's reads vary from one moment to the next."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def _hf_model(folder: Path, dtype: torch.dtype) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def hf_tokens_per_s(hf: Any, tokens: int) -> float:
    """transformers' greedy ``generate`` on the same kind of prompt, prefill time excluded."""
    ids = torch.tensor(_prompts(1, seed=1))
    kw: dict[str, Any] = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    hf.generate(ids, max_new_tokens=4, **kw)
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, **kw)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=tokens + 1, **kw)
    return tokens / (time.perf_counter() - t0 - t_prefill)


def _runtime_model(spec: ModelSpec, blocks: int) -> LocalRunner:
    """The target as a worker runs it (``runtime.shard``: its row ops, and on a CPU the CPU
    backend, weights packed for the panel kernel), over a pool of ``blocks``."""
    model = spec.load(ops=row_ops_for("cpu"))
    c = model.cfg
    pool = new_kv_pool(blocks, c.num_kv_heads, c.num_layers, 16, c.head_dim, model.dtype)
    return LocalRunner(model, pool, 16, model_backend(model, pool, 16))


def verify_curve(spec: ModelSpec, batch: int, ks: range, rounds: int = 9) -> dict[int, float]:
    """Median ms of one target forward with k + 1 new tokens per sequence (context 200); the
    ks are interleaved round by round, so a burst of load from another process lands on one
    sample of many ks, not on every sample of one k."""
    runner = _runtime_model(spec, batch * 16)
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(batch)]
    runner.run([SeqInput(t, 0, list(range(200)), [199]) for t in tables])
    cases = {
        str(k): [SeqInput(t, 200, list(range(k + 1)), list(range(k + 1))) for t in tables]
        for k in ks
    }
    return {int(k): v for k, v in _median_ms(cases, runner, rounds).items()}


def _median_ms(
    cases: dict[str, list[SeqInput]], runner: LocalRunner, rounds: int
) -> dict[str, float]:
    """Median ms of one forward per case, the cases interleaved round by round."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, batch in cases.items():
            t0 = time.perf_counter()
            runner.run(batch)
            times[name].append(time.perf_counter() - t0)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def mixed_cost(spec: ModelSpec, rounds: int = 7) -> dict[str, dict[str, float]]:
    """Mixed forwards against baselines in the same run (median ms, interleaved):

    - 32 decodes + a 128-token prompt chunk, and 16 decodes + 16 verifications of k = 4 (context
      200), each against its two parts run as separate forwards;
    - 32 decodes over contexts spread from 100 to 900 tokens against 32 decodes all at their
      mean context (the KV is not filled: timing does not depend on its values).
    """
    runner = _runtime_model(spec, 33 * 64)
    tables = [list(range(i * 64, i * 64 + 64)) for i in range(33)]

    def dec(t: list[int], width: int, ctx: int = 200) -> SeqInput:
        return SeqInput(t, ctx, list(range(width)), list(range(width)))

    chunk = SeqInput(tables[32], 0, list(range(PROMPT_LEN)), [PROMPT_LEN - 1])
    decodes = [dec(t, 1) for t in tables[:32]]
    half, verifies = decodes[:16], [dec(t, 5) for t in tables[16:32]]
    spread = [100 + 800 * i // 31 for i in range(32)]
    mean_ctx = round(statistics.mean(spread))
    ms = _median_ms(
        {
            "decodes": decodes,
            "prompt": [chunk],
            "decodes+prompt": [*decodes, chunk],
            "half": half,
            "verifies": verifies,
            "decodes+verifies": half + verifies,
            "spread": [dec(t, 1, n) for t, n in zip(tables, spread, strict=False)],
            "mean": [dec(t, 1, mean_ctx) for t in tables[:32]],
        },
        runner,
        rounds,
    )
    out = {
        "decodes+prompt": {"ms": ms["decodes+prompt"], "baseline_ms": ms["decodes"] + ms["prompt"]},
        "decodes+verifies": {
            "ms": ms["decodes+verifies"],
            "baseline_ms": ms["half"] + ms["verifies"],
        },
        "contexts 100-900": {"ms": ms["spread"], "baseline_ms": ms["mean"]},
    }
    for name, r in out.items():
        r["ratio"] = r["ms"] / r["baseline_ms"]
        print(
            f"{spec.dtype} {name}: {r['ms']:.1f} ms vs baseline {r['baseline_ms']:.1f} ms",
            flush=True,
        )
    return out


def verify_only(report: dict[str, Any], dtypes: list[str], folder: Path) -> None:
    """Re-measure just the verification curves into an existing report."""
    for dt in dtypes:
        curves = {b: verify_curve(ModelSpec(str(folder), dt), b, range(0, 9)) for b in (1, 8)}
        r = report["dtypes"].setdefault(dt, {})
        r["verify_ms"] = curves
        r["verify_ratio"] = {b: {k: v / c[0] for k, v in c.items()} for b, c in curves.items()}
        print(f"{dt}: verify cost ratio {json.dumps(r['verify_ratio'])}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3, help="alternating batch-1 trials per side")
    ap.add_argument(
        "--verify-only", action="store_true", help="re-measure the verify curves into the JSON"
    )
    ap.add_argument("--mixed-only", action="store_true", help="re-measure mixed steps into it")
    ap.add_argument(
        "--baselines",
        nargs="*",
        choices=("plain", "onednn"),
        default=[],
        help="also time batch 1, alternating, with plain F.linear weights and/or with the "
        "oneDNN row-invariant reordering instead of the panel kernel",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_step.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_checkpoint("embedded")
    if args.verify_only or args.mixed_only:
        path = RESULTS / "engine_step.json"
        previous: dict[str, Any] = json.loads(path.read_text())
        if args.verify_only:
            verify_only(previous, args.dtypes, folder)
        if args.mixed_only:
            for dt in args.dtypes:
                mixed = mixed_cost(ModelSpec(str(folder), dt))
                previous["dtypes"].setdefault(dt, {})["mixed"] = mixed
        path.write_text(json.dumps(previous, indent=2))
        _plot(previous, RESULTS / "engine_step.png")
        return
    report: dict[str, Any] = {"benchmark": "engine_step", "threads": args.threads, "dtypes": {}}
    for dt in args.dtypes:
        spec = ModelSpec(str(folder), dt)
        engine = DecodeEngine(DecodeEngineConfig("m", spec, DraftSpec(), num_blocks=1024))
        r: dict[str, Any] = {"kv_pool_bytes": engine.pool.nbytes}
        # Alternate the two, three times each, and compare medians: this machine is noisy.
        hf = _hf_model(folder, spec.load().dtype)
        baselines = {k: _baseline_engine(spec, k) for k in args.baselines}
        nbytes = streamed_bytes(spec)
        wall = torch.ones(nbytes // 4)  # float32: the weights' bytes, to stream
        ours_runs, theirs_runs, stream_runs = [], [], []
        base_runs: dict[str, list[float]] = {k: [] for k in baselines}
        for _ in range(args.trials):
            ours_runs.append(engine_tokens_per_s(engine, 1, args.tokens))
            theirs_runs.append(hf_tokens_per_s(hf, args.tokens))
            stream_runs.append(stream_ms(wall))
            for k, base in baselines.items():
                base_runs[k].append(engine_tokens_per_s(base, 1, args.tokens))
        ours, theirs = statistics.median(ours_runs), statistics.median(theirs_runs)
        r["batch1"] = {
            "engine_tok_s": ours,
            "transformers_tok_s": theirs,
            "ratio": ours / theirs,
            "engine_runs": ours_runs,
            "transformers_runs": theirs_runs,
            "streamed_bytes": nbytes,
            "stream_ms": min(stream_runs),
            "stream_runs_ms": stream_runs,
            "step_ms": 1000 / ours,
            "step_over_stream": 1000 / ours / min(stream_runs),
        }
        del wall
        for k, base in baselines.items():
            r["batch1"][f"{k}_tok_s"] = statistics.median(base_runs[k])
            r["batch1"][f"{k}_runs"] = base_runs[k]
            r["batch1"][f"ratio_to_{k}"] = ours / statistics.median(base_runs[k])
            print(f"{dt}: batch-1 with {k} matmuls {statistics.median(base_runs[k]):.1f} tok/s")
            base.close()
        print(
            f"{dt}: batch-1 engine {ours:.1f} tok/s, transformers {theirs:.1f}, "
            f"ratio {ours / theirs:.2f}; step {1000 / ours:.1f} ms, "
            f"{r['batch1']['step_over_stream']:.2f}x the {nbytes / 1e6:.0f} MB weight stream "
            f"({r['batch1']['stream_ms']:.1f} ms)",
            flush=True,
        )
        thr = {b: engine_tokens_per_s(engine, b, args.tokens) for b in args.batches}
        r["throughput_tok_s"] = thr
        r["throughput_ratio_to_batch1"] = {b: v / thr[args.batches[0]] for b, v in thr.items()}
        print(
            f"{dt}: throughput {json.dumps({b: round(v, 1) for b, v in thr.items()})}", flush=True
        )
        curves = {b: verify_curve(spec, b, range(0, 9)) for b in (1, 8)}
        r["verify_ms"] = curves
        r["verify_ratio"] = {b: {k: v / c[0] for k, v in c.items()} for b, c in curves.items()}
        print(f"{dt}: verify cost ratio {json.dumps(r['verify_ratio'])}", flush=True)
        r["mixed"] = mixed_cost(spec)
        report["dtypes"][dt] = r
        del engine
    report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    _plot(report, args.out.with_suffix(".png"))


def _baseline_engine(spec: ModelSpec, kind: str) -> DecodeEngine:
    """The same engine with its weights left for plain ``F.linear`` (``plain``: the model's own
    modules and row ops around the same attention backend, no CPU backend), or reordered for
    oneDNN in row-invariant chunks (``onednn``, ``models.cpu.onednn``), instead of packed for
    the panel kernel the runtime uses on a CPU (``models.cpu.linear``)."""
    import runtime.shard
    from models.cpu.linear import CpuLinear
    from models.layers import RowOps

    patches: list[tuple[Any, str, Any]] = (
        [  # the worker builds its target with these (``runtime.shard.target_runner``)
            (runtime.shard, "row_ops_for", lambda device: RowOps()),
            (runtime.shard, "model_backend", partial(model_backend, serve_cpu=False)),
        ]
        if kind == "plain"
        else [(CpuLinear, "ready", lambda self: False)]
    )
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        return DecodeEngine(DecodeEngineConfig("m", spec, DraftSpec(), num_blocks=1024))
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for dt, r in report["dtypes"].items():
        bs = list(r["throughput_tok_s"])
        a.plot(bs, [r["throughput_tok_s"][x] for x in bs], marker="o", label=dt)
        for batch, curve in r["verify_ratio"].items():
            ks = list(curve)
            b.plot(ks, [curve[k] for k in ks], marker="o", label=f"{dt}, batch {batch}")
    a.set(xscale="log", xlabel="batch size", ylabel="decode tokens/s", title="throughput")
    b.set(
        xlabel="k (tokens verified = k + 1)",
        ylabel="step time / one-token step",
        title="verify cost",
    )
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

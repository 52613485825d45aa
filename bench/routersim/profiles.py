"""Step-time profiles the router simulator runs on: this machine's CPU, and an H200 on paper.

Both are ``speculation.goodput.StepTimeModel``s (seconds per decode step as a function of the tokens
the target scores), the model the engine's adaptive speculation and the router also use.

**cpu** — measured: ``bench/results/engine_step.json`` (``bench/engine_step.py``), the engine's
own forward over ``k + 1`` tokens per sequence at batch 1 and 8 (2 threads, float32, embedded
SmolLM2-135M). Shapes with the same token count are averaged and the curve made monotone (a
running maximum; the engine's ``speculation.step_time`` uses an isotonic fit); a point above 1.5x
both neighbours is dropped as noise (batch 8, k = 7: 329 ms between 158 and 187). Prefill:
42 ms + 2.2 ms per prompt token (FACTS.md: transformers' forward, 1 token 42 ms, 32 tokens 109 ms).

**h200** — a 70B target (Llama-3-70B shapes) with an 8B draft (Llama-3-8B shapes), both bf16 at
TP = 4 on H200s, from first principles. Measured on this workplace's lent H200 (FACTS.md): HBM
traffic 4.3 TB/s (device-to-device copy, bytes read + written), 790 TFLOP/s (8192^3 bf16 matmul).
Assumed: see ``H200`` below. A step scoring ``t`` tokens takes

    overhead + max(target weights + KV read, target FLOPs) / GPU + target all-reduces
    + t * (draft cost per scored token)

with two all-reduces per layer (latency + bytes over NVLink, ring: 2 (TP-1)/TP of the message
per GPU). KV reads belong to sequences, not tokens: the tokens-only model charges them per
scored token at an assumed mean context and verification width. The draft proposes in
``max k`` sequential rounds per step (as ``decode.drafters.draft_model`` does); each round
streams the draft's weights and pays its all-reduce latencies (``draft_round_s``, 1.45 ms),
a per-step cost outside the tokens-only model; its per-token FLOPs, KV reads and all-reduce
bytes are charged per scored token. Prefill: FLOPs of target and draft at 790 TFLOP/s per
prompt token (at an assumed 87% of the matmul rate), plus a fixed cost.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from speculation.step_time import StepTimeModel

RESULTS = Path(__file__).resolve().parent.parent / "results"


@dataclass(frozen=True)
class Profile:
    """A replica type: its decode step time, prefill cost, limits, and default SLOs."""

    name: str
    step_time: StepTimeModel
    prefill_base_s: float  # per prompt (batched prefill amortises the weights)
    prefill_per_token_s: float
    transfer_per_token_s: float  # KV shipped prefill -> decode, per prompt token
    transfer_base_s: float
    max_batch: int  # sequences per decode step
    max_batched_tokens: int  # tokens per decode step
    kv_tokens: int  # KV capacity of one decode replica, in tokens
    k_max: int
    draft_round_s: float  # fixed cost of one draft-model round (a step runs max k of them)
    tick_s: float  # simulator time resolution (a fraction of one step)
    ttft_slo_s: float
    tpot_slo_s: float
    length_scale: float  # workload prompt and output lengths are multiplied by this


def _monotone(points: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    out, best = [], 0.0
    for n, t in points:
        best = max(best, t)
        out.append((n, best))
    return tuple(out)


def cpu_points(report: dict[str, object]) -> tuple[tuple[int, float], ...]:
    """Step-time points from ``engine_step.json`` (float32 verify curves at batch 1 and 8)."""
    dtypes = report["dtypes"]
    assert isinstance(dtypes, dict)
    curves = dtypes["float32"]["verify_ms"]
    by_tokens: dict[int, list[float]] = {}
    for batch, curve in curves.items():
        for k, ms in curve.items():
            by_tokens.setdefault(int(batch) * (int(k) + 1), []).append(float(ms) / 1000)
    pts = sorted((n, sum(v) / len(v)) for n, v in by_tokens.items())
    kept = [
        p
        for i, p in enumerate(pts)
        if not (0 < i < len(pts) - 1 and p[1] > 1.5 * max(pts[i - 1][1], pts[i + 1][1]))
    ]
    return _monotone(kept)


def cpu_profile(path: Path = RESULTS / "engine_step.json") -> Profile:
    return Profile(
        name="cpu",
        step_time=StepTimeModel(cpu_points(json.loads(path.read_text()))),
        prefill_base_s=0.042,
        prefill_per_token_s=0.0022,
        transfer_per_token_s=20e-6,  # NIXL over UCX on one machine (~1 GB/s, 24 KB per token)
        transfer_base_s=0.005,
        max_batch=32,
        max_batched_tokens=2048,
        kv_tokens=1024 * 16,
        k_max=4,
        draft_round_s=0.0,  # n-gram drafting: no model forward per round
        tick_s=0.005,
        ttft_slo_s=3.0,
        tpot_slo_s=0.100,
        length_scale=0.125,
    )


@dataclass(frozen=True)
class Arch:
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


LLAMA3_70B = Arch(params=70.6e9, layers=80, hidden=8192, kv_heads=8, head_dim=128)
LLAMA3_8B = Arch(params=8.03e9, layers=32, hidden=4096, kv_heads=8, head_dim=128)


@dataclass(frozen=True)
class H200:
    """Rates per GPU. ``hbm`` and ``flops`` measured (FACTS.md); the rest assumed."""

    hbm_bytes_s: float = 4.3e12  # measured: D2D copy, bytes read + written
    flops: float = 790e12  # measured: 8192^3 bf16 matmul
    nvlink_bus_bytes_s: float = 360e9  # assumed: all-reduce bus bandwidth (NVLink 4: 900 GB/s bidi)
    allreduce_latency_s: float = 8e-6  # assumed: one small NCCL all-reduce, 4 GPUs, CUDA graphs
    step_overhead_s: float = 0.5e-3  # assumed: scheduling, sampling, rejection, launch gaps
    mean_context: int = 1024  # assumed: tokens each sequence's attention reads
    mean_width: float = 2.0  # assumed: tokens scored per sequence per step (1 + mean k)
    tp: int = 4
    hbm_gb: float = 141.0  # datasheet
    kv_fraction: float = 0.85  # assumed: share of memory left after weights that holds KV


def h200_step_seconds(
    t: int, g: H200 = H200(), target: Arch = LLAMA3_70B, draft: Arch = LLAMA3_8B
) -> float:
    """Seconds of a decode step scoring ``t`` tokens (see the module docstring)."""
    bytes_w = 2 * target.params / g.tp
    kv_read = t / g.mean_width * g.mean_context * target.kv_bytes_per_token() / g.tp
    memory = (bytes_w + kv_read) / g.hbm_bytes_s
    compute = t * 2 * target.params / g.tp / g.flops
    ring = 2 * (g.tp - 1) / g.tp

    def allreduces(arch: Arch, tokens: float) -> float:
        per = g.allreduce_latency_s + tokens * arch.hidden * 2 * ring / g.nvlink_bus_bytes_s
        return 2 * arch.layers * per

    draft_kv = g.mean_context * draft.kv_bytes_per_token() / g.tp / g.hbm_bytes_s / g.mean_width
    draft_token = (
        2 * draft.params / g.tp / g.flops + draft_kv + allreduces(draft, 1) - allreduces(draft, 0)
    )
    total: float = (
        g.step_overhead_s + max(memory, compute) + allreduces(target, t) + t * draft_token
    )
    return total


def h200_draft_round_seconds(g: H200 = H200(), draft: Arch = LLAMA3_8B) -> float:
    """One draft round's fixed cost: the draft's weights streamed, its all-reduce latencies."""
    return 2 * draft.params / g.tp / g.hbm_bytes_s + 2 * draft.layers * g.allreduce_latency_s


def h200_profile(g: H200 = H200()) -> Profile:
    tokens = sorted({1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 512, 768, 1024, 2048, 4096})
    weights = 2 * (LLAMA3_70B.params + LLAMA3_8B.params) / g.tp
    free = (g.hbm_gb * 1e9 - weights) * g.kv_fraction
    per_token = (LLAMA3_70B.kv_bytes_per_token() + LLAMA3_8B.kv_bytes_per_token()) / g.tp
    prefill_token = 2 * (LLAMA3_70B.params + LLAMA3_8B.params) / g.tp / g.flops
    return Profile(
        name="h200",
        step_time=StepTimeModel(tuple((t, h200_step_seconds(t, g)) for t in tokens)),
        prefill_base_s=0.002,
        prefill_per_token_s=prefill_token * 1.15,  # assumed 87% of matmul peak over a prompt
        transfer_per_token_s=LLAMA3_70B.kv_bytes_per_token() / (4 * 50e9),  # 4 x 400 Gb/s NICs
        transfer_base_s=0.001,
        max_batch=256,
        max_batched_tokens=4096,
        kv_tokens=int(free / per_token),
        k_max=4,
        draft_round_s=h200_draft_round_seconds(g),
        tick_s=0.002,
        ttft_slo_s=2.0,
        tpot_slo_s=0.020,  # 50 tokens/s per user: an interactive target
        length_scale=1.0,
    )


PROFILES: dict[str, Callable[[], Profile]] = {"cpu": cpu_profile, "h200": h200_profile}

"""Speculation judged at equal interactivity: output throughput at fixed TPOT targets across
concurrency, for speculation off, each fixed draft length k, and adaptive speculation, as the
published comparisons report it (throughput at a fixed tokens/s per user). A mode's value at a
concurrency and target is its throughput where its mean TPOT meets the target, else 0 (it
cannot serve that many users at that interactivity). The goal: adaptive at least the better of
off and the best fixed k at every concurrency and target (no cliff as load crosses a threshold).

- ``sim``: the router simulator's GPU profile (``--profile h200``: a 70B target, an 8B draft,
  TP = 4; ``bench/routersim/profiles.py``), concurrency 1-256, the default request mix in
  proportion; a batch's step and each stream's tokens a step from the goodput model
  (``speculation.goodput``); adaptive is ``choose_ks`` with the target as its TPOT guard, as
  an engine with ``decode.speculation_tpot_slo_s`` set to it runs. Computed, not measured.
- ``cpu``: this machine, the embedded SmolLM2-135M with n-gram lookup in the decode engine
  in-process, a closed loop of ``c`` clients on ShareGPT prompts for ``c`` in 1-64; adaptive
  is the engine's default (no TPOT guard); measured. Beside them the shipped EAGLE head,
  adaptive, with and without per-position draft stopping (``draft.early_stop``,
  ``speculation/draft_stop.py``): its throughput ratio at each concurrency shows whether the
  stopping rule has a cliff.

    .venv/bin/python -m bench.interactivity --parts sim cpu

Writes ``bench/results/interactivity.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.routersim.capacity import mean_lengths
from bench.routersim.profiles import PROFILES, Profile
from bench.routersim.workload import DEFAULT_MIX
from speculation.goodput import DraftBatch, StepCosts, TpotGuard, choose_ks, expected_tokens

RESULTS = Path(__file__).parent / "results"
SIM_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)
SIM_TARGETS_MS = (12.0, 16.0, 20.0, 30.0)
CPU_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
CPU_TARGETS_MS = (50.0, 100.0, 200.0)


def _batch(n: int, p: Profile) -> list[float]:
    """Acceptance of ``n`` streams of the default mix, each class by its share of the streams
    a replica holds (arrival share times output length)."""
    out, _ = mean_lengths(p, DEFAULT_MIX)  # [classes]
    weight = np.array([c.share for c in DEFAULT_MIX]) * out
    exact = weight / weight.sum() * n
    members = np.floor(exact).astype(int)
    members[np.argsort(members - exact)[: n - int(members.sum())]] += 1
    return [c.alpha for c, m in zip(DEFAULT_MIX, members.tolist(), strict=True) for _ in range(m)]


def _point(p: Profile, alphas: list[float], ks: list[int]) -> dict[str, float]:
    step = p.step_time.predict(sum(1 + k for k in ks)) + p.draft_round_s * max(ks)
    emitted = [expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True)]
    return {
        "tok_s": sum(emitted) / step,
        "tpot_ms": 1e3 * statistics.mean(step / e for e in emitted),
        "mean_k": statistics.mean(ks),
    }


def simulated(profile: str) -> dict[str, Any]:
    p = PROFILES[profile]()
    modes: dict[str, dict[str, Any]] = {}
    for n in SIM_CONCURRENCY:
        alphas = _batch(n, p)
        fixed = {f"k={k}": _point(p, alphas, [k] * n) for k in range(p.k_max + 1)}
        for name, pt in fixed.items():
            modes.setdefault("off" if name == "k=0" else name, {})[str(n)] = pt
        for t in SIM_TARGETS_MS:
            ks = choose_ks(
                DraftBatch(alphas, p.k_max),
                StepCosts(p.step_time, round_s=p.draft_round_s),
                TpotGuard(t / 1e3),
            )
            modes.setdefault(f"adaptive@{t:g}", {})[str(n)] = _point(p, alphas, ks)
    return {"profile": profile, "targets_ms": list(SIM_TARGETS_MS), "modes": modes}


def at_targets(part: dict[str, Any]) -> dict[str, Any]:
    """Per target and concurrency: each mode's throughput where it meets the target (0 where
    not), and whether adaptive is at least the better of off and the best fixed k."""
    out: dict[str, Any] = {}
    modes = part["modes"]
    fixed = [m for m in modes if not m.startswith("adaptive")]
    for t in part["targets_ms"]:
        adaptive = f"adaptive@{t:g}" if f"adaptive@{t:g}" in modes else "adaptive"
        rows = {}
        for n in modes["off"]:
            value = {
                m: modes[m][n]["tok_s"] if modes[m][n]["tpot_ms"] <= t else 0.0
                for m in [*fixed, adaptive]
            }
            best_fixed = max(value[m] for m in fixed)
            rows[n] = value | {
                "best_fixed": best_fixed,
                "adaptive_over_best": value[adaptive] / best_fixed if best_fixed else None,
                "no_cliff": value[adaptive] >= best_fixed * 0.98,  # within measurement noise
            }
        out[f"{t:g}"] = rows
    return out


def measured(concurrency: Sequence[int], max_tokens: int) -> dict[str, Any]:
    from bench.sharegpt import chat_prompts, first_prompts
    from decode.config import DecodeEngineConfig
    from decode.engine import DecodeEngine
    from models.embedded import embedded_eagle_path
    from models.request import Request
    from models.sampling import SamplingParams
    from models.spec import DraftKind, DraftSpec, ModelSpec
    from models.tokenizer import Tokenizer
    from models.weights import resolve_checkpoint

    folder = resolve_checkpoint("embedded")
    target = ModelSpec(str(folder))
    texts = first_prompts(2 * max(concurrency), max_chars=500, skip=500)
    prompts = chat_prompts(Tokenizer(folder), texts)
    drafts = {
        "off": DraftSpec(),
        "k=2": DraftSpec(DraftKind.NGRAM, num_speculative_tokens=2, adaptive=False),
        "k=4": DraftSpec(DraftKind.NGRAM, num_speculative_tokens=4, adaptive=False),
        "adaptive": DraftSpec(DraftKind.NGRAM, num_speculative_tokens=4, adaptive=True),
    }
    head = ModelSpec(str(embedded_eagle_path()))
    eagle = {
        "eagle": DraftSpec(DraftKind.EAGLE, head, 4),
        "eagle+stop": DraftSpec(DraftKind.EAGLE, head, 4, early_stop=True),
    }
    engines = {
        m: DecodeEngine(DecodeEngineConfig("m", target, d, num_blocks=1024, max_batch_size=64))
        for m, d in (drafts | eagle).items()
    }
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for engine in engines.values():  # untimed: first-run allocations and step-time refits
        _closed_loop(engine, [Request(uuid.uuid4().hex, p, warm) for p in prompts[-4:]], 2)
    modes: dict[str, dict[str, Any]] = {m: {} for m in drafts}
    modes_eagle: dict[str, dict[str, Any]] = {m: {} for m in eagle}
    for n in concurrency:
        for m, engine in engines.items():  # the same prompts, each mode in turn
            reqs = [Request(uuid.uuid4().hex, p, sp) for p in prompts[: 2 * n]]
            into = modes if m in modes else modes_eagle
            into[m][str(n)] = _closed_loop(engine, reqs, n)
            print(f"cpu c={n} {m}: {json.dumps(into[m][str(n)])}", flush=True)
    stopped = {m: d.positions_stopped for m in eagle if (d := engines[m].drafter) is not None}
    for engine in engines.values():
        engine.close()
    ratio = {
        n: modes_eagle["eagle+stop"][n]["tok_s"] / modes_eagle["eagle"][n]["tok_s"]
        for n in modes_eagle["eagle"]
    }
    return {
        "targets_ms": list(CPU_TARGETS_MS),
        "max_tokens": max_tokens,
        "modes": modes,
        "eagle": {"modes": modes_eagle, "stop_over_plain": ratio, "positions_stopped": stopped},
    }


def _closed_loop(engine: Any, reqs: list[Any], clients: int) -> dict[str, float]:
    """``clients`` in flight, the next admitted as one finishes; output tokens/s over the run
    and the mean TPOT (first token to last over the tokens between) of the requests."""
    queue, first, last = reqs[::-1], {}, {}
    live: list[Any] = []
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < clients:
            live.append(queue.pop())
            engine.add(live[-1], None)
        engine.step()
        now = time.perf_counter()
        for r in live:
            if r.output_token_ids and r.request_id not in first:
                first[r.request_id] = now
            if r.is_finished:
                last[r.request_id] = now
        live = [r for r in live if not r.is_finished]
    span = time.perf_counter() - t0
    tpots = [
        (last[r.request_id] - first[r.request_id]) / (len(r.output_token_ids) - 1)
        for r in reqs
        if len(r.output_token_ids) > 1
    ]
    return {
        "tok_s": sum(len(r.output_token_ids) for r in reqs) / span,
        "tpot_ms": 1e3 * statistics.mean(tpots),
    }


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [k for k in ("sim", "cpu") if k in report]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        for mode, points in report[part]["modes"].items():
            xs = sorted(points, key=int)
            style = "-o" if mode.startswith("adaptive") else "--"
            ax.plot(
                [points[n]["tpot_ms"] for n in xs], [points[n]["tok_s"] for n in xs], style,
                label=mode, markersize=3,
            )  # fmt: skip
        ax.set_xlabel("mean TPOT (ms), concurrency rising along each line")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{part}: throughput against interactivity")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--parts", nargs="+", choices=("sim", "cpu"), default=["sim", "cpu"])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="h200")
    ap.add_argument("--concurrency", type=int, nargs="+", default=list(CPU_CONCURRENCY))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=RESULTS / "interactivity.json")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"benchmark": "interactivity"}
    if "sim" in args.parts:
        report["sim"] = simulated(args.profile)
        report["sim"]["at_targets"] = at_targets(report["sim"])
    if "cpu" in args.parts:
        report["cpu"] = measured(args.concurrency, args.max_tokens)
        report["cpu"]["at_targets"] = at_targets(report["cpu"])
    for part in ("sim", "cpu"):
        if part in report:
            cliffs = [
                (t, n) for t, rows in report[part]["at_targets"].items()
                for n, row in rows.items() if not row["no_cliff"]
            ]  # fmt: skip
            report[part]["cliffs"] = cliffs
            print(f"{part}: adaptive below the best fixed mode at {cliffs or 'no point'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(report, args.out.with_suffix(".png"))
    out: Path = args.out
    return out


if __name__ == "__main__":
    main()

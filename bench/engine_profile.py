"""Where a decode engine step's time goes: torch.profiler and cProfile over decode steps.

Builds a random Llama of the given shape (or loads the embedded model), fills the engine with
``--batch`` requests, skips the prompt steps and profiles ``--steps`` decode steps. Reports the
top operators by self CPU time and by device time, and the Python functions with the most own
time.

    python -m bench.engine_profile --device cuda --shape 1b --batch 16
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_check import _tiny
from runtime.runner import synchronize

SHAPES = {"tiny": (2, 128, 4, 2, 4096), "1b": (16, 2048, 32, 8, 32000)}


def _python_profile(engine: Any, steps: int, device: str) -> dict[str, float]:
    """cProfile over ``steps`` engine steps: the 15 functions with the most own time."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        engine.step()
    synchronize(device)
    pr.disable()
    stats: dict[Any, Any] = getattr(pstats.Stats(pr), "stats")  # noqa: B009 (untyped attribute)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:15]
    return {f"{Path(k[0]).name}:{k[1]}({k[2]})": v[2] * 1000 / steps for k, v in rows}


def main() -> None:
    from decode.config import DecodeEngineConfig
    from decode.engine import DecodeEngine
    from models.request import Request
    from models.sampling import SamplingParams
    from models.spec import DraftSpec, ModelSpec

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", choices=[*sorted(SHAPES), "embedded"], default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("bench/results/engine_profile.json"))
    args = ap.parse_args()
    if args.shape == "embedded":
        from models.weights import resolve_checkpoint

        folder = resolve_checkpoint("embedded")
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    else:
        layers, hidden, heads, kv, vocab = SHAPES[args.shape]
        folder = _tiny(Path(tempfile.mkdtemp()) / "m", 3, layers, hidden, heads, kv, vocab)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    engine = DecodeEngine(
        DecodeEngineConfig(
            "m", ModelSpec(str(folder), dtype), DraftSpec(), device=args.device, num_blocks=1024
        )
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(args.batch):
        prompt = torch.randint(3, vocab, (128,), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=args.steps * 3 + 20)
        engine.add(Request(uuid.uuid4().hex, prompt, params), None)
    for _ in range(args.steps):  # prompts, then warm decode steps
        engine.step()
    synchronize(args.device)
    activities = [ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        synchronize(args.device)
    wall_ms = 1000 * (time.perf_counter() - t0) / args.steps
    events = prof.key_averages()
    top_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    report: dict[str, Any] = {
        "device": args.device,
        "shape": args.shape,
        "batch": args.batch,
        "step_ms_profiled": wall_ms,
        "top_self_cpu_ms_per_step": {
            e.key: e.self_cpu_time_total / 1000 / args.steps for e in top_cpu
        },
        "calls_per_step": {e.key: e.count / args.steps for e in top_cpu},
    }
    if args.device.startswith("cuda"):
        top_dev = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:15]
        report["top_device_ms_per_step"] = {
            e.key: e.self_device_time_total / 1000 / args.steps for e in top_dev
        }
        report["device_busy_ms_per_step"] = (
            sum(e.self_device_time_total for e in events) / 1000 / args.steps
        )
    report["top_python_tottime_ms_per_step"] = _python_profile(engine, args.steps, args.device)
    engine.close()
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

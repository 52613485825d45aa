"""Where the draft model goes in a TP decode group: what rank-0-only co-hosting costs.

With the draft on rank 0 only, the other ranks idle while it proposes; a replicated draft would
run the same sequential proposals on every rank (no time saved: every rank needs all k tokens
before the verify step) and hold the draft's weights and KV on every rank. So the two numbers
that decide it are the draft's share of a decode step (the idle time rank-0-only costs) and the
memory replication would add per extra rank. Measured at TP = 1 and TP = 2 on a random
target/draft pair (8-layer target of hidden 512, 2-layer draft of hidden 128, vocab 32k), batch
4, greedy, k = 3.

    .venv/bin/python -m bench.tp_draft

Writes bench/results/tp_draft.json.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import ray
import torch

from bench.gpu_check import _tiny
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec

RESULTS = Path(__file__).parent / "results"


def _measure(engine: DecodeEngine, prompts: list[list[int]], new: int) -> dict[str, float]:
    drafter = engine.drafter
    assert drafter is not None
    spent = {"propose_s": 0.0}
    propose = drafter.propose

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return propose(*args, **kwargs)
        finally:
            spent["propose_s"] += time.perf_counter() - t0

    drafter.propose = timed  # type: ignore[method-assign]
    for p in prompts:
        params = SamplingParams(temperature=0, max_tokens=new)
        engine.add(Request(uuid.uuid4().hex, p, params), None)
    engine.step()  # the prompts
    spent["propose_s"] = 0.0
    t0, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    total = time.perf_counter() - t0
    return {
        "steps": steps,
        "step_ms": 1000 * total / steps,
        "propose_ms_per_step": 1000 * spent["propose_s"] / steps,
        "draft_share_of_step": spent["propose_s"] / total,
    }


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    target = _tiny(tmp / "t", 1, 8, 512, 8, 4, 32000)
    draft = _tiny(tmp / "d", 2, 2, 128, 4, 2, 32000)
    spec = DraftSpec(DraftKind.DRAFT_MODEL, model=ModelSpec(str(draft)), num_speculative_tokens=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (64,), generator=g).tolist() for _ in range(4)]
    report: dict[str, Any] = {"benchmark": "tp_draft", "batch": 4, "k": 3}
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        for tp in (1, 2):
            cfg = DecodeEngineConfig(
                "t", ModelSpec(str(target)), spec, tp_size=tp, num_blocks=128, num_threads=1
            )
            engine = DecodeEngine(cfg)
            _measure(engine, prompts, 8)  # warm-up
            report[f"tp{tp}"] = _measure(engine, prompts, 64)
            pool = engine.pool
            report[f"tp{tp}"]["rank0_target_kv_bytes"] = pool.tensor("target").nbytes
            report[f"tp{tp}"]["draft_kv_bytes"] = pool.tensor("draft").nbytes
            print(tp, json.dumps(report[f"tp{tp}"]), flush=True)
            engine.close()
    finally:
        ray.shutdown()
    nbytes = sum(p.numel() * p.element_size() for p in ModelSpec(str(draft)).load().parameters())
    tbytes = sum(p.numel() * p.element_size() for p in ModelSpec(str(target)).load().parameters())
    report["draft_weight_bytes"] = nbytes
    report["target_weight_bytes_per_rank_tp2"] = tbytes // 2
    report["replication_adds_per_extra_rank_bytes"] = nbytes + report["tp2"]["draft_kv_bytes"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tp_draft.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

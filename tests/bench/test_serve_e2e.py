"""bench/serve.py end to end: its main coroutine against a real colocated app (embedded model)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import ray

from bench import serve as bench_serve
from cluster.config import TandemConfig
from tests.cluster.conftest import running_app

CFG = TandemConfig.model_validate(
    {
        "mode": "colocated",
        "draft": {"kind": "ngram", "num_speculative_tokens": 4},
        "decode": {"num_blocks": 256, "num_threads": 2},
        "limits": {"max_model_len": 2048},
    }
)


@pytest.mark.ray
@pytest.mark.slow
def test_serve_benchmark_writes_a_report_of_real_requests(
    embedded_folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "serve-e2e.json"
    argv = [
        "--dataset", "synthetic",
        "--input-len", "24",
        "--copy-fraction", "0.5",
        "--num-requests", "4",
        "--concurrency", "2",
        "--max-tokens", "8",
        "--max-seconds", "120",
        "--out", str(out),
    ]  # fmt: skip
    with running_app(CFG) as url:
        port = str(ray.nodes()[0]["MetricsExportPort"])
        written = asyncio.run(
            bench_serve.main([*argv, "--base-url", f"{url}/v1", "--metrics-port", port])
        )
    assert written == out
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert (s["num_sent"], s["completed"], s["failed"], s["cancelled"]) == (4, 4, 0, 0)
    assert s["ttft"]["count"] == 4 and s["ttft"]["mean"] > 0 and s["ttft"]["p99"] > 0
    assert s["e2e"]["mean"] >= s["ttft"]["mean"]
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    assert doc["model"] == "SmolLM2-135M-Instruct"  # resolved from GET /v1/models
    reqs = doc["requests"]
    assert sorted(r["index"] for r in reqs) == [0, 1, 2, 3]
    assert all(r["outcome"] == "ok" and 1 <= r["output_tokens"] <= 8 for r in reqs)
    assert s["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)
    assert s["acceptance_rate"] is None or 0.0 <= s["acceptance_rate"] <= 1.0
    assert out.with_suffix(".png").stat().st_size > 10_000
    router = doc["router"]  # the decode router's view: the 4 requests and the warm-up, greedy
    assert router["estimates"]["greedy"]["count"] == 5 and "sampled" not in router["estimates"]
    assert 0.0 <= router["estimates"]["greedy"]["mean"] <= 1.0
    assert sum(router["decisions"].get(b, 0) for b in ("stats", "partial", "fallback")) >= 5
    assert router["decision_mean_s"] > 0 and router["decision_cpu_mean_s"] > 0
    assert 0 < router["decision_p50_at_most_s"] <= router["decision_p99_at_most_s"]


def test_set_overrides_parse_as_yaml_and_reject_a_bare_key() -> None:
    sets = [
        "decode.speculation_tpot_slo_s=0.09",
        "decode.routing=slo_aware",
        "draft.adaptive=false",
    ]
    got = bench_serve.parse_sets(sets)
    assert got == {
        "decode.speculation_tpot_slo_s": 0.09,
        "decode.routing": "slo_aware",
        "draft.adaptive": False,
    }
    cfg = CFG.with_overrides(**bench_serve.parse_sets(sets[:1]))
    assert cfg.decode.speculation_tpot_slo_s == 0.09
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        bench_serve.parse_sets(["decode.routing"])

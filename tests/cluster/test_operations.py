"""What an operator runs against: two ingress replicas in front of a disaggregated app, its
replicas logging JSON with one request id across ingress, prefill and decode, and the Grafana
dashboard in deploy/ whose every query names metrics (and labels) the running app exports."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import TandemConfig
from cluster.routing.observe import RouterMetrics
from kvtransfer.metrics import KVMetrics
from tests.cluster.conftest import running_app
from tests.helpers import wait_until

pytestmark = pytest.mark.ray

DASHBOARD = Path(__file__).parents[2] / "deploy/kuberay/monitoring/tandem-dashboard.json"


@pytest.fixture(scope="module")
def app(tiny_folder: Path) -> Iterator[str]:
    cfg = TandemConfig.model_validate(
        {
            "mode": "disaggregated",
            "model": {"source": str(tiny_folder), "name": "tiny"},
            "draft": {"kind": "ngram"},
            "prefill": {"num_blocks": 128, "num_threads": 1},
            "decode": {"num_blocks": 256, "num_threads": 1},
            "ingress": {"replicas": 2},
            "logging": {"encoding": "JSON", "requests": True},
        }
    )
    with running_app(cfg) as url:
        yield url


def _complete(base: str, prompt: list[int], max_tokens: int = 24, **headers: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)


def test_two_ingress_replicas_both_serve_and_agree(app: str) -> None:
    """Serve's proxy spreads calls over both ingress replicas (each says which it is in
    /health); streams through either give the same greedy text as one at a time."""
    seen = set()
    for _ in range(60):
        seen.add(httpx.get(f"{app}/health", timeout=30).json()["ingress_replica"])
        if len(seen) == 2:
            break
    assert len(seen) == 2, seen
    prompts = [[(11 * i + j) % 500 + 20 for j in range(12)] for i in range(8)]
    alone = [_complete(app, p).json()["choices"][0]["text"] for p in prompts]

    async def together() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)

        async def one(p: list[int]) -> str:
            stream = await client.completions.create(
                model="tiny", prompt=p, max_tokens=24, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream])

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    assert asyncio.run(together()) == alone


def _serve_log_lines(request_id: str) -> dict[str, list[dict[str, object]]]:
    """The JSON lines of every Serve replica log that carry ``request_id``, by deployment."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    found: dict[str, list[dict[str, object]]] = {}
    for path in logs.glob("replica_tandem_*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if request_id not in line:
                continue
            record = json.loads(line)  # JSON encoding: every line is an object
            if record.get("request_id") == request_id:
                # Serve names deployments "<app>_<deployment>"
                name = str(record["deployment"]).removeprefix("tandem_")
                found.setdefault(name, []).append(record)
    return found


def test_one_request_id_from_the_client_through_every_deployment(app: str) -> None:
    """The client's X-Request-Id comes back in the response and names the request's JSON log
    lines in the ingress, prefill and decode replicas; without one, Serve makes one up and
    returns it."""
    rid = f"trace-{uuid.uuid4().hex}"
    r = _complete(app, [5, 6, 7, 8, 9], **{"X-Request-Id": rid})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == rid

    def logged() -> dict[str, list[dict[str, object]]]:
        found = _serve_log_lines(rid)
        assert {"ingress", "prefill", "decode"} <= set(found), sorted(found)
        return found

    # Serve writes access lines as each call ends
    found = wait_until(logged, 30, "the request's lines in every deployment's log", interval_s=0.5)
    for records in found.values():
        assert all(rec["replica"] and rec["levelname"] for rec in records)
    made = _complete(app, [5, 6, 7]).headers.get("x-request-id")
    assert made and made != rid


def test_tandem_log_lines_carry_the_request_id(app: str) -> None:
    """tandem's own lines (logging.requests: one as a generation starts, one as it ends) go
    through the replica's Serve handlers: JSON, stamped with the request id."""
    rid = f"trace-{uuid.uuid4().hex}"
    assert _complete(app, [9, 8, 7, 6], max_tokens=5, **{"X-Request-Id": rid}).status_code == 200

    def logged() -> list[str]:
        records = _serve_log_lines(rid).get("ingress", [])
        mine = [str(r["message"]) for r in records if str(r["message"]).startswith("request ")]
        assert len(mine) == 2, mine
        return mine

    mine = wait_until(logged, 30, "tandem's two lines for the request", interval_s=0.5)
    assert "4 prompt tokens, max_tokens 5" in mine[0]
    assert "finished (length): 5 tokens" in mine[1]


# Counters that only move when something fails: a healthy run never exports them, so they
# are checked against the metrics tandem declares instead of a scrape.
ON_FAILURE_ONLY = (
    "ray_tandem_kv_failures_total",
    "ray_tandem_kv_recomputed_total",
    "ray_tandem_router_stats_rejected_total",
)


def _queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def _scrape(port: int) -> dict[str, set[str]]:
    """Every sample name on Ray's metrics port, with the label names it carries."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


@pytest.mark.timeout(300)
def test_every_dashboard_query_names_exported_metrics_and_labels(app: str) -> None:
    queries = _queries()
    assert len(queries) >= 20
    wanted = {m for q in queries for m in re.findall(r"ray_tandem_\w+", q)}
    for i in range(3):  # traffic that moves every healthy-path metric
        assert _complete(app, [7, 8, 9, 7, 8, 9, 7, 8] * (i + 1), max_tokens=32).status_code == 200
    port = int(ray.nodes()[0]["MetricsExportPort"])

    def exported() -> dict[str, set[str]]:
        got = _scrape(port)
        missing = sorted(wanted - set(got) - set(ON_FAILURE_ONLY))
        assert not missing, missing
        return got

    # Ray exports every few seconds
    got = wait_until(exported, 120, "every healthy-path metric exported", interval_s=1)
    kv, router = KVMetrics("decode"), RouterMetrics("decode", "p")
    declared = (kv._failures, kv._recomputed, router._rejected)
    assert [f"ray_{m._name}_total" for m in declared] == list(ON_FAILURE_ONLY)
    assert set(ON_FAILURE_ONLY) <= wanted
    for name, m in zip(ON_FAILURE_ONLY, declared, strict=True):  # the labels they will carry
        got.setdefault(name, set()).update(m._tag_keys)
    for q in queries:
        names = [m for m in re.findall(r"ray_tandem_\w+", q) if m in got]
        labels = {
            lab.strip()
            for group in re.findall(r"by \(([^)]*)\)", q)
            for lab in group.split(",")
            if lab.strip() != "le"
        }
        for label in labels:  # each grouping label is on the query's metrics
            assert any(label in got[n] for n in names), (q, label)

"""``GET /metrics`` on the API port under vLLM's names (``vllm:...``, labelled ``model_name``), so
tools written for vLLM (AIPerf, ``vllm bench serve``, Grafana dashboards, Dynamo's planner) find
them where they look. Translated from tandem's own series as this node's Ray exporter holds them:
on a cluster of several nodes, scrape every node's exporter for ``ray_tandem_*`` instead."""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)

# tandem's name (without Ray's prefix and without _total) -> vLLM's
NAMES = {
    "tandem_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "tandem_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "tandem_request_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "tandem_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "tandem_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "tandem_prompt_tokens": "vllm:prompt_tokens",
    "tandem_generation_tokens": "vllm:generation_tokens",
    "tandem_request_success": "vllm:request_success",
    "tandem_num_requests_running": "vllm:num_requests_running",
    "tandem_num_requests_waiting": "vllm:num_requests_waiting",
    "tandem_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "tandem_spec_drafts": "vllm:spec_decode_num_drafts",
    "tandem_spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "tandem_spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "tandem_spec_accepted_tokens_by_position": "vllm:spec_decode_num_accepted_tokens_per_pos",
}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def translate(exposition: str) -> str:
    """Prometheus text of Ray's exporter -> the vLLM-named series in it, as Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    lines: list[str] = []
    for family in text_string_to_metric_families(exposition):
        base = family.name.removeprefix("ray_").removesuffix("_total")
        target = NAMES.get(base)
        if target is None:
            continue
        kind = family.type if family.type in ("counter", "gauge", "histogram") else "untyped"
        lines.append(f"# HELP {target} {family.documentation or target}")
        lines.append(f"# TYPE {target} {kind}")
        lines += _samples(family.samples, family.name, target, kind)
    return "\n".join(lines) + "\n"


def _samples(samples: Iterable[object], source: str, target: str, kind: str) -> list[str]:
    out = []
    for s in samples:
        name, labels, value = s.name, dict(s.labels), s.value  # type: ignore[attr-defined]
        suffix = name[len(source) :] if name.startswith(source) else ""
        if suffix == "_created":
            continue
        if kind == "counter" and suffix in ("", "_total"):
            suffix = "_total"
        if target.endswith("_per_pos") and "position" in labels:
            labels["position"] = str(int(labels["position"]) - 1)  # vLLM counts from 0
        body = ",".join(f'{k}="{_label(v)}"' for k, v in sorted(labels.items()))
        out.append(f"{target}{suffix}{{{body}}} {value}")
    return out


async def scrape_local_exporter(timeout_s: float = 5.0) -> str:
    """This node's Ray metrics exporter, as Prometheus text ("" where there is none)."""
    import httpx
    import ray

    node = ray.get_runtime_context().get_node_id()
    entry = next((n for n in ray.nodes() if n.get("NodeID") == node), None)
    if entry is None or not entry.get("MetricsExportPort"):
        return ""
    url = f"http://{entry['NodeManagerAddress']}:{entry['MetricsExportPort']}/metrics"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            r = await client.get(url)
            return r.text if r.status_code == 200 else ""
    except httpx.HTTPError as e:
        log.warning("scraping the node's Ray metrics exporter at %s failed: %s", url, e)
        return ""

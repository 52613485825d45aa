"""Colocated mode with a draft model (tiny random target and draft) and a TP=2 decode replica
(one Serve placement group of two bundles), over real HTTP; and the standard serving metrics
it exports, scraped from Ray's metrics port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import TandemConfig
from tests.cluster.conftest import running_app
from tests.helpers import wait_until

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def app(tiny_folder: Path, tiny_draft_folder: Path) -> Iterator[str]:
    cfg = TandemConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"source": str(tiny_folder), "name": "tiny"},
            "draft": {
                "kind": "draft_model",
                "source": str(tiny_draft_folder),
                "num_speculative_tokens": 3,
                "adaptive": False,  # k stays 3: this module checks what is reported, not the
            },  # planner (which may rightly stop drafting for a random draft)
            "decode": {"num_blocks": 128, "num_threads": 1, "tp": 2},
        }
    )
    with running_app(cfg) as url:
        yield url


STANDARD = (
    "ray_tandem_time_to_first_token_seconds_count",
    "ray_tandem_inter_token_latency_seconds_count",
    "ray_tandem_request_time_per_output_token_seconds_count",
    "ray_tandem_e2e_request_latency_seconds_count",
    "ray_tandem_request_queue_time_seconds_count",
    "ray_tandem_prompt_tokens_total",
    "ray_tandem_generation_tokens_total",
    "ray_tandem_request_success_total",
    "ray_tandem_num_requests_running",
    "ray_tandem_num_requests_waiting",
    "ray_tandem_kv_cache_usage_perc",
)


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


@pytest.mark.timeout(300)
def test_the_standard_serving_metrics_are_exported(app: str) -> None:
    """vLLM's metric names (``tandem_`` prefixed, ``ray_`` on Ray's port), tagged by pool and
    replica: after three requests of known length, each is there and the counts add up (the
    module's first test: nothing was counted before it)."""
    port = int(ray.nodes()[0]["MetricsExportPort"])
    before: dict[str, list[tuple[dict[str, str], float]]] = {}

    def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
        return sum(v for _, v in samples.get(name, []))

    for _ in range(3):
        r = httpx.post(
            f"{app}/v1/completions",
            json={"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    want_generation = total(before, "ray_tandem_generation_tokens_total") + 18

    def exported() -> dict[str, list[tuple[dict[str, str], float]]]:
        got = _scrape(port)
        missing = [n for n in STANDARD if n not in got]
        assert not missing, missing
        assert total(got, "ray_tandem_generation_tokens_total") >= want_generation
        return got

    # Ray exports every few seconds
    got = wait_until(exported, 120, "the three requests' metrics exported", interval_s=1)
    assert total(got, "ray_tandem_generation_tokens_total") == want_generation
    prompt = total(got, "ray_tandem_prompt_tokens_total") - total(
        before, "ray_tandem_prompt_tokens_total"
    )
    assert prompt == 12
    ttft = "ray_tandem_time_to_first_token_seconds_count"
    assert total(got, ttft) - total(before, ttft) == 3
    success = [
        (labels, v)
        for labels, v in got["ray_tandem_request_success_total"]
        if labels.get("finished_reason") == "length"
    ]
    assert success and all(lab["deployment"] == "ingress" and lab["replica"] for lab, _ in success)
    for labels, value in got["ray_tandem_kv_cache_usage_perc"]:
        assert labels["deployment"] == "decode" and 0.0 <= value <= 1.0
    assert all(v == 0 for _, v in got["ray_tandem_num_requests_running"])  # all finished


def test_colocated_draft_model_serves_and_reports_speculation(app: str) -> None:
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(
        model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=12, temperature=0
    )
    assert r.usage is not None and r.usage.completion_tokens >= 1
    body = httpx.post(
        f"{app}/v1/completions",
        json={"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "temperature": 0},
        timeout=60,
    ).json()
    assert body["choices"][0]["text"] == r.choices[0].text  # greedy is deterministic
    assert body["usage"]["completion_tokens"] == 12  # a random model does not stop early here
    spec = body["usage"]["speculative"]
    assert spec["draft_tokens"] > 0 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    health = httpx.get(f"{app}/health", timeout=30).json()
    assert health["mode"] == "colocated" and "prefill" not in health
    assert health["decode"]["transfer"]["pulls_started"] == 0  # nothing to transfer
    chunks = list(
        client.completions.create(model="tiny", prompt="hello", max_tokens=5, stream=True)
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_prompt_and_max_tokens_beyond_the_pool_get_a_400_and_the_server_serves_on(
    app: str,
) -> None:
    """The pool holds 128 blocks of 16 tokens, well under the model's context length: a prompt
    that fits with a max_tokens that never can is refused up front, naming the pool's capacity
    and the setting that sizes it (it used to be admitted and never answered); exactly what
    fits is served."""
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)
    prompt = [5 + i % 50 for i in range(1500)]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1000, temperature=0)
    msg = e.value.message
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    assert "2047" in msg and "decode.num_blocks" in msg and "at most 547 fit" in msg
    long = [5 + i % 50 for i in range(2040)]
    with pytest.raises(openai.BadRequestError, match="at most 7 fit"):
        client.completions.create(model="tiny", prompt=long, max_tokens=8, temperature=0)
    r = client.completions.create(model="tiny", prompt=long, max_tokens=7, temperature=0)
    assert r.usage is not None and 1 <= r.usage.completion_tokens <= 7
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens == 4

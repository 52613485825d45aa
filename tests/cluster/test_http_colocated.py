"""Colocated mode with a draft model (tiny random target and draft) and a TP=2 decode replica
(one Serve placement group of two bundles), over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cluster.config import TandemConfig
from tests.cluster.conftest import running_app


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
            },
            "decode": {"num_blocks": 128, "num_threads": 1, "tp": 2},
        }
    )
    with running_app(cfg) as url:
        yield url


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

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
                "adaptive": False,  # k stays 3: this module checks what is reported, not the
            },  # planner (which may rightly stop drafting for a random draft)
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

"""``limits.request_timeout_s`` over real HTTP: a generation that outlives it ends with a 504
naming the setting (streamed: an error event), its decode KV is freed at once, and the replica
goes on serving the next request as before."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cluster.config import TandemConfig
from tests.cluster.conftest import running_app
from tests.helpers import wait_until

pytestmark = pytest.mark.ray

TIMEOUT_S = 3.0
BLOCKS = 128
# ignore_eos: 1,500 tokens of a 135M model take well past TIMEOUT_S on any CPU (15-45 ms each)
LONG = {"prompt": "Once upon a time", "max_tokens": 1500, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def app(embedded_folder: Path) -> Iterator[str]:
    cfg = TandemConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"source": str(embedded_folder), "name": "m"},
            "ingress": {"replicas": 1},
            "decode": {"num_blocks": BLOCKS, "num_threads": 1},
            "limits": {"request_timeout_s": TIMEOUT_S},
        }
    )
    with running_app(cfg) as url:
        yield url


def _decode_idle(base: str) -> bool:
    d = httpx.get(f"{base}/health", timeout=10).json()["decode"]
    return bool(d["free_blocks"] == BLOCKS and d["running"] == 0 and d["waiting"] == 0)


def test_a_request_past_the_timeout_gets_504_and_leaves_nothing_held(app: str) -> None:
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0, timeout=60)
    short = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    before = client.completions.create(model="m", **short).choices[0].text  # type: ignore[call-overload]

    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="m", temperature=0, **LONG)  # type: ignore[call-overload]
    took = time.monotonic() - t0
    assert e.value.status_code == 504, e.value
    assert "limits.request_timeout_s" in str(e.value)
    assert TIMEOUT_S <= took < TIMEOUT_S + 5, took
    wait_until(lambda: _decode_idle(app), 10, "the timed-out request's KV freed")

    t0 = time.monotonic()
    stream = client.completions.create(model="m", temperature=0, stream=True, **LONG)  # type: ignore[call-overload]
    chunks = 0
    with pytest.raises(openai.APIError, match=r"limits\.request_timeout_s"):
        for _ in stream:
            chunks += 1
    assert chunks > 0  # it streamed tokens before its time ran out
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    wait_until(lambda: _decode_idle(app), 10, "the timed-out stream's KV freed")

    after = client.completions.create(model="m", **short).choices[0].text  # type: ignore[call-overload]
    assert after == before

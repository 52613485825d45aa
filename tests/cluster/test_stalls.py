"""A request that cannot make progress beside the others, over real HTTP: in a colocated pool
of 24 blocks it is preempted before its first token, ends with a clear error naming the pool
and the setting, and everything else is served as if it had never come. Plain decoding with
``decode.overlap`` on (a GPU's default): steps are planned beside the one in the air, except
where planning would preempt."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cluster.config import TandemConfig
from tests.cluster.conftest import running_app

pytestmark = pytest.mark.ray

BLOCKS = 24  # of 16 tokens: 384 slots

# A: 20 prompt tokens and 300 outputs, 321 slots: it fits alone and grows into 21 blocks.
LONG = [5 + i % 40 for i in range(20)]
# B: 200 prompt tokens (13 blocks at admission), computed one token a step beside A's decode
# (max_num_batched_tokens 2). B is admitted while A holds at most 11 blocks, and A needs its
# 12th block at most 156 steps later: before B's prompt is done, so B, the newest, is
# preempted without a token.
WIDE = [7 + i % 30 for i in range(200)]
SHORT = [9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def app(tiny_folder: Path) -> Iterator[str]:
    cfg = TandemConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"source": str(tiny_folder), "name": "tiny"},
            "ingress": {"replicas": 1},
            "draft": {"kind": "none"},
            "decode": {
                "overlap": "on",
                "num_blocks": BLOCKS,
                "num_threads": 1,
                "max_num_batched_tokens": 2,
                "max_stalled_preemptions": 1,
            },
        }
    )
    with running_app(cfg) as url:
        yield url


def _complete(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> str:
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return r.choices[0].text


@pytest.mark.timeout(300)
def test_a_request_that_cannot_progress_gets_an_error_and_the_rest_are_served(app: str) -> None:
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0, timeout=120)
    long_alone = _complete(client, LONG, 300)
    short_alone = _complete(client, SHORT, 4)

    streamed: list[str] = []
    started = threading.Event()

    def stream_long() -> None:
        for chunk in client.completions.create(
            model="tiny",
            prompt=LONG,
            max_tokens=300,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            streamed.append(chunk.choices[0].text if chunk.choices else "")
            started.set()

    t = threading.Thread(target=stream_long)
    t.start()
    assert started.wait(60)
    with pytest.raises(openai.APIStatusError) as e:
        _complete(client, WIDE, 8)
    assert e.value.status_code == 503
    msg = str(e.value.message)
    assert "1 time in a row without producing a token" in msg
    assert "decode.max_stalled_preemptions" in msg and f"{BLOCKS} blocks" in msg
    # the queue moves on: a request sent after the error is served, unchanged
    assert _complete(client, SHORT, 4) == short_alone
    t.join(120)
    assert not t.is_alive() and "".join(streamed) == long_alone

    decode = httpx.get(f"{app}/health", timeout=30).json()["decode"]
    assert decode["stalled"] == 1 and decode["preemptions"] >= 1
    assert decode["free_blocks"] == BLOCKS
    assert decode["overlap"] is True and decode["steps_overlapped"] > 300

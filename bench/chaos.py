"""Mixed hostile traffic for leak checks: good requests streamed and not, bad inputs, streams the
client abandons after a few chunks, and requests the client cancels by timing out.

``mixed_traffic`` drives it against a running server for a bounded time; ``bench.leak_soak``
and ``tests/cluster/test_leak_soak.py`` check afterwards that every KV block came back.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import httpx

KINDS = ("stream", "whole", "bad_json", "bad_field", "too_long", "abandon", "cancel")


async def _stream(client: httpx.AsyncClient, body: dict[str, object], keep: int | None) -> str:
    async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        if r.status_code != 200:
            return str(r.status_code)
        n = 0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                n += 1
                if '"error"' in line:
                    return "stream_error"
                if keep is not None and n >= keep:
                    return "abandoned"  # leaving the block closes the connection mid-stream
    return "ok"


Call = Callable[[httpx.AsyncClient], Awaitable[str | httpx.Response]]


def _requests(model: str, prompt: list[int], max_tokens: int) -> dict[str, Call]:
    base = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7}
    return {
        "stream": lambda c: _stream(c, base, None),
        "abandon": lambda c: _stream(c, base | {"max_tokens": max_tokens * 4}, 3),
        "whole": lambda c: c.post("/v1/completions", json=base),
        "bad_json": lambda c: c.post(
            "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"}
        ),
        "bad_field": lambda c: c.post("/v1/completions", json=base | {"temperature": -3}),
        "too_long": lambda c: c.post("/v1/completions", json=base | {"prompt": prompt * 4000}),
        "cancel": lambda c: asyncio.wait_for(
            c.post("/v1/completions", json=base | {"max_tokens": max_tokens * 4}), 0.3
        ),
    }


async def mixed_traffic(
    base_url: str,
    seconds: float,
    concurrency: int,
    model: str,
    seed: int = 0,
    max_tokens: int = 24,
    headers: dict[str, str] | None = None,
) -> Counter[str]:
    """Send a random mix of :data:`KINDS` from ``concurrency`` clients for ``seconds``; returns
    outcome counts per ``kind:outcome`` (an HTTP status, ``ok``, ``abandoned``, ``cancelled``)."""
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    end = time.monotonic() + seconds

    async def client_loop(i: int) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120, headers=headers) as c:
            while time.monotonic() < end:
                kind = rng.choice(KINDS)
                prompt = [rng.randrange(10, 5000) for _ in range(rng.randrange(4, 40))]
                call = _requests(model, prompt, max_tokens)[kind]
                try:
                    res = await call(c)
                    outcome = res if isinstance(res, str) else str(res.status_code)
                except TimeoutError:
                    outcome = "cancelled"
                outcomes[f"{kind}:{outcome}"] += 1

    await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
    return outcomes

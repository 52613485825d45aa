"""A prefill replica dies under load: nothing hangs, in-flight work fails over per policy, the app
replaces the replica and decode reads from the new agent (never the stale one)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from cluster.config import TandemConfig
from tests.cluster.conftest import running_app
from tests.helpers import wait_until, wait_until_async

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def app(tiny_folder: Path) -> Iterator[str]:
    cfg = TandemConfig.model_validate(
        {
            "mode": "disaggregated",
            "model": {"source": str(tiny_folder), "name": "tiny"},
            "draft": {"kind": "ngram"},
            "prefill": {"num_blocks": 128, "num_threads": 1},
            "decode": {"num_blocks": 256, "num_threads": 1, "max_batch_size": 2},
            "kv": {"failure_policy": "recompute", "pull_timeout_s": 3},
        }
    )
    with running_app(cfg) as url:
        yield url


def _health(base: str) -> dict[str, Any]:
    r = httpx.get(f"{base}/health", timeout=30)
    body: dict[str, Any] = r.json()
    return body


def _serves(base: str) -> bool:
    """Whether a short request succeeds."""
    r = httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": [9, 8, 7, 6] * 5, "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    return r.status_code == 200


async def _request(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
    """A 400-token prompt (five fill the prefill pool, so the rest queue on the replica): the
    status and the text."""
    body = {"model": "tiny", "prompt": [5 + i, 6, 7, 8] * 100, "max_tokens": 30, "temperature": 0}
    r = await client.post("/v1/completions", json=body, timeout=150)
    if r.status_code == 200:
        assert r.json()["usage"]["completion_tokens"] >= 1
        return 200, str(r.json()["choices"][0]["text"])
    assert r.status_code == 503 and "error" in r.json()  # a clean, explained failure
    return r.status_code, ""


def _kill_replica(pool: str) -> str:
    """Kill one replica actor of ``pool`` (not the pool's deployment-scoped health board)."""
    names = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and pool in a["name"]
    ]
    assert names, f"no {pool} replica actor found"
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
    return str(names[0]["name"])


def test_killing_the_prefill_replica_mid_load(app: str) -> None:
    async def load() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=app) as client:
            tasks = [asyncio.create_task(_request(client, i)) for i in range(16)]

            async def holding() -> bool:  # prompts waiting or mid-prefill on the replica
                r = await client.get("/health", timeout=30)
                return int(r.json()["prefill"]["queued"]) >= 1

            await wait_until_async(holding, 60, "the prefill replica to hold prompts")
            await asyncio.get_running_loop().run_in_executor(None, _kill_replica, "prefill")
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)  # nothing hangs

    answers = asyncio.run(load())
    # Prompts the dead replica held (queued, or mid-prefill) were sent again (limits.retries)
    # and served by its replacement; handoffs it had shipped but decode had not pulled were
    # recomputed on decode: every request is answered, with the text of an undisturbed run.
    assert [status for status, _ in answers] == [200] * 16
    assert _health(app)["retries"]["prefill"] >= 1

    async def again() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=app) as client:
            return list(await asyncio.gather(*(_request(client, i) for i in range(16))))

    assert asyncio.run(again()) == answers  # greedy: no wrong output anywhere
    # The replica comes back (Serve replaces it) and serves; decode reads from its new agent.
    wait_until(lambda: _serves(app), 90, "the app to serve again", interval_s=1)
    h = _health(app)
    assert h["decode"]["running"] == 0
    assert h["decode"]["free_blocks"] == 256  # nothing leaked on decode
    assert h["prefill"]["free_blocks"] == 128 and h["prefill"]["active_leases"] == 0

    def one_prefill_replica() -> dict[str, Any]:
        h = _health(app)
        assert len(h["pools"]["prefill"]["replicas"]) == 1, h["pools"]["prefill"]
        return h

    # /health shows every replica: the dead prefill replica drops out of its pool's board, and
    # the handoffs it failed are counted on decode, the pool degraded past kv.degraded_fraction
    h = wait_until(one_prefill_replica, 30, "the dead replica off the prefill board", interval_s=1)
    # board entries are what each replica published up to a second ago: compared with each
    # other and with the pool's summary of them, not with the live stats above
    (prefill,) = h["pools"]["prefill"]["replicas"].values()
    assert prefill["transport"] == "nixl" and prefill["node_id"]
    (decode,) = h["pools"]["decode"]["replicas"].values()
    pool = h["pools"]["decode"]
    assert decode["kv_recomputed"] == pool["kv_recomputed"]
    failed = decode["kv_recent_failed"] / decode["kv_recent_handoffs"]
    assert pool["kv_failed_fraction"] == pytest.approx(failed)
    assert (h["status"] == "degraded") == (failed > 0.2)
    assert decode["kv_recent_failed"] >= decode["kv_recomputed"]  # a recompute: a failed pull


def _stream_events(base: str, i: int, started: asyncio.Event) -> Any:
    async def run() -> list[dict[str, Any]]:
        body = {
            "model": "tiny",
            "prompt": [20 + i, 21, 22, 23] * 4,
            "max_tokens": 1500,
            "temperature": 0,
            "stream": True,
        }
        events: list[dict[str, Any]] = []
        async with (
            httpx.AsyncClient(base_url=base, timeout=120) as client,
            client.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) >= 3:
                    started.set()
        return events

    return run()


def _text(events: list[dict[str, Any]]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if "choices" in e)


def test_killing_the_decode_replica_mid_stream(app: str) -> None:
    """Two streams decode (the replica's batch holds two), a third waits behind them; the
    replica dies. The two end with a clear error event; the third, which had streamed only
    prefill's first token, is sent again (limits.retries) and finishes on the replacement
    with the tokens it would have had."""

    async def load() -> list[list[dict[str, Any]]]:
        started = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(_stream_events(app, i, started[i])) for i in range(3)]
        await wait_until_async(
            lambda: sum(s.is_set() for s in started) >= 2, 60, "two streams decoding"
        )

        async def all_three_on_the_replica() -> bool:  # two decoding, the third queued
            async with httpx.AsyncClient(base_url=app) as client:
                d = (await client.get("/health", timeout=30)).json()["decode"]
            return int(d["running"] + d["waiting"] + d["pulling"]) == 3

        await wait_until_async(all_three_on_the_replica, 60, "the third stream queued on decode")
        await asyncio.get_running_loop().run_in_executor(None, _kill_replica, "decode")
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=150)  # nothing hangs

    streams = asyncio.run(load())
    cut = [events for events in streams if "error" in events[-1]]
    for events in cut:  # a clear error event, then [DONE]
        last = events[-1]
        assert "decode" in last["error"]["message"] and last["error"]["type"] == "server_error"
    assert len(cut) == 2, "the two decoding streams did not see the replica die"
    (retried,) = [(i, e) for i, e in enumerate(streams) if "error" not in e[-1]]
    assert retried[1][-1]["choices"][0]["finish_reason"] == "length"
    assert _health(app)["retries"]["decode"] >= 1
    again = asyncio.run(_stream_events(app, retried[0], asyncio.Event()))
    assert _text(retried[1]) == _text(again)  # greedy: the same tokens as a request never cut
    wait_until(lambda: _serves(app), 90, "the app to serve again", interval_s=1)

    def prefill_whole() -> dict[str, Any]:
        h = _health(app)
        assert h["prefill"]["free_blocks"] == 128 and h["prefill"]["active_leases"] == 0, h
        return h

    # Leases of handoffs the dead replica never pulled expire; every prefill block comes back.
    h = wait_until(prefill_whole, 60, "every prefill block back", interval_s=1)
    assert h["decode"]["free_blocks"] == 256 and h["decode"]["running"] == 0

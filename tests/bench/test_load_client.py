"""The load scheduler: concurrency bound, Poisson spacing, time limit, failures as records."""

from __future__ import annotations

import asyncio
import time

import httpx

from bench.load_client import (
    Arrivals,
    SendOne,
    Target,
    request_body,
    run_load,
    send_streamed,
)
from bench.load_metrics import Outcome, RequestRecord
from bench.workloads import WorkItem, poisson_offsets

ITEMS = [WorkItem("synthetic", f"prompt {i}", 4) for i in range(8)]


def _sleeper(seconds: float, in_flight: list[int], peak: list[int]) -> SendOne:
    async def send_one(index: int, item: WorkItem, run_start: float) -> RequestRecord:
        start = time.perf_counter() - run_start
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        try:
            await asyncio.sleep(seconds)
        finally:
            in_flight[0] -= 1
        return RequestRecord(
            index, item.kind, item.max_tokens, start, Outcome.OK, None, (seconds,), seconds
        )

    return send_one


def test_fixed_concurrency_never_exceeds_its_bound() -> None:
    in_flight, peak = [0], [0]
    result = asyncio.run(
        run_load(ITEMS, _sleeper(0.05, in_flight, peak), Arrivals(None, 3), None, seed=0)
    )
    assert peak[0] == 3
    assert [r.index for r in result.records] == list(range(8))
    assert all(r.outcome is Outcome.OK for r in result.records)
    assert 0.15 <= result.duration_s < 1.0  # 8 requests, 3 at a time: 3 waves of 0.05 s


def test_poisson_arrivals_follow_the_offsets() -> None:
    in_flight, peak = [0], [0]
    result = asyncio.run(
        run_load(ITEMS, _sleeper(0.0, in_flight, peak), Arrivals(20.0, None), None, seed=4)
    )
    want = poisson_offsets(len(ITEMS), 20.0, seed=4)
    for r, t in zip(result.records, want, strict=True):
        assert t <= r.start_s < t + 0.1


def test_time_limit_cancels_in_flight_and_skips_unsent() -> None:
    in_flight, peak = [0], [0]
    result = asyncio.run(
        run_load(ITEMS, _sleeper(10.0, in_flight, peak), Arrivals(None, 2), 0.2, seed=0)
    )
    assert result.duration_s < 2.0
    assert [r.outcome for r in result.records] == [Outcome.CANCELLED] * 2  # 6 never sent
    assert in_flight[0] == 0


def test_unreachable_server_becomes_error_records() -> None:
    async def go() -> list[RequestRecord]:
        target = Target("m", "chat", 0.0, None)
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9/v1", timeout=5) as client:
            return [await send_streamed(client, target, i, ITEMS[i], 0.0) for i in range(2)]

    records = asyncio.run(go())
    assert [(r.outcome, r.error) for r in records] == [(Outcome.ERROR, "ConnectError")] * 2


def test_requests_are_seeded_by_index_and_warm_ups_not() -> None:
    """The API refuses a negative seed, so the warm-up (index -1) must carry none."""
    target = Target("m", "chat", 0.0, seed=5)
    assert request_body(target, ITEMS[0], 3)["seed"] == 8
    assert "seed" not in request_body(target, ITEMS[0], -1)
    assert "seed" not in request_body(Target("m", "chat", 0.0, seed=None), ITEMS[0], 3)

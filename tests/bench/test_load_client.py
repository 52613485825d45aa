"""The load scheduler: concurrency bound, Poisson spacing, time limit, failures as records."""

from __future__ import annotations

import asyncio
import time

import httpx

from bench.load_client import (
    Arrivals,
    LoadResult,
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
            await asyncio.sleep(seconds)  # a request that takes this long: the load under test
        finally:
            in_flight[0] -= 1
        return RequestRecord(
            index, item.kind, item.max_tokens, start, Outcome.OK, None, (seconds,), seconds
        )

    return send_one


def test_fixed_concurrency_never_exceeds_its_bound() -> None:
    in_flight, peak = [0], [0]
    result = asyncio.run(
        run_load(ITEMS, _sleeper(0.1, in_flight, peak), Arrivals(None, 3), None, seed=0)
    )
    assert peak[0] == 3
    assert [r.index for r in result.records] == list(range(8))
    assert all(r.outcome is Outcome.OK for r in result.records)
    one_at_a_time = asyncio.run(
        run_load(ITEMS, _sleeper(0.1, [0], [0]), Arrivals(None, 1), None, seed=0)
    )
    # 8 requests, 3 at a time: 3 waves of 0.1 s, sooner than 8 one at a time on this machine
    assert 0.3 <= result.duration_s < one_at_a_time.duration_s


def test_poisson_arrivals_follow_the_offsets() -> None:
    """Each request starts at its offset: never before, and late by no more than plain timers
    at the same offsets on the same loop are (the baseline: what the machine's load adds to
    any wake-up) plus one mean gap between arrivals."""
    want = poisson_offsets(len(ITEMS), 20.0, seed=4)
    late: list[float] = []

    async def timers() -> None:
        t0 = time.perf_counter()
        for t in want:
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))  # the plain timer
            late.append(time.perf_counter() - t0 - t)

    async def run() -> LoadResult:
        in_flight, peak = [0], [0]
        load = run_load(ITEMS, _sleeper(0.0, in_flight, peak), Arrivals(20.0, None), None, seed=4)
        result, _ = await asyncio.gather(load, timers())
        return result

    result = asyncio.run(run())
    gap = want[-1] / (len(want) - 1)
    for r, t in zip(result.records, want, strict=True):
        assert t <= r.start_s < t + max(late) + gap


def test_time_limit_cancels_in_flight_and_skips_unsent() -> None:
    in_flight, peak = [0], [0]
    result = asyncio.run(
        run_load(ITEMS, _sleeper(10.0, in_flight, peak), Arrivals(None, 2), 0.2, seed=0)
    )
    assert result.duration_s < 10.0  # did not wait for the two it sent, each 10 s long
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

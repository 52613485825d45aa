"""The asynchronous side of a load run: one streamed request, and many of them on a schedule.

Requests go over httpx's async client with server-sent events parsed here, so hundreds can be in
flight from one process and the non-standard ``usage.speculative`` is read as sent. A request's
failure becomes a record, never an exception: the run always finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from bench.load_metrics import Outcome, RequestRecord
from bench.workloads import WorkItem, poisson_offsets

Endpoint = Literal["chat", "completions"]
SendOne = Callable[[int, WorkItem, float], Awaitable[RequestRecord]]


@dataclass(frozen=True)
class Target:
    """Where and how requests are sent."""

    model: str
    endpoint: Endpoint
    temperature: float
    seed: int | None  # request i is sent with seed + i (reproducible sampling when set)


@dataclass(frozen=True)
class Arrivals:
    """When requests are sent: a Poisson process of ``request_rate`` per second, at most
    ``concurrency`` in flight (either may be None, not both)."""

    request_rate: float | None
    concurrency: int | None


@dataclass(frozen=True)
class LoadResult:
    records: tuple[RequestRecord, ...]  # in workload order; requests never sent are absent
    duration_s: float


async def fetch_model_id(client: httpx.AsyncClient) -> str:
    """The first model id the server lists at GET /v1/models."""
    resp = await client.get("models")
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def request_body(target: Target, item: WorkItem, index: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": item.max_tokens,
        "temperature": target.temperature if item.temperature is None else item.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.seed is not None and index >= 0:  # warm-ups (index -1) go unseeded
        body["seed"] = target.seed + index
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    return body


def _content(event: dict[str, Any]) -> bool:
    """Whether a stream event carries generated text (chat delta or completion text)."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            return True
    return False


def _record(
    index: int,
    item: WorkItem,
    start_s: float,
    times: Sequence[float],
    e2e_s: float,
    usage: dict[str, Any] | None,
) -> RequestRecord:
    spec = (usage or {}).get("speculative") or {}
    return RequestRecord(
        index=index,
        kind=item.kind,
        max_tokens=item.max_tokens,
        start_s=start_s,
        outcome=Outcome.OK,
        content_times_s=tuple(times),
        e2e_s=e2e_s,
        prompt_tokens=int(usage["prompt_tokens"]) if usage else None,
        output_tokens=int(usage["completion_tokens"]) if usage else len(times),
        draft_tokens=int(spec["draft_tokens"]) if "draft_tokens" in spec else None,
        accepted_tokens=int(spec["accepted_tokens"]) if "accepted_tokens" in spec else None,
        mean_accepted_length=(
            float(spec["mean_accepted_length"]) if "mean_accepted_length" in spec else None
        ),
        num_steps=int(spec["num_steps"]) if "num_steps" in spec else None,
    )


async def send_streamed(
    client: httpx.AsyncClient, target: Target, index: int, item: WorkItem, run_start: float
) -> RequestRecord:
    """Send one streaming request and time its content chunks (``run_start``: perf_counter)."""
    path = "chat/completions" if target.endpoint == "chat" else "completions"
    sent = time.perf_counter()
    times: list[float] = []
    usage: dict[str, Any] | None = None

    def failed(key: str) -> RequestRecord:
        return RequestRecord(
            index, item.kind, item.max_tokens, sent - run_start, Outcome.ERROR, key, tuple(times)
        )

    try:
        async with client.stream("POST", path, json=request_body(target, item, index)) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return failed(str(resp.status_code))
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return failed("stream_error")
                if _content(event):
                    times.append(time.perf_counter() - sent)
                usage = event.get("usage") or usage
            if not done:
                return failed("incomplete_stream")
    except Exception as e:  # a load client must survive anything one request does
        return failed(type(e).__name__)
    return _record(index, item, sent - run_start, times, time.perf_counter() - sent, usage)


async def run_load(
    items: Sequence[WorkItem],
    send_one: SendOne,
    arrivals: Arrivals,
    max_seconds: float | None,
    seed: int,
) -> LoadResult:
    """Send ``items`` on the ``arrivals`` schedule; at ``max_seconds`` stop sending and cancel
    what is in flight (recorded as CANCELLED)."""
    if arrivals.request_rate is None and arrivals.concurrency is None:
        raise ValueError("give a request rate, a concurrency, or both")
    start = time.perf_counter()
    if not items:
        return LoadResult((), 0.0)
    rate = arrivals.request_rate
    offsets = poisson_offsets(len(items), rate, seed) if rate else [0.0] * len(items)
    gate = asyncio.Semaphore(arrivals.concurrency) if arrivals.concurrency else None
    started: dict[int, float] = {}

    async def one(i: int, item: WorkItem) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        async with gate if gate is not None else contextlib.nullcontext():
            started[i] = time.perf_counter() - start
            return await send_one(i, item, start)

    tasks = [asyncio.create_task(one(i, item)) for i, item in enumerate(items)]
    done, pending = await asyncio.wait(tasks, timeout=max_seconds)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - start
    records: list[RequestRecord] = []
    for i, task in enumerate(tasks):
        item = items[i]
        if task in done and task.exception() is None:
            records.append(task.result())
        elif task in done:
            err = type(task.exception()).__name__
            records.append(
                RequestRecord(
                    i, item.kind, item.max_tokens, started.get(i, 0.0), Outcome.ERROR, err
                )
            )
        elif i in started:
            records.append(
                RequestRecord(i, item.kind, item.max_tokens, started[i], Outcome.CANCELLED)
            )
    return LoadResult(tuple(records), duration)
